"""`posttrain plan`'s estimate against the measured peak of a real run: a few steps of a recipe, both numbers printed.

    .venv/bin/python bench/plan_accuracy.py --algorithm sft                        # tiny model, CPU
    .venv/bin/python bench/plan_accuracy.py --algorithm dpo --model 20m            # the ~20M bench model
    .venv/bin/python bench/plan_accuracy.py --algorithm grpo --model Qwen/Qwen2.5-0.5B train.mixed_precision=bf16
    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 1 bench/plan_accuracy.py \\
        --algorithm sft --model Qwen/Qwen2.5-1.5B model.dtype=bfloat16 train.mixed_precision=bf16

Data are synthetic and long, so every row is cut at data.max_length (every completion runs to
generation.max_completion_length as far as sampling allows): the estimate assumes full-length rows, and so the run
must have them. train.shared_prefix is the recipe's (auto): GRPO forwards each prompt once per group, as the plan
counts it (`saved_fraction` in the output says how much it saved). Packing is off (a packed micro-batch's token count
depends on the data), except with `--mixed`: preference pairs of a chosen row cut at data.max_length and a short
rejected row, planned with the data's mean row length (`posttrain plan --mean-length`), padded, packed
(data.packing=true) or within a token budget.

"Measured peak":
- GPU: torch.cuda.max_memory_allocated over the whole run (what the caching allocator handed out; the CUDA context
  and the allocator's reserved-but-free blocks are not in it, nor in the estimate).
- CPU: the peak of live bytes allocated through torch's CPU allocator over the whole run, from the profiler's
  allocation events (each carries the running total). This is the CPU counterpart of max_memory_allocated. The
  loaded weights are copied once into allocator memory (`weights_in_allocator`): transformers memory-maps them. Peak RSS (the run's logged peak_memory_mb on CPU) is not comparable: it includes the
  interpreter, the libraries (~0.5 GB) and freed-but-kept pages, which dwarf a tiny model.
`--from-run DIR` runs nothing: it reads the estimate a finished run logged beside its measured peak (the last
metrics.jsonl row of DIR; bench/gpu_suite.py reads its SFT row's run so). On a GPU that peak is max_memory_allocated,
the figure above; on a CPU it is the peak RSS, which is not comparable.
Prints one markdown table row: model | algorithm | engine | device | batch x length | estimate | measured | error;
`--json FILE` also writes the figures as JSON (bench/gpu_suite.py reads it). The engine of the estimate is the one
the process was launched under (accelerate launch's DeepSpeed / FSDP settings), as the run itself reports it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = {"tiny": {}, "20m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)}
WORDS = "the model learns to add numbers and answer questions about short stories in plain words".split()


def long_text(rng: random.Random, words: int = 200) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_data(algorithm: str, path: Path, rows: int = 64, words: int = 200, mixed: bool = False) -> None:
    """Synthetic rows of `words` words (one or more tokens each), so every row is cut at data.max_length < words.
    `mixed` (preference data): every pair's chosen row is cut at data.max_length, its rejected row is short (a few
    tokens), so each micro-batch holds the same mix of lengths however the data is shuffled."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            if mixed:
                f.write(json.dumps({"prompt": [{"role": "user", "content": long_text(rng, 2)}],
                                    "chosen": [{"role": "assistant", "content": long_text(rng, words)}],
                                    "rejected": [{"role": "assistant", "content": long_text(rng, 3)}]}) + "\n")
                continue
            prompt = [{"role": "user", "content": long_text(rng, words)}]
            if algorithm in ("sft", "distill"):
                row = {"prompt": [{"role": "user", "content": long_text(rng, 20)}],
                       "completion": [{"role": "assistant", "content": long_text(rng, words)}]}
            elif algorithm in ("dpo", "rm"):
                row = {"prompt": [{"role": "user", "content": long_text(rng, 20)}],
                       "chosen": [{"role": "assistant", "content": long_text(rng, words)}],
                       "rejected": [{"role": "assistant", "content": long_text(rng, words)}]}
            else:
                row = {"prompt": prompt, "answer": "1"}
            f.write(json.dumps(row) + "\n")


