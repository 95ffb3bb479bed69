"""posttrain and TRL side by side: the same generated model, data and settings; one table of the figures that matter.

    .venv/bin/python bench/compare_trl.py --algo sft --size 20m --bs 4 --seq 256 --steps 12
    .venv/bin/python bench/compare_trl.py --algo dpo --size 20m --bs 2 --seq 256
    .venv/bin/python bench/compare_trl.py --algo grpo --size tiny --bs 8 --gens 4 --completion 32
    .venv/bin/python bench/compare_trl.py --algo grpo --model smollm2 --prompt 384 --bs 8 --gens 8 --completion 128
    python bench/compare_trl.py --algo sft --size 0.5b --bs 8 --seq 1024 --precision bf16 [--gc] [--packing]  # GPU
    .venv/bin/python bench/compare_trl.py --startup --repeats 3   # cold `posttrain sft` vs `trl sft` (compare_startup.py)
    .venv/bin/python bench/compare_trl.py --algo dpo --model smollm2 --bs 8 --seq 256 --steps 10 --repeats 2
    .venv/bin/python bench/compare_trl.py --algo distill --model DIR --teacher DIR2   # GKD (lmbda 0) vs TRL's GKD

`--model DIR` trains a real model directory instead of a generated one (every algorithm; both tools load it in
float32, or float32 weights under bf16 autocast with --precision bf16); `--model smollm2` is SmolLM2-135M-Instruct,
built offline once by bench/real_model.py. `--algo distill` distils `--teacher` (default: the model itself) into the
model on the data's demonstrations (lmbda 0, beta 0.5, temperature 1) against TRL's GKDTrainer with the same numbers.
    python bench/compare_trl.py --size 1.5b --seq 2048 --work runs/w --prepare-only   # only make the model and data

`--json FILE` also writes the figures as JSON, rewritten after every tool's run (bench/gpu_suite.py reads it, and
keeps the figures of the tools that finished when a later one is stopped). A tool that fails does not stop the other:
its error is reported and the exit status is 1.

Each tool runs in a fresh process (clean peak memory, its own start-up cost), one after the other and `--repeats`
times in alternating order, so neither side always runs on a warmer machine; the best repeat of each side is shown.
TRL (`pip install trl`) is optional: without it only posttrain's rows print. `posttrain-plain` is posttrain with
`train.shared_prefix=false` (every row computes its prompt), beside `posttrain` (auto: a prompt's G completions, a
pair's prompt computed once): `--tools posttrain,posttrain-plain,trl` prints the three. `--prompt N`: GRPO prompts of
a fixed system prompt and a question, about N tokens in all (default 12), for the realistic shapes of shared
prefixes (256-512-token prompts, G = 8, 64-256-token completions).

Figures (steady state: the first `--warmup` steps are dropped):
- s/step: mean seconds between consecutive optimiser steps.
- CPU s/step: the process's CPU seconds per steady step (all its threads): on a shared machine it moves far less with
  the load than s/step does.
- tokens/s: trained tokens per second. SFT rows are all longer than --seq, so each holds exactly --seq tokens and
  both tools train bs x seq tokens a step; DPO counts bs x 2 sequences x their prompt+response tokens; GRPO counts
  prompt+completion tokens of the step's completions as each tool reports them.
- peak memory: CUDA max_memory_allocated on a GPU; on a CPU the process's peak resident set size (both tools pay
  the same interpreter and library baseline, which is part of the figure).
- MFU: achieved FLOP/s (6 x parameters + 12 x layers x hidden x seq per trained token, forward + backward) over
  989 TFLOP/s on CUDA (H100 SXM dense bf16), or over this machine's measured matmul FLOP/s in the run's dtype on CPU.
- start-up: from launching the process to the end of the first optimiser step (imports, loading, tokenising, the
  first step).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from compare_report import print_summary  # beside this file
from trl_shapes import SIZES, TrainedTokens, apply_shape, data_file, model_dir, prepare

H100_BF16_PEAK = 989e12


def length_reward(prompts, completions, **_):
    """GRPO's reward in this benchmark: longer completions score higher (cheap, the same for both tools)."""
    return [min(len(c if isinstance(c, str) else str(c)), 200) / 200 for c in completions]


