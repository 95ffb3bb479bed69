"""The GPU figures of docs/performance.md and docs/planning.md in one command, into one results file that says on
what, with which versions, when and from which commit they were measured.

    bash bench/gpu_suite.sh --part 1        # on a lent GPU machine: the carried wheels (.whl/), then part 1 of 3
    python bench/gpu_suite.py               # every part, one after the other (a GPU machine of your own)
    python bench/gpu_suite.py --dry-run     # the preflight and the plan: what would run, what would skip and why
    python bench/gpu_suite.py --size tiny --rows plan --tools posttrain    # the same rows at tiny shapes, on a CPU

Rows:
- posttrain vs TRL (bench/compare_trl.py: s/step, tokens/s, peak memory, MFU, start-up to the first step) for the
  GPU rows of docs/performance.md: Qwen2.5-0.5B and -1.5B shapes, SFT / DPO / GRPO, bf16 autocast, with and without
  gradient checkpointing. Without trl (or with --tools posttrain) the TRL side says why it has no figures.
- `posttrain plan`'s estimate vs the measured peak (bench/plan_accuracy.py) for SFT / DPO / GRPO on the 0.5B shape,
  in one process: plain (DDP-1), DeepSpeed ZeRO-2 and ZeRO-3 (accelerate launch --num_processes 1).
Each row runs in its own process group under its own time budget: one over it is stopped and recorded as failed,
and the next row runs. A run stops starting rows at --minutes. The parts each fit a 10-minute command (at most 9
minutes of budgets each, 25 minutes together); a part needs the model it measures, made by its "prepare" row.

Results: OUT/results.json and OUT/results.md (OUT: --out, default bench/results/gpu-suite): device, versions, date,
commit, the preflight, then every planned row with its figures, or skipped / failed / not run with the reason.
A later part merges into the file when it ran on the same device, versions and code; otherwise the older file is
kept beside it under its date. Exit status: 0 when no row failed, 1 when one did or the preflight found posttrain
itself unable to run (every row is then recorded as skipped, with what is missing), 2 for bad options.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # this checkout's posttrain (not an installed one), the report
from gpu_suite_report import markdown  # noqa: E402 - beside this file, which may be loaded by path (tests)

CORE = ("torch", "transformers", "accelerate", "datasets", "safetensors", "yaml", "posttrain")
OPTIONAL = ("trl", "deepspeed")  # imported only when a selected row needs it (trl: the TRL side)
VERSIONS = ("torch", "transformers", "accelerate", "datasets", "trl", "deepspeed", "peft", "pyarrow", "tokenizers")


@dataclass(frozen=True)
class Row:
    """One measurement: a bench script in its own process group under a time budget."""

    name: str
    """The key in the results file; the same at every --size (the GPU shape it stands for)."""
    kind: str
    """prepare | compare | plan."""
    shape: str
    """What actually runs at this --size, e.g. 'tiny bs2x64'."""
    command: tuple[str, ...]
    """argv, relative to the repository root."""
    budget_s: float
    """Seconds before the row's process group is stopped and the row recorded as failed."""
    parts: tuple[int, ...]
    """The parts (--part) that run it: a prepare row belongs to every part that needs its model."""
    needs: tuple[str, ...] = ()
    """cuda, bf16, deepspeed: what must be here for the row to run at all (else it is skipped with the reason)."""
    after: tuple[str, ...] = ()
    """Rows that must have passed in this run first (the model's prepare row)."""


@dataclass(frozen=True)
class Scale:
    """The shapes a --size gives the rows."""

    model: dict
    """docs' model name -> bench/compare_trl.py --size."""
    compare: dict
    """algorithm -> (batch, length or None for the GPU row's, steps, warmup, budget seconds or None)."""
    plan_overrides: dict
    """algorithm -> the recipe overrides of its plan rows."""
    plan_budget: float
    """Seconds of a plain plan row (ZeRO and GRPO rows get more, PLAN_ENGINES)."""
    needs: tuple[str, ...]
    """What every row needs at this size (Row.needs)."""


