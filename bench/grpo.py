"""GRPO throughput: generated tokens/s, trained tokens/s and seconds per step by phase.

    python bench/grpo.py                                  # tiny random model, CPU or the GPU there is
    python bench/grpo.py --size bench --steps 6 --mixed-precision bf16   # the 24M-parameter tiny config, on a GPU
    python bench/grpo.py --model Qwen/Qwen2.5-0.5B --generation-batch-size 1
    python bench/grpo.py --engine vllm --size vllm [--async]   # in-process vLLM (make setup EXTRAS=dev,vllm)
    python bench/grpo.py --engine server --server http://127.0.0.1:8000 --model DIR   # `posttrain serve --model DIR`

Runs `posttrain grpo` in-process on the shipped arithmetic prompts with a length reward (varies within groups, so
every step trains), reads metrics.jsonl and prints one table: seconds per step by phase and the wall-clock seconds
per step (with --async the phases overlap, so the wall clock is the figure that counts). The first step (warm-up)
is left out of the figures. One engine per invocation: vLLM's in-process engine lives as long as its process.
Numbers, not assertions: tests never time anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "tiny": {},
    "vllm": dict(num_heads=2, num_kv_heads=1),  # the tiny model with head_dim 32: vLLM's CPU attention needs >= 32
    "bench": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408),
}
PHASES = ("time/sync", "time/generate", "time/score", "time/ref", "time/train")


def length_reward(completions, **kwargs):
    """Longer text, more reward (TRL's contract: a conversational completion is [{"role": "assistant", ...}])."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 40.0 for c in completions]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory or hub id (default: a fresh tiny model of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (one process)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--generation-batch-size", type=int, default=None, help="prompts per generate call")
    parser.add_argument("--micro-batch", type=int, default=None, help="completions per micro-batch (default: all)")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm", "server"])
    parser.add_argument("--server", action="append", default=[], help="a `posttrain serve` URL (--engine server)")
    parser.add_argument("--async", dest="async_", action="store_true", help="generation.async (vllm, server)")
    args = parser.parse_args(argv)
    if args.engine == "server" and not (args.server and args.model):
        parser.error("--engine server needs --server URL and --model DIR (the directory the server was started on)")

    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.models.tiny import make_tiny_model
    from posttrain.run import run

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(Path(tmp) / "model", **SIZES[args.size]))
        completions = args.prompts * args.generations
        micro = args.micro_batch or completions
        overrides = [
            f"model.name_or_path={model}", f"output_dir={tmp}/run",
            f"data.train={ROOT}/examples/data/prompts_train.jsonl", "data.eval=null",
            f"train.max_steps={args.steps}", "train.logging_steps=1", "train.save_steps=0",
            "train.report=false", "train.tensorboard=false", "train.save_final_model=false",
            f"train.mixed_precision='{args.mixed_precision}'",
            f"train.per_device_train_batch_size={micro}", f"train.gradient_accumulation_steps={completions // micro}",
            f"generation.max_completion_length={args.max_completion_length}",
            f"generation.batch_size={args.generation_batch_size or 'null'}",
            f"algo.num_generations={args.generations}", f"algo.beta={args.beta}",
            f"algo.num_iterations={args.num_iterations}", "algo.log_samples=0",
            f"rewards=[{{name: '{Path(__file__).resolve()}:length_reward'}}]",
            f"generation.engine={args.engine}", f"generation.async={str(args.async_).lower()}",
        ]
        if args.engine == "server":
            overrides.append(f"generation.servers=[{','.join(args.server)}]")
        recipe = load_recipe(str(ROOT / "recipes" / "grpo.yaml"), overrides, ALGORITHMS["grpo"][0])
        result = run("grpo", recipe)
    every = [r for r in result.metrics if "loss" in r]
    rows = every[1:] or every
    # wall clock of a step: its tokens over its tokens/s (logged every step, measured from the previous log)
    walls = [(b["num_tokens"] - a["num_tokens"]) / b["tokens_per_second"] for a, b in zip(every, every[1:])]
    print_table(rows, walls, completions, args)
    return 0


def print_table(rows: list[dict], walls: list[float], completions: int, args) -> None:
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    generating = [r for r in rows if r["time/generate"] > 0]
    new_tokens = statistics.fmean(r["completion_length/mean"] * completions for r in generating)
    steps = list(zip(rows, rows[1:]))
    trained = statistics.fmean(b["num_tokens"] - a["num_tokens"] for a, b in steps) if steps else None
    step = sum(mean(p) for p in PHASES)
    print(f"\nGRPO bench: {args.size if not args.model else args.model}, engine {args.engine}"
          f"{' (async)' if args.async_ else ''}, {args.prompts} prompts x {args.generations} generations, max "
          f"{args.max_completion_length} new tokens, {len(rows)} steps measured")
    print(f"{'phase':<16}{'s/step':>10}{'share':>8}")
    for phase in PHASES:
        print(f"{phase:<16}{mean(phase):>10.3f}{mean(phase) / step:>8.0%}")
    print(f"{'total':<16}{step:>10.3f}")
    if walls:
        wall = statistics.fmean(walls)
        print(f"wall clock           {wall:.3f} s/step = {1 / wall:.3f} steps/s")
    if args.async_:  # time/generate is only the wait for the batch sampled during the previous step
        print(f"generated tokens/s   (async: sampling overlaps training; {new_tokens:.0f} new tokens per generation)")
    else:
        print(f"generated tokens/s   {new_tokens / statistics.fmean(r['time/generate'] for r in generating):,.0f}"
              f"   ({new_tokens:.0f} new tokens per generation)")
    if trained is not None:
        print(f"trained tokens/s     {trained / mean('time/train'):,.0f}   ({trained:.0f} tokens per step)")
    print(f"reward/mean          {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