# ----------------------------------------------------------------------------------------------------- inputs
def parameters_and_dims(model_dir: Path) -> tuple[int, int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    h, layers, inter, vocab = (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
                               config["vocab_size"])
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    return layers * per_layer + vocab * h, layers, h


def matmul_probe(device: str, precision: str) -> float:
    """This device's sustained matmul FLOP/s in the run's dtype (CPU: the denominator of MFU)."""
    import torch

    dtype = torch.bfloat16 if precision != "fp32" else torch.float32
    n = 4096 if device == "cuda" else 1024
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a @ b
        count += 1
    sync()
    return count * 2 * n**3 / (time.perf_counter() - start)


# ----------------------------------------------------------------------------------------------------- children
def peak_memory_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_posttrain(a, work: Path, started: float) -> dict:
    """Through posttrain's own entry point; step ends are read from metrics.jsonl as it is written."""
    from posttrain.cli import main as posttrain_main

    out = work / f"{a.tool}-{a.algo}"  # posttrain-sft, posttrain-plain-grpo, ...
    shutil.rmtree(out, ignore_errors=True)  # the watcher below must see only this run's metrics
    overrides = [
        f"model.name_or_path={model_dir(a, work)}", "model.dtype=float32", f"output_dir={out}",
        f"train.max_steps={a.steps}", "train.logging_steps=1", f"train.per_device_train_batch_size={a.bs}",
        "train.learning_rate=1e-6", "train.lr_scheduler_type=constant", "train.save_final_model=false",
        "train.report=false", "train.tensorboard=false", "train.save_steps=0",
        f"train.gradient_checkpointing={str(a.gc).lower()}", f"train.mixed_precision={a.precision_value}",
        f"data.train={data_file(a, work)}", "seed=0",
        f"train.shared_prefix={'false' if a.tool == 'posttrain-plain' else 'auto'}",
    ]
    if a.algo == "sft":
        overrides += [f"data.max_length={a.seq}", f"data.packing={str(a.packing).lower()}"]
    elif a.algo == "dpo":
        overrides += [f"data.max_length={a.seq}", "algo.precompute_ref_logprobs=false"]
    elif a.algo == "distill":
        overrides += [f"data.max_length={a.seq}", f"algo.teacher_model_name_or_path={a.teacher or model_dir(a, work)}",
                      "algo.lmbda=0.0", "algo.beta=0.5", "algo.temperature=1.0"]
    else:
        # room for every prompt: a realistic one is sized in tokens (+ its template's), a plain one in words
        prompt_tokens = max(128, a.prompt * 5 // 4 if a.shape == "realistic" else 2 * a.prompt)
        overrides += [f"data.max_length={prompt_tokens + a.completion}", f"data.max_prompt_length={prompt_tokens}",
                      f"algo.num_generations={a.gens}",
                      f"generation.max_completion_length={a.completion}", "algo.beta=0.0",
                      "rewards=[{name: 'compare_trl:length_reward'}]"]
    ends, cpu = [], []
    metrics = out / "metrics.jsonl"
    done = threading.Event()

    def watch() -> None:  # the wall-clock moment each step's metrics line appears
        seen = 0
        while not done.is_set():
            if metrics.exists():
                lines = [x for x in metrics.read_text().splitlines() if '"tokens_per_second"' in x]
                ends.extend([time.perf_counter()] * (len(lines) - seen))
                cpu.extend([time.process_time()] * (len(lines) - seen))
                seen = len(lines)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = posttrain_main(["grpo" if a.algo == "agents" else a.algo, *overrides])
    done.set()
    watcher.join()
    if code:
        raise SystemExit(f"posttrain {a.algo} exited {code}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if '"tokens_per_second"' in x]
    tokens = [rows[0]["num_tokens"]] + [rows[i]["num_tokens"] - rows[i - 1]["num_tokens"] for i in range(1, len(rows))]
    forwarded = [r["tokens/forwarded"] for r in rows if "tokens/forwarded" in r]
    return {"ends": ends, "cpu": cpu, "tokens": tokens, "started": started, "peak": peak_memory_bytes(),
            "loss": [r["loss"] for r in rows], "forwarded": sum(forwarded) / len(forwarded) if forwarded else None}


def run_trl(a, work: Path, started: float) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    tokenizer = AutoTokenizer.from_pretrained(model_dir(a, work))
    model = AutoModelForCausalLM.from_pretrained(model_dir(a, work), dtype=torch.float32, attn_implementation="sdpa")
    ends, cpu = [], []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

    common = dict(output_dir=str(work / f"trl-{a.algo}"), per_device_train_batch_size=a.bs, max_steps=a.steps,
                  learning_rate=1e-6, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                  report_to="none", bf16=a.precision == "bf16", gradient_checkpointing=a.gc, dataloader_num_workers=0,
                  disable_tqdm=True, seed=0, use_cpu=not torch.cuda.is_available())
    data = load_dataset("json", data_files=str(data_file(a, work)), split="train")
    if a.algo == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=SFTConfig(max_length=a.seq, packing=a.packing, **common),
                             train_dataset=data, processing_class=tokenizer)
    elif a.algo == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, args=DPOConfig(max_length=a.seq, **common), train_dataset=data,
                             processing_class=tokenizer)
    elif a.algo == "distill":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        teacher = AutoModelForCausalLM.from_pretrained(a.teacher or model_dir(a, work), dtype=torch.float32,
                                                       attn_implementation="sdpa")
        config = GKDConfig(max_length=a.seq, lmbda=0.0, beta=0.5, temperature=1.0, **common)
        trainer = GKDTrainer(model=model, teacher_model=teacher, args=config, train_dataset=data,
                             processing_class=tokenizer)
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(num_generations=a.gens, max_completion_length=a.completion, beta=0.0, temperature=1.0,
                            **common)
        trainer = GRPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                              reward_funcs=[length_reward])
    trainer.add_callback(StepEnds())
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    seen = [h.get("num_tokens") for h in logged]
    tokens = None
    if all(s is not None for s in seen) and len(seen) == len(ends):
        tokens = [seen[0]] + [seen[i] - seen[i - 1] for i in range(1, len(seen))]
    return {"ends": ends, "cpu": cpu, "tokens": tokens, "started": started, "peak": peak_memory_bytes(),
            "loss": [h["loss"] for h in logged]}


