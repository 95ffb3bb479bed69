"""The GPU figures of docs/performance.md and docs/planning.md in one command of at most 8 minutes, into one results
file that says on what, with which versions, when and from which commit they were measured.

    bash bench/gpu_suite.sh                 # on a lent GPU machine: check, install the carried wheels (.whl/), run
    python bench/gpu_suite.py --dry-run     # anywhere: the check's findings and the plan, each row with its budget
    python bench/gpu_suite.py --size tiny --rows "plan sft" --tools posttrain    # the same rows at tiny shapes, CPU

Rows, in order, each in its own process group under its own time budget (a row past it is stopped and recorded as
failed; the next row runs):
1. prepare 0.5b: the Qwen2.5-0.5B-shaped model (random weights, its 151,936-token vocabulary) and the data.
2. posttrain vs TRL (bench/compare_trl.py: s/step, tokens/s, peak memory, MFU, start-up to the first step), bf16
   autocast: SFT 0.5B 8 x 1024, DPO 0.5B 8 pairs x 1024, GRPO 0.5B 32 completions x 128 with HF generate. Fewer
   steps than a full benchmark: the first ones (compile, allocator warm-up) are left out and the rest timed; each row
   says how many.
3. plan sft 0.5b: `posttrain plan`'s estimate against the measured peak of the SFT row's own posttrain run
   (bench/plan_accuracy.py --from-run: the run logged both; no second run).
Those fit 8 minutes with the setup (SETUP_S). Then, only while time is left (a row starts only when its budget fits,
a prepare row only with its first row's too): one SFT step of the tiny Qwen2-VL on the shapes images
(bench/vision_step.py), the 1.5B rows with gradient checkpointing, and the planner's other rows (DPO / GRPO in one
process, SFT / DPO / GRPO under ZeRO-2 / ZeRO-3), which a longer --minutes reaches.

Results: OUT/results.json, results.md and logs.tar.gz (OUT: --out; bench/gpu_suite.sh passes the device's $OUT),
rewritten whole after every row, so a finished row is never lost to a later one or to a kill: device, versions,
date, commit, the preflight, then every row with its figures, or pending / running / skipped / failed / not run with
the reason. Exit status: 0 when no row failed, 1 when one did or posttrain itself cannot run here, 2 for bad options
or (--check) a missing piece.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # this checkout's posttrain (not an installed one), the helpers
from gpu_suite_preflight import environment, first_check, preflight, probe, skip_reason  # noqa: E402
from gpu_suite_report import document, keep_earlier, write_results  # noqa: E402

MINUTES = 8.0
SETUP_S = 45
"""bench/gpu_suite.sh's check, the carried wheels' install and the preflight's imports, before the first row."""


@dataclass(frozen=True)
class Row:
    """One measurement: a bench script in its own process group under a time budget."""

    name: str
    """The key in the results file; the same at every --size (the GPU shape it stands for)."""
    kind: str
    """prepare | compare | plan | vision."""
    shape: str
    """What actually runs at this --size, e.g. 'tiny 2x64'."""
    command: tuple[str, ...]
    """argv from the repository root: 'python' is this interpreter, '{figures}' the JSON file the row writes."""
    budget_s: float
    """Seconds before the row's process group is stopped and the row recorded as failed."""
    core: bool
    """In the 8-minute suite; otherwise it runs only when its budget fits in the time left."""
    steps: str = "-"
    """Optimiser steps run, and how many of them were left out of the timing."""
    needs: tuple[str, ...] = ()
    """cuda, bf16, deepspeed: what must be here for the row to run at all (else it is skipped with the reason)."""
    after: tuple[str, ...] = ()
    """Rows that must have passed in this run first (the model's prepare row)."""
    reads: tuple[str, ...] = ()
    """Rows whose run this one reads: they must have run (passed or failed) in this run."""