def cpu_peak_bytes(profiler) -> int:
    """The largest count of live bytes the CPU allocator reported at any allocation or free while profiling
    (every allocation event carries the running total since the profiler started)."""
    from torch._C._profiler import _EventType

    peak, stack = 0, list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == torch.device("cpu").type:
            peak = max(peak, event.extra_fields.total_allocated)
    return peak


@contextlib.contextmanager
def weights_in_allocator():
    """Loaded weights copied once into memory the CPU allocator hands out (what a copy to the GPU does there).

    transformers maps safetensors files into memory and loads in worker threads, so on CPU neither the policy's
    nor the reference's weights would appear in the allocator's count. Bench-only: wraps the one loading function.
    """
    from posttrain.models import load

    original = load._from_pretrained

    def copied(*args, **kwargs):
        model = original(*args, **kwargs)
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
        return model

    load._from_pretrained = copied
    try:
        yield
    finally:
        load._from_pretrained = original


def launched_engine() -> tuple[str, str]:
    """(engine, offload) of this process in Backend.describe()'s words, from what accelerate launch exported."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        offload = [part for part in ("optimizer", "param")
                   if os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{part.upper()}_DEVICE", "none") != "none"]
        return f"deepspeed-zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}", ",".join(offload) or "none"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp2", "none"
    return ("ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"), "none"


def bench_recipe(algorithm: str, model: str, data: Path, output_dir: Path, steps: int, overrides: tuple[str, ...]):
    """recipes/<algorithm>.yaml with this bench's fixed settings, then the caller's overrides (loaded and checked)."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe

    fixed = [f"model.name_or_path={model}", f"data.train={data}", "data.eval=null", f"output_dir={output_dir}",
             f"train.max_steps={steps}", "train.report=false", "train.tensorboard=false",
             "train.save_final_model=false", "train.save_steps=0", f"train.logging_steps={steps}", "data.packing=false"]
    if algorithm == "dpo":
        fixed.append("algo.precompute_ref_logprobs=false")  # keep the frozen reference copy: it is estimated
    if algorithm == "grpo":
        fixed.append("data.max_prompt_length=64")
    if algorithm == "distill":  # the model teaches itself: a second full copy, on the data only (no generation)
        fixed += [f"algo.teacher_model_name_or_path={model}", "algo.lmbda=0.0"]
    return load_recipe(str(ROOT / "recipes" / f"{algorithm}.yaml"), fixed + list(overrides), ALGORITHMS[algorithm][0])