def child(a) -> None:
    import torch

    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = float(os.environ["COMPARE_STARTED"])
    with TrainedTokens() as trained:
        raw = (run_trl if a.tool == "trl" else run_posttrain)(a, Path(a.work), started)
    print("RESULT " + json.dumps({**raw, "trained_tokens": trained.count / a.steps}), flush=True)


# ----------------------------------------------------------------------------------------------------- figures
def figures(raw: dict, a, work: Path, probe: float, on_cuda: bool) -> dict:
    ends, k = raw["ends"], min(a.warmup, len(raw["ends"]) - 2)
    gaps = [ends[i] - ends[i - 1] for i in range(k + 1, len(ends))]
    sec = sum(gaps) / len(gaps)
    if a.algo == "sft" and not a.packing:
        step_tokens = a.bs * a.seq  # every row is longer than seq: truncated to exactly seq tokens
    elif raw["tokens"]:
        step_tokens = sum(raw["tokens"][k + 1:]) / len(gaps)
    else:
        step_tokens = None
    cpu = (raw["cpu"][-1] - raw["cpu"][k]) / len(gaps)
    out = {"s/step": sec, "CPU s/step": cpu, "tokens/s": step_tokens / sec if step_tokens and sec > 0 else None,
           "peak GB": raw["peak"] / 2**30, "start-up s": ends[0] - raw["started"], "first loss": raw["loss"][0],
           "forwarded/step": raw.get("forwarded"), "trained forward tokens/step": raw.get("trained_tokens")}
    if out["tokens/s"] and a.algo not in ("grpo", "agents"):  # none when steps ended within one poll of metrics.jsonl
        params, layers, hidden = parameters_and_dims(model_dir(a, work))
        seq = a.seq if a.algo == "sft" else step_tokens / (2 * a.bs)
        achieved = out["tokens/s"] * (6 * params + 12 * layers * hidden * seq)
        out["MFU"] = achieved / (H100_BF16_PEAK if on_cuda else probe)
    return out