@dataclass(frozen=True)
class Scale:
    """The shapes a --size gives the rows."""

    model: dict
    """docs' model name -> bench/compare_trl.py --size."""
    compare: dict
    """algorithm -> (batch, length, steps, warmup, budget) replacing the GPU row's; {} keeps the GPU row's."""
    prepare_budget: dict
    """docs' model name -> seconds."""
    from_run_budget: float
    """Seconds of the row that reads the SFT row's run (Python, torch and posttrain's start-up, mostly)."""
    plan_overrides: dict
    """algorithm -> the recipe overrides of the planner's separate rows."""
    plan_budget: float
    """Seconds of a plain separate plan row (ZeRO and GRPO rows get more, PLAN_ENGINES)."""
    needs: tuple[str, ...]
    """What every row needs at this size (Row.needs)."""


# docs/performance.md's GPU rows: (algorithm, model, batch, length, gradient checkpointing, steps, warmup, budget s).
# GRPO: batch = completions (8 per prompt), length = completion tokens. A budget holds the parent's start-up and
# matmul probe, each tool's start-up (imports, loading, tokenising 2,000 rows) and its steps; the last H100 table
# had 0.17 s (SFT), 0.72 s (DPO) and 4.4 s (GRPO) a step for posttrain. 0.5B rows are the core; 1.5B rows come after.
COMPARE = (
    ("sft", "0.5b", 8, 1024, False, 12, 3, 100),
    ("dpo", "0.5b", 8, 1024, False, 8, 2, 110),
    ("grpo", "0.5b", 32, 128, False, 4, 1, 130),
    ("sft", "1.5b", 8, 2048, True, 8, 2, 120),
    ("dpo", "1.5b", 8, 1024, True, 6, 2, 130),
)
CORE_MODEL = "0.5b"
PLAN_ENGINES = {  # engine -> (launcher before the script, budget factor): ZeRO adds DeepSpeed's start and hooks
    "ddp1": ((), 1.0),
    "zero2": (("-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/zero2.yaml",
               "--num_processes", "1"), 1.2),
    "zero3": (("-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/zero3.yaml",
               "--num_processes", "1"), 1.4),
}
GPU_PLAN = ("model.dtype=bfloat16", "train.mixed_precision=bf16", "train.per_device_train_batch_size=8")
TINY_PLAN = ("train.mixed_precision=bf16", "train.per_device_train_batch_size=4", "data.max_length=64")
SCALES = {
    "gpu": Scale(model={"0.5b": "0.5b", "1.5b": "1.5b"}, compare={}, prepare_budget={"0.5b": 60, "1.5b": 90},
                 from_run_budget=15,
                 plan_overrides={"sft": GPU_PLAN + ("data.max_length=1024",),
                                 "dpo": GPU_PLAN + ("data.max_length=1024",),
                                 "grpo": GPU_PLAN + ("generation.max_completion_length=128",)},
                 plan_budget=38, needs=("cuda", "bf16")),
    "tiny": Scale(model={"0.5b": "tiny", "1.5b": "tiny"},
                  compare={"sft": (2, 64, 4, 1, 300), "dpo": (2, 64, 4, 1, 300), "grpo": (4, 8, 3, 1, 300)},
                  prepare_budget={"0.5b": 120, "1.5b": 120}, from_run_budget=60,
                  plan_overrides={"sft": TINY_PLAN, "dpo": TINY_PLAN, "grpo": TINY_PLAN + (
                      "generation.max_completion_length=8", "algo.num_generations=4")},
                  plan_budget=150, needs=()),
}


