"""Padded vs padding-free vs token-budget micro-batches on rows of mixed lengths (64 to 2,048 tokens): seconds per
step and peak memory for DPO and GRPO, side by side, each mode in a fresh process (clean peaks).

    .venv/bin/python bench/packing.py                      # DPO and GRPO, 4 steps each, a 256-wide 4-layer Llama
    .venv/bin/python bench/packing.py --algo dpo --steps 6 --batch 8

Modes (the same data, seed and global batch; the update is the same in all three, tests/integration/test_packing.py):
- padded: micro-batches of `--batch` rows (pairs, prompts x generations) padded to their longest row;
- packed: data.packing=true, the same micro-batches with their forwards on the real tokens only;
- budget: data.packing=true and train.max_tokens_per_microbatch (the longest unit the recipe allows), the rows
  regrouped into as few micro-batches within it as fit.
s/step is the mean wall time of the steps after the first (tokens of a step / the logged tokens_per_second); peak
memory is the process's peak RSS on a CPU (model, optimiser and activations), CUDA's peak on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = "the model learns to add numbers and answer questions about short stories in plain words".split()
MODES = {"padded": [], "packed": ["data.packing=true"], "budget": ["data.packing=true"]}


def length_reward(prompts, completions, **_):
    """GRPO's reward here: longer completions score higher (varies within a group even for a random model)."""
    return [len(c) / 40.0 for c in completions]


def lengths(rows: int, low: int, high: int, seed: int) -> list[int]:
    """Word counts spread log-uniformly between low and high (long-tailed, as reasoning traces are)."""
    rng = random.Random(seed)
    return [int(low * (high / low) ** rng.random()) for _ in range(rows)]


def text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def write_data(work: Path, rows: int, low: int, high: int) -> dict[str, Path]:
    rng = random.Random(0)
    pairs, prompts = work / "pairs.jsonl", work / "prompts.jsonl"
    with pairs.open("w") as f:
        for n in lengths(rows, low, high, seed=1):
            f.write(json.dumps({"prompt": text(8, rng), "chosen": " " + text(n, rng),
                                "rejected": " " + text(max(1, int(n * rng.uniform(0.5, 1.0))), rng)}) + "\n")
    with prompts.open("w") as f:
        for n in lengths(rows, low, high, seed=2):
            f.write(json.dumps({"prompt": text(n, rng), "answer": "4"}) + "\n")
    return {"dpo": pairs, "grpo": prompts}


def overrides(a, algo: str, mode: str, model: Path, data: Path, out: Path) -> list[str]:
    common = [f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}", f"train.max_steps={a.steps}",
              "train.logging_steps=1", "train.report=false", "train.tensorboard=false", "seed=3",
              f"data.max_length={a.max_length}", *MODES[mode]]
    if algo == "dpo":
        common += [f"train.per_device_train_batch_size={a.batch}", "train.gradient_accumulation_steps=1"]
        budget = 2 * a.max_length
    else:
        common += [f"train.per_device_train_batch_size={a.batch * 4}", "algo.num_generations=4",
                   f"generation.max_completion_length={a.completion}", f"data.max_prompt_length={a.max_length}",
                   "rewards=[{name: 'bench.packing:length_reward'}]"]
        budget = a.max_length + a.completion
    return common + ([f"train.max_tokens_per_microbatch={budget}"] if mode == "budget" else [])


def run(a, algo: str, mode: str, model: Path, data: Path, work: Path) -> dict:
    out = work / f"{algo}-{mode}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "posttrain", algo, *overrides(a, algo, mode, model, data, out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{algo} {mode} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    tokens = [b["num_tokens"] - a_["num_tokens"] for a_, b in zip(rows, rows[1:])]
    seconds = [t / r["tokens_per_second"] for t, r in zip(tokens, rows[1:])]
    return {"s/step": sum(seconds) / max(1, len(seconds)), "peak MB": max(r["peak_memory_mb"] for r in rows),
            "tokens/step": sum(tokens) / max(1, len(tokens)), "loss": rows[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=["dpo", "grpo", "both"], default="both")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="pairs (DPO) or prompts (GRPO, x 4 generations) per step")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--completion", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    from posttrain.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", hidden_size=a.hidden, num_layers=a.layers, num_heads=8, num_kv_heads=4,
                                intermediate_size=a.hidden * 3, max_position_embeddings=a.max_length + a.completion)
        data = write_data(work, a.rows, 48, a.max_length * 3 // 4)  # words: ~1.3 tokens each, cut at max_length
        print(f"model: hidden {a.hidden}, {a.layers} layers | rows of ~64-{a.max_length} tokens | {a.steps} steps")
        print(f"{'algo':6} {'mode':8} {'s/step':>8} {'peak MB':>8} {'tokens/step':>12} {'last loss':>10}")
        for algo in (["dpo", "grpo"] if a.algo == "both" else [a.algo]):
            for mode in MODES:
                r = run(a, algo, mode, model, data[algo], work)
                print(f"{algo:6} {mode:8} {r['s/step']:8.2f} {r['peak MB']:8.0f} {r['tokens/step']:12.0f} "
                      f"{r['loss']:10.5f}", flush=True)


if __name__ == "__main__":
    main()