def check_args(p: argparse.ArgumentParser, a) -> None:
    """Exit 2 naming the flag, before anything is generated or run: a --model that is no model directory failed
    with a traceback after the data was made, and --steps 1 left no step gap to time."""
    if a.teacher is not None and a.algo != "distill":
        p.error(f"--teacher is the teacher of --algo distill; --algo {a.algo} has none")
    for flag, value, named in (("model", a.model, ("smollm2",)), ("teacher", a.teacher, ())):
        if value is not None and value not in named and not (Path(value).expanduser() / "config.json").is_file():
            p.error(f"--{flag} {value!r} is not a model directory (no config.json in it): give a Hugging Face model "
                    f"directory{', or smollm2' if named else ''}")
    for flag in ("bs", "seq", "gens", "completion", "repeats", "prompt"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    if a.steps < 2 or a.warmup < 0:
        p.error(f"--steps must be >= 2 (a step time is the gap between two steps) and --warmup >= 0; got --steps "
                f"{a.steps} --warmup {a.warmup}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", choices=["sft", "dpo", "grpo", "agents", "distill"], default="sft",
                   help="agents: GRPO with tools' schemas in the prompt (bench/trl_shapes.py)")
    p.add_argument("--shape", choices=["small", "realistic"], default="small",
                   help="realistic: the algorithm's shape of bench/trl_shapes.REALISTIC (replaces its flags)")
    p.add_argument("--model", help="a real model directory (or smollm2) instead of a generated --size")
    p.add_argument("--teacher", help="--algo distill: the teacher's directory (default: the model itself)")
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady state")
    p.add_argument("--bs", type=int, default=4, help="per-device batch: sequences (SFT), pairs (DPO), completions (GRPO)")
    p.add_argument("--seq", type=int, default=256, help="max_length (SFT, DPO)")
    p.add_argument("--gens", type=int, default=4, help="GRPO completions per prompt")
    p.add_argument("--completion", type=int, default=32, help="GRPO max completion tokens")
    p.add_argument("--prompt", type=int, default=12, help="GRPO prompt tokens (about): a shared system prompt + a "
                   "question when > 12")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="fp32, or bf16 autocast")
    p.add_argument("--gc", action="store_true", help="gradient checkpointing")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tools", default="posttrain,trl")
    p.add_argument("--work", help="keep model and data here (default: a temporary directory)")
    p.add_argument("--prepare-only", action="store_true", help="make the model and data in --work, then stop")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--tool", help=argparse.SUPPRESS)
    p.add_argument("--startup", action="store_true", help="only the cold start of each tool's own command line")
    p.add_argument("--posttrain-path", help="--startup: another posttrain checkout to time as well (before/after)")
    a = p.parse_args()
    apply_shape(a)
    check_args(p, a)
    if a.startup:
        from compare_startup import startup_side_by_side  # beside this file

        return startup_side_by_side(a)
    a.precision_value = "bf16" if a.precision == "bf16" else "'no'"
    if a.tool:
        return child(a)

    import torch

    if a.prepare_only:
        if not a.work:
            sys.exit("--prepare-only needs --work DIR (where the model and data are kept)")
        return prepare(a, Path(a.work))
    on_cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    asked = a.tools.split(",")
    trl_missing = _trl_missing() if "trl" in asked else None
    tools = [t for t in asked if t != "trl" or trl_missing is None]
    best: dict[str, dict] = {}
    errors: dict[str, str] = {"trl": trl_missing} if trl_missing else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare(a, work)
        probe = matmul_probe("cuda" if on_cuda else "cpu", a.precision)
        params = parameters_and_dims(model_dir(a, work))[0]
        for r in range(a.repeats):
            for tool in tools if r % 2 == 0 else tools[::-1]:
                if tool in errors:
                    continue
                args = _without_work(sys.argv[1:]) + ["--tool", tool, "--work", str(work)]
                env = {**os.environ, "TQDM_DISABLE": "1",
                       "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
                env["COMPARE_STARTED"] = repr(time.perf_counter())  # CLOCK_MONOTONIC: the same clock in the child
                done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
                line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                if done.returncode or not line:
                    errors[tool] = f"exited {done.returncode}: {done.stderr.strip()[-1500:] or done.stdout[-1500:]}"
                    print(f"{tool} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}", file=sys.stderr)
                else:
                    row = figures(json.loads(line[0][7:]), a, work, probe, on_cuda)
                    if tool not in best or row["s/step"] < best[tool]["s/step"]:
                        best[tool] = row
                if a.json:
                    Path(a.json).write_text(json.dumps({"device": device, "params": params, "tools": best,
                                                        "errors": errors}, indent=1))
    print_summary(a, best, f"{params / 1e6:.1f}M params", f"{device} | torch {torch.__version__}")
    for tool, error in errors.items():
        print(f"{tool}: not measured: {error.splitlines()[-1] if error.strip() else error}")
    if any(tool in errors for tool in tools):
        sys.exit(1)


def _without_work(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip or arg == "--work" or arg.startswith("--work="):
            skip = arg == "--work"
            continue
        out.append(arg)
    return out


def _trl_missing() -> str | None:
    """Why TRL's side cannot run here, or None when it can."""
    try:
        import trl  # noqa: F401
    except ImportError as e:
        print("trl is not installed (pip install trl): posttrain's rows only")
        return f"trl is not importable ({e}): pip install trl, or carry its wheel (scripts/gpu_wheels.sh)"
    except Exception as e:  # noqa: BLE001 - an installed TRL that breaks on import (a transformers it does not fit)
        return f"trl fails to import: {type(e).__name__}: {e}"
    return None


if __name__ == "__main__":
    main()
