"""bench/gpu_suite.py's results: results.json, results.md (the tables of docs/performance.md and docs/planning.md,
every planned row with its figures or the reason it has none) and logs.tar.gz, each rewritten whole after every row
through a temporary file and a rename, so a run stopped at any moment leaves the last complete version."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """`data` into `path` by a rename: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def keep_earlier(out: Path) -> None:
    """An earlier run's results.json / .md in `out` renamed by its date (results-<date>.json), not overwritten."""
    path = out / "results.json"
    if not path.exists():
        return
    try:
        stamp = json.loads(path.read_text())["environment"]["date"].replace(":", "").replace("+0000", "Z")
    except (ValueError, KeyError, TypeError):
        stamp = "unreadable"
    for suffix in (".json", ".md"):
        if (out / f"results{suffix}").exists():
            (out / f"results{suffix}").rename(out / f"results-{stamp}{suffix}")
    print(f"[gpu-suite] an earlier {path} is kept as results-{stamp}.json", flush=True)


def write_results(out: Path, doc: dict, logs: Path | None = None) -> Path:
    """results.json, results.md and (when `logs` exists) logs.tar.gz under `out`, each replaced whole."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", json.dumps(doc, indent=1))
    try:
        table = markdown(doc)
    except Exception as e:  # noqa: BLE001 - figures of an unexpected shape must not stop the suite: the JSON has them
        table = f"# GPU suite\n\nthe tables could not be made ({type(e).__name__}: {e}); results.json has every row\n"
    write_atomic(out / "results.md", table)
    if logs is not None and logs.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(logs, arcname="logs")
        write_atomic(out / "logs.tar.gz", buffer.getvalue())
    return out / "results.json"


def document(size: str, minutes: float, info: dict, found: dict, rows: list, selected: set[str], results: dict,
             argv: list[str]) -> dict:
    """results.json's content: the environment, the preflight, every row with its result or why it has none."""
    entries = []
    for row in rows:
        facts = {"name": row.name, "kind": row.kind, "shape": row.shape, "core": row.core, "steps": row.steps,
                 "budget_s": row.budget_s, "command": " ".join(row.command)}
        if row.name in results:
            entries.append({**facts, **results[row.name]})
        elif row.name in selected:
            entries.append({**facts, "status": "pending", "reason": "not reached: the suite stopped before this row"})
        else:
            entries.append({**facts, "status": "not run", "reason": "not selected (--rows)"})
    return {"suite": "bench/gpu_suite.py", "size": size, "minutes": minutes, "environment": info, "argv": argv,
            "preflight": {k: found.get(k) for k in ("missing_core", "missing", "unmet", "modules")}, "rows": entries}