# docs/performance.md's GPU rows: (part, algorithm, model, batch, length, gradient checkpointing, budget seconds).
# GRPO: batch = completions (8 per prompt), length = completion tokens. The budgets hold the model load, both tools'
# start-up and the steps; what a row leaves unused is spent by later rows, never past --minutes.
COMPARE = (
    (1, "sft", "0.5b", 8, 1024, False, 90),
    (1, "sft", "0.5b", 8, 1024, True, 90),
    (1, "dpo", "0.5b", 8, 1024, False, 120),
    (1, "grpo", "0.5b", 32, 128, False, 150),
    (3, "sft", "1.5b", 8, 2048, True, 150),
    (3, "dpo", "1.5b", 8, 1024, True, 150),
)
PLAN_ENGINES = {  # engine -> (launcher before the script, budget factor): ZeRO adds DeepSpeed's start and hooks
    "ddp1": ((), 1.0),
    "zero2": (("-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/zero2.yaml",
               "--num_processes", "1"), 1.2),
    "zero3": (("-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/zero3.yaml",
               "--num_processes", "1"), 1.4),
}
PLAN_PART, PLAN_MODEL = 2, "0.5b"
PREPARE_BUDGET = {"0.5b": 60, "1.5b": 120, "tiny": 120}
GPU_PLAN = ("model.dtype=bfloat16", "train.mixed_precision=bf16", "train.per_device_train_batch_size=8")
TINY_PLAN = ("train.mixed_precision=bf16", "train.per_device_train_batch_size=4", "data.max_length=64")
SCALES = {
    "gpu": Scale(model={"0.5b": "0.5b", "1.5b": "1.5b"},
                 compare={"sft": (None, None, 20, 3, None), "dpo": (None, None, 15, 3, None),
                          "grpo": (None, None, 6, 2, None)},
                 plan_overrides={"sft": GPU_PLAN + ("data.max_length=1024",),
                                 "dpo": GPU_PLAN + ("data.max_length=1024",),
                                 "grpo": GPU_PLAN + ("generation.max_completion_length=128",)},
                 plan_budget=38, needs=("cuda", "bf16")),
    "tiny": Scale(model={"0.5b": "tiny", "1.5b": "tiny"},
                  compare={"sft": (2, 64, 4, 1, 300), "dpo": (2, 64, 4, 1, 300), "grpo": (4, 8, 3, 1, 300)},
                  plan_overrides={"sft": TINY_PLAN, "dpo": TINY_PLAN, "grpo": TINY_PLAN + (
                      "generation.max_completion_length=8", "algo.num_generations=4")},
                  plan_budget=150, needs=()),
}