def mean_row_length(algorithm: str, recipe) -> float:
    """The mean tokens per row of the recipe's training data, as the run tokenizes and collates it (padded)."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.models.load import load_tokenizer
    from posttrain.run import load_examples, make_collate

    plain = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, packing=False),
                                train=dataclasses.replace(recipe.train, max_tokens_per_microbatch=None))
    algo = ALGORITHMS[algorithm][1](plain)
    tokenizer = load_tokenizer(plain.model)
    examples = load_examples(plain, algo, tokenizer, "train")
    examples = examples[0] if isinstance(examples, tuple) else examples
    mask = make_collate(plain, algo, tokenizer)(list(examples)).attention_mask_BT
    return float(mask.sum()) / mask.shape[0]


def measure(algorithm: str, model: str = "tiny", steps: int = 3, overrides: tuple[str, ...] = (),
            mixed: bool = False) -> dict:
    """Run `steps` steps of recipes/<algorithm>.yaml on long synthetic rows (`mixed`: preference pairs of a long and
    a short row, planned with their mean length); the estimate and the measured peak."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from posttrain.models.tiny import make_tiny_model
    from posttrain.plan import estimate_for_run
    from posttrain.run import run

    work = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    if model in MODELS:
        model = str(make_tiny_model(work / model, **MODELS[model]))
    data = work / "data.jsonl"
    recipe = bench_recipe(algorithm, model, data, work / "run", steps, overrides)
    write_data(algorithm, data, words=max(200, recipe.data.max_length * 3 // 2), mixed=mixed)
    mean_length = round(mean_row_length(algorithm, recipe)) if mixed else None

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        result = run(algorithm, recipe)
        measured = torch.cuda.max_memory_allocated()
    else:
        from torch.profiler import ProfilerActivity, profile

        with weights_in_allocator(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            result = run(algorithm, recipe)
        measured = cpu_peak_bytes(profiler)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine, offload = launched_engine()
    breakdown = estimate_for_run(algorithm, recipe, engine, offload, world, mean_length=mean_length)
    rows = recipe.train.per_device_train_batch_size * (2 if algorithm in ("dpo", "rm") else 1)
    length = recipe.data.max_length if algorithm != "grpo" else (
        recipe.data.max_prompt_length + recipe.generation.max_completion_length)
    shutil.rmtree(work, ignore_errors=True)
    return {"estimate": breakdown.peak_bytes, "measured": measured, "breakdown": breakdown.parts(), "engine": engine,
            "device": "cuda" if cuda else "cpu", "rows": rows, "length": length, "mean_length": mean_length,
            "saved_fraction": (result.metrics[-1] if result.metrics else {}).get("shared_prefix/saved_fraction"),
            "logged_peak_memory_mb": (result.metrics[-1] if result.metrics else {}).get("peak_memory_mb"),
            "logged_estimate_mb": (result.metrics[-1] if result.metrics else {}).get("estimated_peak_memory_mb")}


def from_run(run_dir: Path) -> dict:
    """The estimate a finished run logged and its measured peak (metrics.jsonl), as measure() reports them."""
    from posttrain.rundir.metrics import read_metrics

    logged = [r for r in read_metrics(run_dir) if r.get("peak_memory_mb") is not None]
    if not logged:
        raise SystemExit(f"--from-run {run_dir}: no metrics.jsonl row with peak_memory_mb there (did the run log a "
                         "step?)")
    estimate = logged[-1].get("estimated_peak_memory_mb")
    if estimate is None:
        raise SystemExit(f"--from-run {run_dir}: the run logged no estimated_peak_memory_mb (the planner could not "
                         "read its model's config as a decoder)")
    ranks = sum(1 for key in logged[-1] if key.startswith("peak_memory_mb/rank"))
    mib = 2**20
    return {"estimate": estimate * mib, "measured": max(r["peak_memory_mb"] for r in logged) * mib,
            "breakdown": {}, "engine": f"{ranks} ranks" if ranks else "single",
            "device": "cuda" if torch.cuda.is_available() else "cpu (peak RSS)", "rows": None, "length": None,
            "steps": logged[-1]["step"], "logged_peak_memory_mb": logged[-1]["peak_memory_mb"],
            "logged_estimate_mb": estimate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="sft", choices=["sft", "dpo", "grpo", "rm", "distill"])
    parser.add_argument("--model", default="tiny", help="tiny, 20m (made here) or a model directory / hub id")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--from-run", help="run nothing: read the estimate and peak a finished run logged (its "
                        "output_dir)")
    parser.add_argument("--mixed", action="store_true", help="preference pairs of a long and a short row, planned "
                        "with their mean length (with data.packing=true / train.max_tokens_per_microbatch=N)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.per_device_train_batch_size=4")
    args = parser.parse_args()
    if args.from_run:
        m, label = from_run(Path(args.from_run)), f"{args.from_run} | logged"
    else:
        m = measure(args.algorithm, args.model, args.steps, tuple(args.overrides), args.mixed)
        label = f"{args.model} | {args.algorithm}" + (f" (mean row {m['mean_length']} tokens)" if args.mixed else "")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    mib = 2**20
    error = (m["estimate"] - m["measured"]) / m["measured"] * 100
    if args.json:
        Path(args.json).write_text(json.dumps({**m, "error_percent": error}, indent=1))
    print(json.dumps({"estimate_parts_mib": {k: round(v / mib, 2) for k, v in m["breakdown"].items()},
                      "logged_peak_memory_mb": m["logged_peak_memory_mb"]}))
    print(f"| {label} | {m['engine']} | {m['device']} | {m['rows']} x {m['length']} | "
          f"{m['estimate'] / mib:.1f} MiB | {m['measured'] / mib:.1f} MiB | {error:+.1f}% |")


if __name__ == "__main__":
    main()