def markdown(doc: dict) -> str:
    """The results as the tables of docs/performance.md and docs/planning.md, every row with figures or a reason."""
    env = doc["environment"]
    device = env["device"]
    lines = [f"# GPU suite: {device.get('name')}" + (f" ({device['memory_gib']} GiB, CUDA {device['cuda_version']})"
                                                      if device.get("cuda") else ""), "",
             f"size {doc['size']} | code {env['code']} | commit {env['commit']} | {env['date']} | "
             f"{doc['minutes']:g} minutes | argv: {' '.join(doc['argv']) or '-'}", "",
             "versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v), ""]
    pre = doc["preflight"]
    for name, why in (pre.get("missing") or {}).items():
        lines.append(f"- missing {name}: {why}")
    for dist, unmet in (pre.get("unmet") or {}).items():
        lines.append(f"- {dist} needs " + "; ".join(unmet))
    rows = doc["rows"]
    keys = ("s/step", "tokens/s", "peak GB", "MFU", "start-up s")
    lines += ["", "## posttrain vs TRL (bench/compare_trl.py; steady state: the first steps left out)", "",
              "| row | shape | steps | " + " | ".join(f"posttrain {k}" for k in keys) + " | "
              + " | ".join(f"TRL {k}" for k in keys)
              + " | speed | memory | start-up | status |", "|---" * (2 * len(keys) + 7) + "|"]
    for r in (r for r in rows if r["kind"] == "compare"):
        tools = (r.get("figures") or {}).get("tools", {})
        ours, theirs = tools.get("posttrain", {}), tools.get("trl", {})
        ratios = (_ratio(theirs, ours, "s/step"), _ratio(ours, theirs, "peak GB"), _ratio(ours, theirs, "start-up s"))
        lines.append(f"| {r['name']} | {r['shape']} | {r['steps']} | " + " | ".join(_fmt(k, ours.get(k)) for k in keys)
                     + " | " + " | ".join(_fmt(k, theirs.get(k)) for k in keys) + " | " + " | ".join(ratios)
                     + f" | {_status(r)} |")
    lines += ["", "speed: TRL's s/step over posttrain's; memory and start-up: posttrain's over TRL's. steps: run, "
              "then how many were left out before timing. MFU: 6 x parameters + attention FLOPs per trained token over "
              "989 TFLOP/s (H100 / H200 dense bf16) on CUDA, over the measured matmul rate on a CPU; none for GRPO "
              "(generation dominates)."]
    lines += ["", "## posttrain plan's estimate vs the measured peak (bench/plan_accuracy.py)", "",
              "| row | engine | device | rows x tokens | estimate | measured | error | status |", "|---" * 8 + "|"]
    for r in (r for r in rows if r["kind"] == "plan"):
        f, mib = r.get("figures") or {}, 2**20
        shape = f"{f['rows']} x {f['length']}" if f.get("rows") else r["shape"]
        numbers = all(isinstance(f.get(k), (int, float)) for k in ("estimate", "measured", "error_percent"))
        lines.append(f"| {r['name']} | {f.get('engine', '-')} | {f.get('device', '-')} | {shape} | "
                     + (f"{f['estimate'] / mib:.1f} MiB | {f['measured'] / mib:.1f} MiB | {f['error_percent']:+.1f}%"
                        if numbers else "- | - | -") + f" | {_status(r)} |")
    lines += ["", "measured: torch.cuda.max_memory_allocated on a GPU; on a CPU the allocator's peak (a separate run) "
              "or, for a row read from a finished run, its peak RSS, which is not comparable (docs/planning.md)."]
    lines += ["", "## Vision-language SFT (bench/vision_step.py: the whole command's seconds over its steps)", "",
              "| row | device | steps | loss | s/step | tokens/s | peak MB | status |", "|---" * 8 + "|"]
    for r in (r for r in rows if r["kind"] == "vision"):
        f = r.get("figures") or {}
        lines.append(f"| {r['name']} | {f.get('device', '-')} | {f.get('steps', '-')} | "
                     + " | ".join(f"{f[k]:.4g}" if isinstance(f.get(k), (int, float)) else "-"
                                  for k in ("loss", "s/step", "tokens/s", "peak_memory_mb")) + f" | {_status(r)} |")
    lines += ["", "## Preparation", "", "| row | shape | status |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['shape']} | {_status(r)} |" for r in rows if r["kind"] == "prepare"]
    return "\n".join(lines) + "\n"


def _status(r: dict) -> str:
    text = r["status"] + (f" in {r['seconds']:.0f} s" if r.get("seconds") is not None else "")
    return (text + f": {r['reason']}" if r.get("reason") else text).replace("|", "/").replace("\n", " ")


def _ratio(top: dict, bottom: dict, key: str) -> str:
    a, b = top.get(key), bottom.get(key)
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and b else "-"


def _fmt(key: str, value) -> str:
    if not isinstance(value, (int, float)):  # none, or what a broken bench script wrote: the table still renders
        return "-"
    if key == "MFU":
        return f"{value:.1%}"
    return f"{value:,.0f}" if key == "tokens/s" else f"{value:.3f}" if key == "s/step" else f"{value:.2f}"
