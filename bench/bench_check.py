"""`make bench-check`: rerun the checked-in posttrain-vs-TRL baselines (bench/baselines/*.json) and fail when a ratio
got more than 10% worse.

    .venv/bin/python bench/bench_check.py                     # every baseline: rerun, compare, exit 1 if worse
    .venv/bin/python bench/bench_check.py grpo dpo            # some of them
    .venv/bin/python bench/bench_check.py --write [NAMES]     # measure again and write the baseline files

Each baseline is one bench/compare_trl.py run at the realistic shape of its algorithm (bench/trl_shapes.py) on a
small generated model (size 5m: 4 layers, hidden 256), posttrain with shared prefixes beside posttrain-plain and TRL.
The checked figures are ratios, posttrain over TRL, lower is better, each run's two tools measured on the same
machine minutes apart:
- trained forward tokens / step: the tokens through the input embeddings while autograd records (each prompt once
  per group with shared prefixes; every row's prompt and padding in TRL);
- peak memory: the process's peak resident set size (CUDA: max_memory_allocated);
- CPU time / step: the process's CPU seconds per steady step, which the load of a shared machine moves far less than
  the wall-clock step time (recorded, with the load average, but not checked).
A check fails when a ratio is above its baseline's by more than TOLERANCE (relative), or a tool fails to run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "bench" / "baselines"
TOLERANCE = 0.10
COMMON = ["--shape", "realistic", "--size", "5m", "--repeats", "1", "--warmup", "1"]
RUNS = {  # name: bench/compare_trl.py flags
    "grpo": ["--algo", "grpo", "--steps", "3", *COMMON],
    "dpo": ["--algo", "dpo", "--steps", "4", *COMMON],
    "agents": ["--algo", "agents", "--steps", "3", *COMMON],
}
CHECKED = {"trained forward tokens": "trained forward tokens/step", "peak memory": "peak GB",
           "CPU time": "CPU s/step"}
"""Ratio name -> compare_trl's figure whose posttrain / TRL ratio it is."""


def machine() -> dict:
    """What the figures were measured on, and how loaded it was when the run started."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory GiB": round(memory, 1), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "load average at start": os.getloadavg()}


def commit() -> str:
    """The commit measured, +changes when the code that runs (posttrain/, bench/ but its baselines) differs from it."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "posttrain", "bench",
                            ":!bench/baselines"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def measure(name: str, tools: str) -> dict:
    """One compare_trl.py run of baseline `name`: its figures per tool, the ratios, and where it ran."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, str(ROOT / "bench" / "compare_trl.py"), *RUNS[name], "--tools", tools,
                   "--json", str(out)]
        started, facts = time.time(), machine()
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout[-3000:], flush=True)
        figures = json.loads(out.read_text()) if out.exists() else {"tools": {}, "errors": {}}
    tools_run = figures["tools"]
    if done.returncode or "posttrain" not in tools_run or "trl" not in tools_run:
        raise SystemExit(f"{name}: bench/compare_trl.py exited {done.returncode}: {figures.get('errors') or ''}\n"
                         f"{done.stderr[-3000:]}")
    ours, theirs = tools_run["posttrain"], tools_run["trl"]
    ratios = {ratio: ours[key] / theirs[key] for ratio, key in CHECKED.items()}
    ratios["wall time (not checked)"] = ours["s/step"] / theirs["s/step"]
    keep = ("s/step", "CPU s/step", "peak GB", "trained forward tokens/step", "forwarded/step", "first loss")
    return {"algorithm": name, "command": "python bench/compare_trl.py " + " ".join(RUNS[name] + ["--tools", tools]),
            "commit": commit(), "measured": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
            "seconds": round(time.time() - started), "machine": {**facts, "load average at end": os.getloadavg()},
            "tools": {tool: {k: row.get(k) for k in keep} for tool, row in tools_run.items()},
            "ratios to TRL": ratios, "checked": list(CHECKED), "tolerance": TOLERANCE}


def worse(baseline: dict, now: dict) -> list[str]:
    """The checked ratios of `now` more than the tolerance above the baseline's, in words."""
    return [f"{ratio}: {now['ratios to TRL'][ratio]:.3f} against {baseline['ratios to TRL'][ratio]:.3f} "
            f"(+{now['ratios to TRL'][ratio] / baseline['ratios to TRL'][ratio] - 1:.0%})"
            for ratio in baseline["checked"]
            if now["ratios to TRL"][ratio] > baseline["ratios to TRL"][ratio] * (1 + baseline["tolerance"])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"baselines to run (default: all of {', '.join(RUNS)})")
    p.add_argument("--write", action="store_true", help="measure and write bench/baselines/NAME.json")
    a = p.parse_args()
    unknown = [name for name in a.names if name not in RUNS]
    if unknown:
        p.error(f"no baseline named {', '.join(unknown)}: choose from {', '.join(RUNS)}")
    names = a.names or list(RUNS)
    failed = []
    for name in names:
        path = BASELINES / f"{name}.json"
        if a.write:
            BASELINES.mkdir(exist_ok=True)
            path.write_text(json.dumps(measure(name, "posttrain,posttrain-plain,trl"), indent=1) + "\n")
            print(f"wrote {path.relative_to(ROOT)}")
            continue
        if not path.exists():
            raise SystemExit(f"no baseline {path.relative_to(ROOT)}: run bench/bench_check.py --write {name}")
        baseline, now = json.loads(path.read_text()), measure(name, "posttrain,trl")
        off = worse(baseline, now)
        said = ", ".join(f"{r} {now['ratios to TRL'][r]:.3f} (baseline {baseline['ratios to TRL'][r]:.3f})"
                         for r in baseline["checked"])
        print(f"{name}: {'WORSE: ' + '; '.join(off) if off else 'ok'} | {said} | load "
              f"{now['machine']['load average at start'][0]:.1f} (baseline "
              f"{baseline['machine']['load average at start'][0]:.1f})", flush=True)
        failed += [name] if off else []
    if failed:
        sys.exit(f"bench-check: {', '.join(failed)} more than {TOLERANCE:.0%} worse than bench/baselines")


if __name__ == "__main__":
    main()