def plan_rows(size: str, work: Path, tools: str, model_dir: str | None = None) -> list[Row]:
    """Every row of the suite at this size, in the order they run. model_dir: a real model directory that every
    compare row (and a distillation row, the model teaching itself) and plan row trains instead of the generated
    shapes (bench/compare_trl.py --model)."""
    scale, py = SCALES[size], "python"
    real = ("--model", model_dir) if model_dir else ()
    rows, parts, longest = [], {PLAN_MODEL: {PLAN_PART}}, {}
    for part, algo, model, bs, length, gc, budget in COMPARE:
        parts.setdefault(model, set()).add(part)
        if algo != "grpo":  # the model's positions and the data's rows cover the longest row
            longest[model] = max(longest.get(model, 0), scale.compare[algo][1] or length)
    for model, model_parts in parts.items():
        size_arg = scale.model[model]
        rows.append(Row(f"prepare {model}", "prepare", size_arg,
                        (py, "bench/compare_trl.py", "--prepare-only", "--size", size_arg, "--seq",
                         str(longest.get(model, 1024)), "--work", str(work / size_arg)), PREPARE_BUDGET[size_arg],
                        tuple(sorted(model_parts)), scale.needs))
    distill = ((1, "distill", "0.5b", 8, 1024, False, 150),) if model_dir else ()
    for part, algo, model, bs, length, gc, budget in COMPARE + distill:
        name = f"{algo} {model_dir or model} bs{bs}x{length}" + (" gc" if gc else "")
        t_bs, t_len, steps, warmup, t_budget = scale.compare["sft" if algo == "distill" else algo]
        bs, length, budget = t_bs or bs, t_len or length, t_budget or budget
        shape_args = (("--bs", str(bs), "--gens", str(max(2, bs // 4)), "--completion", str(length))
                      if algo == "grpo" else ("--bs", str(bs), "--seq", str(length)))
        command = (py, "bench/compare_trl.py", "--algo", algo, "--size", scale.model[model], *shape_args,
                   "--steps", str(steps), "--warmup", str(warmup), "--precision", "bf16", *(("--gc",) if gc else ()),
                   "--tools", tools, "--work", str(work / scale.model[model]), *real)
        rows.append(Row(name, "compare", f"{scale.model[model]} {bs}x{length}{' gc' if gc else ''}", command,
                        budget, (part,), scale.needs, (f"prepare {model}",)))
    for algo in ("sft", "dpo", "grpo"):
        for engine, (launcher, factor) in PLAN_ENGINES.items():
            budget = scale.plan_budget * factor * (1.5 if algo == "grpo" else 1)  # GRPO generates first
            command = (py, *launcher, "bench/plan_accuracy.py", "--algorithm", algo, "--model",
                       model_dir or str(work / scale.model[PLAN_MODEL] / "model"),
                       "--steps", "2" if algo == "grpo" else "3",
                       *scale.plan_overrides[algo])
            needs = scale.needs + (("deepspeed",) if engine != "ddp1" else ())
            rows.append(Row(f"plan {algo} {PLAN_MODEL} {engine}", "plan", scale.model[PLAN_MODEL], command,
                            round(budget), (PLAN_PART,), needs, (f"prepare {PLAN_MODEL}",)))
    return rows


# ----------------------------------------------------------------------------------------------------- preflight
def probe(optional: list[str]) -> dict:
    """What is importable here of CORE and `optional` (in this process: run as `gpu_suite.py --probe NAME...` in a
    child of the suite), each distribution's unmet requirements, and the device."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found: dict = {}
    for name in CORE + tuple(optional):
        try:
            module = importlib.import_module(name)
            found[name] = {"ok": True, "version": getattr(module, "__version__", "?")}
        except BaseException as e:  # noqa: BLE001 - a broken install raises anything; say what it was
            found[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    unmet = {}
    for dist in ("datasets", "trl", "deepspeed", "transformers", "accelerate"):
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.setdefault(dist, []).append(f"{text} (installed: {have or 'none'})")
    device: dict = {"cuda": False}
    if found["torch"]["ok"]:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            device = {"cuda": True, "name": torch.cuda.get_device_name(0),
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "bf16": torch.cuda.is_bf16_supported(), "cuda_version": torch.version.cuda}
        else:
            device["name"] = f"CPU ({os.cpu_count()} cores, torch {torch.get_num_threads()} threads)"
    return {"modules": found, "unmet": unmet, "device": device}


def preflight(env: dict, optional: list[str]) -> dict:
    """The probe, run in a child (a failing import cannot take the suite with it), with what is missing spelled out."""
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", *optional],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        lines, failure = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")], done.stderr.strip()[-800:]
    except subprocess.TimeoutExpired:
        lines, failure = [], "its imports took over 300 s"
    if not lines:
        return {"modules": {}, "unmet": {}, "device": {"cuda": False, "name": "unknown"}, "missing": {},
                "missing_core": [f"the import probe failed: {failure}"]}
    found = json.loads(lines[-1][6:])
    fix = "build the wheels here with scripts/gpu_wheels.sh and carry .whl (docs/performance.md, GPU suite)"
    found["missing_core"] = [f"{n}: {found['modules'][n]['error']}" for n in CORE if not found["modules"][n]["ok"]]
    found["missing"] = {n: f"{found['modules'][n]['error']}; {fix}" for n in optional if not found["modules"][n]["ok"]}
    return found


def skip_reason(row: Row, found: dict) -> str | None:
    """Why this row cannot run here, or None."""
    if found["missing_core"]:
        return "posttrain cannot run here: " + "; ".join(found["missing_core"])
    device = found["device"]
    reasons = {"cuda": None if device["cuda"] else f"needs a CUDA device; this machine has none ({device.get('name')})",
               "bf16": None if device.get("bf16", not device["cuda"]) else f"needs bf16; {device.get('name')} has none",
               "deepspeed": (f"needs deepspeed: {found['missing']['deepspeed']}" if "deepspeed" in found["missing"]
                             else None)}
    return next((reasons[need] for need in row.needs if reasons[need]), None)


def environment(found: dict, commit: str | None) -> dict:
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:  # the doctor's code version: git commit, or a hash of the sources when edited or without git
        try:
            from posttrain.launch.doctor import _code_version
        except ImportError:
            from posttrain.distributed.doctor import _code_version
        code = _code_version()
    except ImportError as e:
        code = f"unknown (posttrain not importable: {e})"
    return {"device": found["device"], "versions": versions, "code": code, "commit": commit or code.split(" ", 1)[-1],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ----------------------------------------------------------------------------------------------------- running
def run_row(row: Row, budget: float, env: dict, scratch: Path) -> dict:
    """The row's command in its own process group; stopped (SIGTERM, then SIGKILL) at the budget. The figures are
    the JSON the bench script wrote, kept also when the row failed or was stopped after writing some."""
    scratch.mkdir(parents=True, exist_ok=True)
    slug = row.name.replace(" ", "-")
    figures_file, log_file = scratch / f"{slug}.json", scratch / f"{slug}.log"
    figures_file.unlink(missing_ok=True)
    command = [sys.executable if arg == "python" else arg for arg in row.command]
    if row.kind == "compare":
        command += ["--json", str(figures_file)]
    elif row.kind == "plan":  # before the recipe overrides, which come last
        at = command.index("bench/plan_accuracy.py") + 1
        command[at:at] = ["--json", str(figures_file)]
    started, status, reason, code = time.monotonic(), "passed", None, None
    with log_file.open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=budget)
            if code:
                status, reason = "failed", f"exited {code}"
        except subprocess.TimeoutExpired:
            status, reason = "failed", f"over its {budget:.0f} s budget: stopped"
        finally:  # SIGTERM to the whole group (what a launcher started too), SIGKILL after a grace period
            from posttrain.generation.serve import stop_group

            stop_group(process)
    figures = json.loads(figures_file.read_text()) if figures_file.exists() else None
    tail = None
    if status == "failed":  # the first exception raised (a launcher's own traceback comes after it), then the end
        lines = log_file.read_text(errors="replace").splitlines()
        raised = [x for x in lines if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", x)]
        reason += f": {raised[0][:600]}" if raised and code else ""
        tail = raised[:5] + ["..."] + lines[-25:]
    if row.kind == "compare":  # why a side has no figures: its error, or not asked for
        notes = [f"{tool}: {error.strip().splitlines()[-1] if error.strip() else 'failed'}"
                 for tool, error in ((figures or {}).get("errors") or {}).items()]
        tools = row.command[row.command.index("--tools") + 1].split(",")
        notes += [f"{tool}: not asked (--tools {','.join(tools)})" for tool in ("posttrain", "trl")
                  if tool not in tools]
        reason = "; ".join(filter(None, [reason, *notes])) or None
    return {"status": status, "reason": reason, "seconds": round(time.monotonic() - started, 1), "figures": figures,
            "log": str(log_file), "log_tail": tail}


def run_suite(rows: list[Row], selected: set[str], found: dict, env: dict, scratch: Path, minutes: float,
              budgets: dict) -> dict[str, dict]:
    """Each selected row in order (skipped with the reason when it cannot run here, its prepare row failed, or the
    time is spent); returns name -> result."""
    deadline, results = time.monotonic() + 60 * minutes, {}
    for row in rows:
        if row.name not in selected:
            continue
        budget = budgets.get(row.name, row.budget_s)
        left = deadline - time.monotonic()
        reason = skip_reason(row, found)
        failed_first = [name for name in row.after if results.get(name, {}).get("status") != "passed"]
        if reason is None and failed_first:
            reason = f"{', '.join(failed_first)} did not pass in this run"
        if reason is None and left < min(budget, 30):
            reason = f"the run's {minutes:g} minutes are spent ({left:.0f} s left, the row's budget is {budget:.0f} s)"
        if reason is not None:
            results[row.name] = {"status": "skipped", "reason": reason}
            print(f"[gpu-suite] {row.name}: skipped: {reason}", flush=True)
            continue
        print(f"[gpu-suite] {row.name} ({row.shape}, budget {min(budget, left):.0f} s) ...", flush=True)
        results[row.name] = run_row(row, min(budget, left), env, scratch)
        r = results[row.name]
        print(f"[gpu-suite] {row.name}: {r['status']} in {r['seconds']} s" + (f": {r['reason']}" if r["reason"]
                                                                               else ""), flush=True)
    return results


# ----------------------------------------------------------------------------------------------------- results
def write_results(out: Path, size: str, info: dict, found: dict, rows: list[Row], results: dict, argv: list[str]
                  ) -> Path:
    """results.json and results.md under `out`, merged with an earlier part's file of the same device, versions and
    code (else that file is kept beside, renamed by its date)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    previous = json.loads(path.read_text()) if path.exists() else None
    if previous and (previous.get("size"), *(previous["environment"].get(k) for k in ("device", "versions", "code"))
                     ) != (size, *(info[k] for k in ("device", "versions", "code"))):
        stamp = previous["environment"]["date"].replace(":", "").replace("+0000", "Z")
        for suffix in (".json", ".md"):
            if (out / f"results{suffix}").exists():
                (out / f"results{suffix}").rename(out / f"results-{stamp}{suffix}")
        print(f"[gpu-suite] {path} came from another device, versions or code: kept as results-{stamp}.json")
        previous = None
    earlier = {r["name"]: r for r in previous["rows"]} if previous else {}
    merged = []
    for row in rows:
        facts = {"name": row.name, "kind": row.kind, "shape": row.shape, "parts": list(row.parts),
                 "budget_s": row.budget_s, "command": " ".join(row.command)}
        if row.name in results:
            merged.append({**facts, **results[row.name], "date": info["date"]})
        elif earlier.get(row.name, {}).get("status", "not run") != "not run":
            merged.append(earlier[row.name])
        else:
            merged.append({**facts, "status": "not run",
                           "reason": f"not selected in this run (it is in part {', '.join(map(str, row.parts))})"})
    doc = {"suite": "bench/gpu_suite.py", "size": size, "environment": previous["environment"] if previous else info,
           "preflight": {k: found.get(k) for k in ("missing_core", "missing", "unmet", "modules")},
           "runs": (previous["runs"] if previous else []) + [{"date": info["date"], "argv": argv}], "rows": merged}
    path.write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(markdown(doc))
    return path


# ----------------------------------------------------------------------------------------------------- command
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SCALES), default="gpu", help="gpu: the real shapes; tiny: CPU-sized")
    p.add_argument("--part", type=int, action="append", choices=(1, 2, 3),
                   help="run only this part (repeatable): 1 the 0.5B comparisons, 2 the plan rows, 3 the 1.5B ones")
    p.add_argument("--rows", help="comma-separated: row names, or words a name holds (their prepare rows run too)")
    p.add_argument("--tools", default="posttrain,trl", choices=("posttrain,trl", "posttrain", "trl"))
    p.add_argument("--model", help="a real model directory (or smollm2: bench/real_model.py) for every row")
    p.add_argument("--minutes", type=float, default=25.0, help="start no row after this many minutes")
    p.add_argument("--budget", action="append", default=[], metavar="ROW=SECONDS", help="another budget for a row")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu-suite"), help="results.json/.md land here")
    p.add_argument("--work", default=str(ROOT / "runs" / "gpu-suite"), help="generated models, data and logs")
    p.add_argument("--commit", help="the commit measured, where this copy has no git (default: the code version)")
    p.add_argument("--dry-run", action="store_true", help="preflight and plan only; nothing runs")
    p.add_argument("--probe", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.probe is not None:
        print("PROBE " + json.dumps(probe(a.probe)), flush=True)
        return 0
    work = Path(a.work).resolve()
    if a.model == "smollm2":
        from real_model import smollm2_dir

        a.model = str(smollm2_dir())
    rows = plan_rows(a.size, work, a.tools, a.model)
    names = {r.name for r in rows}
    budgets = {}
    for item in a.budget:
        name, _, seconds = item.rpartition("=")
        if name not in names or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--budget {item!r}: expected ROW=SECONDS with ROW one of: {', '.join(sorted(names))}")
        budgets[name] = float(seconds)
    words = [w.strip() for w in (a.rows or "").split(",") if w.strip()]
    chosen = {r.name for r in rows if not words or any(w == r.name if w in names else w in r.name for w in words)}
    selected = {r.name for r in rows if (not a.part or set(a.part) & set(r.parts)) and r.name in chosen}
    selected |= {name for r in rows if r.name in selected for name in r.after}
    if not selected:
        p.error(f"no row matches --part {a.part} --rows {a.rows!r}; rows: {', '.join(r.name for r in rows)}")
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **os.environ, "TQDM_DISABLE": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "bench"),
                                                                                os.environ.get("PYTHONPATH"))))}
    chosen_rows = [r for r in rows if r.name in selected]
    optional = ["trl"] * ("trl" in a.tools and any(r.kind == "compare" for r in chosen_rows)) + ["deepspeed"] * any(
        "deepspeed" in r.needs for r in chosen_rows)
    found = preflight(env, optional)
    for problem in found["missing_core"]:
        print(f"[gpu-suite] preflight: posttrain cannot run: {problem}", flush=True)
    for name, why in found["missing"].items():
        print(f"[gpu-suite] preflight: {name} missing: {why}", flush=True)
    for dist, unmet in found["unmet"].items():
        print(f"[gpu-suite] preflight: {dist} needs {'; '.join(unmet)}", flush=True)
    info = environment(found, a.commit)
    print(f"[gpu-suite] {info['device'].get('name')} | {info['code']} | " + ", ".join(
        f"{k} {v}" for k, v in info["versions"].items() if v), flush=True)
    if a.dry_run:
        results = {}
        for r in (r for r in rows if r.name in selected):
            why = skip_reason(r, found)
            results[r.name] = {"status": "skipped" if why else "planned", "reason": why or "--dry-run"}
    else:
        results = run_suite(rows, selected, found, env, work / "logs", a.minutes, budgets)
    path = write_results(Path(a.out), a.size, info, found, rows, results, sys.argv[1:] if argv is None else argv)
    print(f"[gpu-suite] results: {path} and {path.with_suffix('.md')}", flush=True)
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    if failed:
        print(f"[gpu-suite] failed: {', '.join(failed)}", flush=True)
    return 1 if failed or found["missing_core"] else 0


if __name__ == "__main__":
    sys.exit(main())