def plan_rows(size: str, work: Path, tools: str, model_dir: str | None = None) -> list[Row]:
    """Every row of the suite at this size, in the order they run: the core rows, then the ones for time left.
    model_dir: a real model directory that every compare and plan row trains instead of the generated shapes
    (bench/compare_trl.py --model), with a distillation row (the model teaching itself) among those for time left."""
    scale, py = SCALES[size], "python"
    real = ("--model", model_dir) if model_dir else ()
    longest: dict[str, int] = {}  # the model's positions and the data's rows cover its longest SFT / DPO row
    for algo, model, bs, length, *_ in COMPARE:
        if algo != "grpo":
            longest[model] = max(longest.get(model, 0), (scale.compare.get(algo) or (0, length))[1])

    def prepare(model: str) -> Row:
        size_arg = scale.model[model]
        return Row(f"prepare {model}", "prepare", size_arg,
                   (py, "bench/compare_trl.py", "--prepare-only", "--size", size_arg, "--seq", str(longest[model]),
                    "--work", str(work / size_arg), *real), scale.prepare_budget[model], model == CORE_MODEL,
                   needs=scale.needs)

    compare = []
    distill = (("distill", "1.5b", 8, 1024, False, 8, 2, 130),) if model_dir else ()  # "1.5b": not a core row
    for algo, model, bs, length, gc, steps, warmup, budget in COMPARE + distill:
        name = f"{algo} {model} bs{bs}x{length}" + (" gc" if gc else "")
        shapes = scale.compare.get("sft" if algo == "distill" else algo)
        bs, length, steps, warmup, budget = shapes or (bs, length, steps, warmup, budget)
        shape_args = (("--bs", str(bs), "--gens", str(max(2, bs // 4)), "--completion", str(length))
                      if algo == "grpo" else ("--bs", str(bs), "--seq", str(length)))
        command = (py, "bench/compare_trl.py", "--algo", algo, "--size", scale.model[model], *shape_args,
                   "--steps", str(steps), "--warmup", str(warmup), "--precision", "bf16", *(("--gc",) if gc else ()),
                   "--tools", tools, "--work", str(work / scale.model[model]), "--json", "{figures}", *real)
        compare.append(Row(name, "compare", f"{scale.model[model]} {bs}x{length}{' gc' if gc else ''}", command,
                           budget, model == CORE_MODEL, f"{steps} ({warmup} left out)", scale.needs,
                           (f"prepare {model}",)))
    compare.append(shared_prefix_row(scale, py, work, tools, real))
    sft = next(r for r in compare if r.core and r.name.startswith("sft "))
    from_run = Row(f"plan {sft.name}", "plan", sft.shape,
                   (py, "bench/plan_accuracy.py", "--from-run", str(work / scale.model[CORE_MODEL] / "posttrain-sft"),
                    "--json", "{figures}"), scale.from_run_budget, True, f"its run's {sft.steps}", scale.needs,
                   reads=(sft.name,))
    separate = []
    for algo in ("sft", "dpo", "grpo"):
        for engine, (launcher, factor) in PLAN_ENGINES.items():
            if algo == "sft" and engine == "ddp1":
                continue  # the row read from the SFT row's run
            budget = scale.plan_budget * factor * (1.5 if algo == "grpo" else 1)  # GRPO generates first
            steps = 2 if algo == "grpo" else 3
            command = (py, *launcher, "bench/plan_accuracy.py", "--json", "{figures}", "--algorithm", algo, "--model",
                       model_dir or str(work / scale.model[CORE_MODEL] / "model"), "--steps", str(steps),
                       *scale.plan_overrides[algo])
            needs = scale.needs + (("deepspeed",) if engine != "ddp1" else ())
            separate.append(Row(f"plan {algo} {CORE_MODEL} {engine}", "plan", scale.model[CORE_MODEL], command,
                                round(budget), False, str(steps), needs, (f"prepare {CORE_MODEL}",)))
    vision = Row("sft vision tiny-qwen2-vl 1 step", "vision", "tiny qwen2-vl 4 rows",
                 (py, "bench/vision_step.py", "--work", str(work / "vision"), "--json", "{figures}"),
                 VISION_STEP_S[size], False, "1", scale.needs)
    return [prepare(CORE_MODEL), *(r for r in compare if r.core), from_run, vision,
            prepare("1.5b"), *(r for r in compare if not r.core), *separate]


VISION_STEP_S = {"gpu": 45, "tiny": 240}
"""--size -> seconds of the vision row (bench/vision_step.py: make the tiny VLM and the shapes data, one SFT step),
first of the rows for time left: the core rows' budgets are ceilings, and what they leave runs it."""


SHARED_PREFIX = {"gpu": (16, 8, 384, 128, 4, 1, 150), "tiny": (8, 4, 48, 8, 3, 1, 300)}
"""--size -> (completions, G, prompt tokens, completion tokens, steps, warmup, budget s) of the shared-prefix row:
GRPO with a long shared system prompt, train.shared_prefix auto against false (posttrain-plain), and TRL."""


def shared_prefix_row(scale: Scale, py: str, work: Path, tools: str, real: tuple) -> Row:
    """GRPO on the core model with realistic prompts, each computed once for its G completions (posttrain) and once
    per completion (posttrain-plain, TRL): a row for the time left."""
    size = "gpu" if scale is SCALES["gpu"] else "tiny"
    bs, gens, prompt, completion, steps, warmup, budget = SHARED_PREFIX[size]
    model = scale.model[CORE_MODEL]
    shared_tools = ",".join(dict.fromkeys(["posttrain", "posttrain-plain", *tools.split(",")]))
    command = (py, "bench/compare_trl.py", "--algo", "grpo", "--size", model, "--bs", str(bs), "--gens", str(gens),
               "--prompt", str(prompt), "--completion", str(completion), "--steps", str(steps), "--warmup",
               str(warmup), "--precision", "bf16", "--tools", shared_tools, "--work", str(work / model), "--json",
               "{figures}", *real)
    named = SHARED_PREFIX["gpu"]  # a row's name is the GPU shape it stands for, at every --size
    return Row(f"grpo shared-prefix {CORE_MODEL} bs{named[0]} prompt{named[2]}", "compare", f"{model} {bs}x{prompt}+"
               f"{completion}", command, budget, False, f"{steps} ({warmup} left out)", scale.needs,
               (f"prepare {CORE_MODEL}",))


def plan_text(rows: list[Row], selected: set[str], minutes: float) -> str:
    """The plan as the dry run prints it: each selected row with its budget; the core's sum against the minutes."""
    core = [r for r in rows if r.core and r.name in selected]
    lines = [f"plan: at most {minutes:g} minutes ({60 * minutes:.0f} s) from the start of bench/gpu_suite.sh",
             f"{SETUP_S:>6} s  setup: check the device and the carried wheels, install them, import what rows need"]
    lines += [_plan_line(r) for r in core]
    lines.append(f"{SETUP_S + sum(r.budget_s for r in core):>6.0f} s  in all, the setup and {len(core)} core rows")
    extra = [r for r in rows if not r.core and r.name in selected]
    if extra:
        lines.append("then, only while time is left (each starts only when its budget fits):")
        lines += [_plan_line(r) for r in extra]
    return "\n".join(lines)


def _plan_line(row: Row) -> str:
    return f"{row.budget_s:>6.0f} s  {row.name}  ({row.shape}" + (f"; steps {row.steps})" if row.steps != "-" else ")")


# ----------------------------------------------------------------------------------------------------- running
def run_row(row: Row, budget: float, env: dict, logs: Path) -> dict:
    """The row's command in its own process group; stopped (SIGTERM, then SIGKILL) at the budget. The figures are
    the JSON the bench script wrote, kept also when the row failed or was stopped after writing some."""
    from posttrain.generation.serve import stop_group

    logs.mkdir(parents=True, exist_ok=True)
    slug = row.name.replace(" ", "-")
    figures_file, log_file = logs / f"{slug}.json", logs / f"{slug}.log"
    figures_file.unlink(missing_ok=True)
    command = [sys.executable if arg == "python" else str(figures_file) if arg == "{figures}" else arg
               for arg in row.command]
    started, status, reason, code = time.monotonic(), "passed", None, None
    process = None
    with log_file.open("w") as log:
        try:
            _STOP["starting"] = True  # a SIGTERM now waits until `process` is known (else its group would outlive us)
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            _STOP["starting"] = False
            if _STOP["asked"]:
                sys.exit(143)
            code = process.wait(timeout=budget)
            if code:
                status, reason = "failed", f"exited {code}"
        except subprocess.TimeoutExpired:
            status, reason = "failed", f"over its {budget:.0f} s budget: stopped"
        finally:  # SIGTERM to the whole group (what a launcher started too), SIGKILL after a grace period
            _STOP["starting"] = False
            if process is not None:
                stop_group(process)
    try:
        figures = json.loads(figures_file.read_text()) if figures_file.exists() else None
    except ValueError as e:  # cut short by the stop: the row keeps its status, the figures say why they are gone
        figures = {"unreadable": f"{figures_file}: {e}"}
    tail = None
    if status == "failed":  # the first exception raised (a launcher's own traceback comes after it), then the end
        lines = log_file.read_text(errors="replace").splitlines()
        raised = [x for x in lines if re.match(r"[\w.]+(Error|Exception|Interrupt|Exit)\b", x)]
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


def why_not(row: Row, rows: list[Row], selected: set[str], results: dict, found: dict, budget: float,
            left: float) -> str | None:
    """Why the row does not start now (a missing need, an earlier row, the time), or None."""
    reason = skip_reason(row.needs, found)
    failed_first = [n for n in row.after if results.get(n, {}).get("status") != "passed"]
    not_run = [n for n in row.reads if results.get(n, {}).get("status") not in ("passed", "failed")]
    if reason is None and (failed_first or not_run):
        reason = (f"{', '.join(failed_first)} did not pass in this run" if failed_first
                  else f"{', '.join(not_run)} did not run in this run")
    needed = min(budget, 30)
    if not row.core:  # a row for time left starts whole, a prepare row only with the first row it is for
        firsts = [r.budget_s for r in rows if row.name in r.after and r.name in selected]
        needed = budget + (firsts[0] if row.kind == "prepare" and firsts else 0)
    if reason is None and left < needed:
        reason = f"the time is spent ({left:.0f} s left; the row needs {needed:.0f} s)"
    return reason


_STOP = {"starting": False, "asked": False}
"""run_row starting a process (a SIGTERM then only asks, and run_row exits once the process is known), asked."""


def _on_sigterm(*_) -> None:
    _STOP["asked"] = True
    if not _STOP["starting"]:
        sys.exit(143)


def run_suite(rows: list[Row], selected: set[str], found: dict, env: dict, logs: Path, deadline: float,
              budgets: dict, save) -> dict[str, dict]:
    """Each selected row in order, save(results) before it ('running') and after it; returns name -> result.
    A SIGTERM to the suite (the device call's time limit) stops the running row's group, records that row as
    stopped and saves before the suite exits 143."""
    results: dict[str, dict] = {}
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _STOP.update(starting=False, asked=False)
    try:
        for row in rows:
            if row.name in selected:
                _run_one(row, rows, selected, found, env, logs, deadline, budgets, results, save)
                save(results)
        return results
    except BaseException as e:  # SIGTERM (SystemExit) or Ctrl-C, wherever it came: the row's group is stopped by now
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the last save short
        for name, result in results.items():
            if result["status"] == "running":
                results[name] = {"status": "failed", "reason": f"the suite was stopped during this row ({e!r})"}
        save(results)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_one(row: Row, rows: list[Row], selected: set[str], found: dict, env: dict, logs: Path, deadline: float,
             budgets: dict, results: dict, save) -> None:
    """The row run, or skipped with the reason, into `results` (saved as 'running' while it runs)."""
    budget, left = budgets.get(row.name, row.budget_s), deadline - time.monotonic()
    reason = why_not(row, rows, selected, results, found, budget, left)
    if reason is not None:
        results[row.name] = {"status": "skipped", "reason": reason}
        print(f"[gpu-suite] {row.name}: skipped: {reason}", flush=True)
        return
    budget = min(budget, left)
    print(f"[gpu-suite] {row.name} ({row.shape}, budget {budget:.0f} s) ...", flush=True)
    results[row.name] = {"status": "running", "reason": f"started with {budget:.0f} s of budget"}
    save(results)
    results[row.name] = run_row(row, budget, env, logs)
    r = results[row.name]
    print(f"[gpu-suite] {row.name}: {r['status']} in {r['seconds']} s" + (f": {r['reason']}" if r["reason"] else ""),
          flush=True)


# ----------------------------------------------------------------------------------------------------- command
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SCALES), default="gpu", help="gpu: the real shapes; tiny: CPU-sized")
    p.add_argument("--rows", help="comma-separated: row names, or words a name holds (their prepare rows run too)")
    p.add_argument("--tools", default="posttrain,trl", choices=("posttrain,trl", "posttrain", "trl"))
    p.add_argument("--model", help="a real model directory (or smollm2: bench/real_model.py) for every row")
    p.add_argument("--minutes", type=float, default=MINUTES,
                   help="start no row after this many minutes from the start of bench/gpu_suite.sh (GPU_SUITE_T0)")
    p.add_argument("--budget", action="append", default=[], metavar="ROW=SECONDS", help="another budget for a row")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu-suite" / "results"), help="results.json, .md go here")
    p.add_argument("--work", default=str(ROOT / "runs" / "gpu-suite"), help="generated models, data and logs")
    p.add_argument("--commit", help="the commit measured, where this copy has no git (default: the code version)")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="--check: where the carried wheels are")
    p.add_argument("--dry-run", action="store_true", help="preflight and plan only; nothing runs")
    p.add_argument("--check", action="store_true", help="only the device and the carried pieces (seconds); exit 2 "
                                                        "naming what is missing")
    p.add_argument("--probe", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.probe is not None:
        print("PROBE " + json.dumps(probe(a.probe)), flush=True)
        return 0
    if a.check:
        ok, lines = first_check(a.size == "gpu" and not a.dry_run, Path(a.wheels))
        for line in lines:
            print(f"[gpu-suite] check: {line}", flush=True)
        return 0 if ok or a.dry_run else 2
    started = float(os.environ.get("GPU_SUITE_T0") or time.time())
    deadline = time.monotonic() + 60 * a.minutes - (time.time() - started)
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
    selected = {r.name for r in rows if not words or any(w == r.name if w in names else w in r.name for w in words)}
    for _ in range(2):  # the rows a selected row reads, and the prepare rows of both
        selected |= {name for r in rows if r.name in selected for name in r.after + r.reads}
    if not selected:
        p.error(f"no row matches --rows {a.rows!r}; rows: {', '.join(r.name for r in rows)}")
    print("[gpu-suite] " + plan_text(rows, selected, a.minutes).replace("\n", "\n[gpu-suite] "), flush=True)
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **os.environ, "TQDM_DISABLE": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "bench"),
                                                                                os.environ.get("PYTHONPATH"))))}
    chosen = [r for r in rows if r.name in selected]
    optional = ["trl"] * ("trl" in a.tools and any(r.kind == "compare" for r in chosen)) + ["deepspeed"] * any(
        "deepspeed" in r.needs for r in chosen)
    found = preflight(env, optional, Path(__file__).resolve())
    for problem in found["missing_core"]:
        print(f"[gpu-suite] preflight: posttrain cannot run: {problem}", flush=True)
    for name, why in found["missing"].items():
        print(f"[gpu-suite] preflight: {name} missing: {why}", flush=True)
    for dist, unmet in found["unmet"].items():
        print(f"[gpu-suite] preflight: {dist} needs {'; '.join(unmet)}", flush=True)
    info = environment(found, a.commit)
    print(f"[gpu-suite] {info['device'].get('name')} | {info['code']} | " + ", ".join(
        f"{k} {v}" for k, v in info["versions"].items() if v), flush=True)
    out, argv_text = Path(a.out), sys.argv[1:] if argv is None else argv
    keep_earlier(out)

    def save(results: dict) -> Path:
        doc = document(a.size, a.minutes, info, found, rows, selected, results, argv_text)
        return write_results(out, doc, None if a.dry_run else work / "logs")

    if a.dry_run:
        results = {}
        for r in chosen:
            why = skip_reason(r.needs, found)
            results[r.name] = {"status": "skipped" if why else "planned", "reason": why or "--dry-run"}
    else:
        save({})
        results = run_suite(rows, selected, found, env, work / "logs", deadline, budgets, save)
    path = save(results)
    print(f"[gpu-suite] results: {path} and {path.with_suffix('.md')}", flush=True)
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    if failed:
        print(f"[gpu-suite] failed: {', '.join(failed)}", flush=True)
    return 1 if failed or found["missing_core"] else 0


if __name__ == "__main__":
    sys.exit(main())
