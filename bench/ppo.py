"""PPO throughput with its four models: steps/s, seconds per phase and peak memory.

    python bench/ppo.py                                   # tiny random model, CPU or the GPU there is
    python bench/ppo.py --size bench --steps 6 --mixed-precision bf16
    accelerate launch --config_file recipes/accelerate/zero3.yaml bench/ppo.py --size bench

Runs `posttrain ppo` in-process on the shipped arithmetic prompts with a length reward (varies between completions,
so every step trains) and a KL penalty (so the reference runs), reads metrics.jsonl and prints one table: generate,
score, policy log-probs, reference log-probs, critic values (the rollout), policy update, value update (the loop).
The first step (warm-up) is left out. Numbers, not assertions: tests never time anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo import SIZES  # noqa: E402  (bench/grpo.py:length_reward is the reward, named by its path)

PHASES = ("time/generate", "time/score", "time/policy_logprobs", "time/reference", "time/values",
          "time/update/policy", "time/update/critic")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory or hub id (default: a fresh tiny model of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32, help="prompts (= completions) per step, one process")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=None, help="completions per micro-batch (default: all)")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    args = parser.parse_args(argv)

    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.models.tiny import make_tiny_model
    from posttrain.run import run

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(Path(tmp) / "model", **SIZES[args.size]))
        micro = args.micro_batch or args.prompts
        overrides = [
            f"model.name_or_path={model}", f"output_dir={tmp}/run",
            f"data.train={ROOT}/examples/data/prompts_train.jsonl", "data.eval=null",
            f"train.max_steps={args.steps}", "train.logging_steps=1", "train.save_steps=0",
            "train.report=false", "train.tensorboard=false", "train.save_final_model=false",
            f"train.mixed_precision='{args.mixed_precision}'",
            f"train.per_device_train_batch_size={micro}", f"train.gradient_accumulation_steps={args.prompts // micro}",
            f"generation.max_completion_length={args.max_completion_length}", "algo.kl_coef=0.05",
            "algo.log_samples=0", f"rewards=[{{name: '{Path(__file__).resolve().parent / 'grpo.py'}:length_reward'}}]",
        ]
        recipe = load_recipe(str(ROOT / "recipes" / "ppo.yaml"), overrides, ALGORITHMS["ppo"][0])
        started = time.perf_counter()
        result = run("ppo", recipe)
        seconds = time.perf_counter() - started
    rows = [r for r in result.metrics if "loss" in r]
    rows = rows[1:] or rows
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    step = sum(mean(p) for p in PHASES)
    print(f"\nPPO bench: {args.model or args.size}, {args.prompts} completions per step, max "
          f"{args.max_completion_length} new tokens, {len(rows)} steps measured ({seconds:.1f} s for the whole run)")
    print(f"{'phase':<24}{'s/step':>10}{'share':>8}")
    for phase in PHASES:
        print(f"{phase:<24}{mean(phase):>10.3f}{mean(phase) / step:>8.0%}")
    print(f"{'total':<24}{step:>10.3f}   -> {1 / step:.3f} steps/s")
    print(f"peak memory (policy, critic, reference, optimisers): {max(r['peak_memory_mb'] for r in rows):,.0f} MiB")
    print(f"reward/mean {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
