"""bench/compare_trl.py's printed summary: one markdown table of each tool's figures (its best repeat), then the
ratios that matter: posttrain (shared prefixes) and posttrain-plain over TRL, and shared over plain prefixes."""

from __future__ import annotations


def print_summary(a, best: dict[str, dict], size: str, where: str) -> None:
    """The table of every tool's best repeat and the ratios: each posttrain side over TRL, shared over plain."""
    print(f"\n{a.algo} | {a.model or 'size ' + a.size} ({size}) | bs {a.bs} | seq {a.seq} | {a.precision} | gc {a.gc}"
          f" | packing {a.packing} | {where} | best of {a.repeats}")
    keys = ["s/step", "CPU s/step", "tokens/s", "trained forward tokens/step", "peak GB", "MFU", "start-up s",
            "first loss"]
    print("| tool | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    for tool, row in best.items():
        print(f"| {tool} | " + " | ".join(_fmt(k, row.get(k)) for k in keys) + " |")
    for ours_name in ("posttrain", "posttrain-plain"):
        if ours_name in best and "trl" in best:
            ours, theirs = best[ours_name], best["trl"]
            print(f"{ours_name} / TRL: speed {theirs['s/step'] / ours['s/step']:.2f}x (CPU time "
                  f"{ours['CPU s/step'] / theirs['CPU s/step']:.2f}x), memory {ours['peak GB'] / theirs['peak GB']:.2f}x, "
                  f"trained forward tokens {_ratio(ours, theirs, 'trained forward tokens/step')}, "
                  f"start-up {ours['start-up s'] / theirs['start-up s']:.2f}x")
    if "posttrain" in best and "posttrain-plain" in best:  # what sharing the prefixes bought
        shared, plain = best["posttrain"], best["posttrain-plain"]
        print(f"shared / plain prefixes: speed {plain['s/step'] / shared['s/step']:.2f}x, memory "
              f"{shared['peak GB'] / plain['peak GB']:.2f}x")
    if "posttrain" in best and "trl" in best:
        ours, theirs = best["posttrain"], best["trl"]
        print("\n| run | posttrain / TRL step time | posttrain / TRL peak memory |\n|---|---|---|\n"
              f"| {a.algo}, {a.model or a.size}, bs {a.bs}, {a.steps} steps, {a.precision} | "
              f"{ours['s/step'] / theirs['s/step']:.2f} | {ours['peak GB'] / theirs['peak GB']:.2f} |")


def _ratio(ours: dict, theirs: dict, key: str) -> str:
    return f"{ours[key] / theirs[key]:.2f}x" if ours.get(key) and theirs.get(key) else "-"


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "MFU":
        return f"{value:.1%}"
    if key in ("tokens/s", "forwarded/step", "trained forward tokens/step"):
        return f"{value:,.0f}"
    return f"{value:.3f}" if key in ("s/step", "CPU s/step", "first loss") else f"{value:.2f}"
