"""bench/gpu_suite.py's results.json as markdown: the tables of docs/performance.md and docs/planning.md, every
planned row with its figures or the reason it has none."""

from __future__ import annotations


def markdown(doc: dict) -> str:
    """The results as the tables of docs/performance.md and docs/planning.md, every row with figures or a reason."""
    env = doc["environment"]
    device = env["device"]
    lines = [f"# GPU suite: {device.get('name')}" + (f" ({device['memory_gib']} GiB, CUDA {device['cuda_version']})"
                                                      if device.get("cuda") else ""), "",
             f"size {doc['size']} | code {env['code']} | commit {env['commit']} | first run {env['date']} | runs: "
             + ", ".join(r["date"] for r in doc["runs"]), "",
             "versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v), ""]
    pre = doc["preflight"]
    for name, why in (pre.get("missing") or {}).items():
        lines.append(f"- missing {name}: {why}")
    for dist, unmet in (pre.get("unmet") or {}).items():
        lines.append(f"- {dist} needs " + "; ".join(unmet))
    rows = doc["rows"]
    keys = ("s/step", "tokens/s", "peak GB", "MFU", "start-up s")
    lines += ["", "## posttrain vs TRL (bench/compare_trl.py; best repeat, steady state)", "",
              "| row | shape | " + " | ".join(f"posttrain {k}" for k in keys) + " | "
              + " | ".join(f"TRL {k}" for k in keys)
              + " | speed | memory | start-up | status |", "|---" * (2 * len(keys) + 6) + "|"]
    for r in (r for r in rows if r["kind"] == "compare"):
        tools = (r.get("figures") or {}).get("tools", {})
        ours, theirs = tools.get("posttrain", {}), tools.get("trl", {})
        ratios = (_ratio(theirs, ours, "s/step"), _ratio(ours, theirs, "peak GB"), _ratio(ours, theirs, "start-up s"))
        lines.append(f"| {r['name']} | {r['shape']} | " + " | ".join(_fmt(k, ours.get(k)) for k in keys) + " | "
                     + " | ".join(_fmt(k, theirs.get(k)) for k in keys) + " | " + " | ".join(ratios)
                     + f" | {_status(r)} |")
    lines += ["", "speed: TRL's s/step over posttrain's; memory and start-up: posttrain's over TRL's. MFU: 6 x "
              "parameters + attention FLOPs per trained token over 989 TFLOP/s (H100 / H200 dense bf16) on CUDA, over "
              "the measured matmul rate on a CPU; none for GRPO (generation dominates)."]
    lines += ["", "## posttrain plan's estimate vs the measured peak (bench/plan_accuracy.py)", "",
              "| row | engine | device | rows x tokens | estimate | measured | error | run's own estimate | status |",
              "|---" * 9 + "|"]
    for r in (r for r in rows if r["kind"] == "plan"):
        f, mib = r.get("figures") or {}, 2**20
        lines.append(f"| {r['name']} | {f.get('engine', '-')} | {f.get('device', '-')} | "
                     + (f"{f['rows']} x {f['length']} | {f['estimate'] / mib:.1f} MiB | {f['measured'] / mib:.1f} MiB"
                        f" | {f['error_percent']:+.1f}% | {f.get('logged_estimate_mb') or '-'} MiB" if f else
                        "- | - | - | - | -") + f" | {_status(r)} |")
    lines += ["", "## Preparation", "", "| row | shape | status |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['shape']} | {_status(r)} |" for r in rows if r["kind"] == "prepare"]
    return "\n".join(lines) + "\n"


def _status(r: dict) -> str:
    text = r["status"] + (f" in {r['seconds']:.0f} s" if "seconds" in r else "")
    return (text + f": {r['reason']}" if r.get("reason") else text).replace("|", "/").replace("\n", " ")


def _ratio(top: dict, bottom: dict, key: str) -> str:
    return f"{top[key] / bottom[key]:.2f}x" if top.get(key) and bottom.get(key) else "-"


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "MFU":
        return f"{value:.1%}"
    return f"{value:,.0f}" if key == "tokens/s" else f"{value:.3f}" if key == "s/step" else f"{value:.2f}"
