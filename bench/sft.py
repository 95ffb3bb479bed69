"""SFT throughput: tokens/s, peak memory and achieved FLOP/s (as a fraction of this machine's measured matmul
FLOP/s) for a fixed ~24M-parameter Llama-style model on data of mixed lengths, padded vs padding-free packing.

    .venv/bin/python bench/sft.py                 # both layouts, each in its own process (clean peak memory)
    .venv/bin/python bench/sft.py --steps 12 --dtype bf16

FLOPs per trained token are counted as 6 x parameters (forward + backward matmuls) + 12 x layers x hidden x
sequence length (attention scores), the usual estimate (Kaplan et al. 2020; PaLM appendix B).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)
WORDS = "the model learns to add numbers and answer questions about short stories in plain words".split()


def matmul_flops(dtype: torch.dtype, seconds: float = 2.0, n: int = 1024) -> float:
    """This process's sustained matmul FLOP/s (the probe the achieved figure is compared with)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return count * 2 * n**3 / (time.perf_counter() - start)


def write_data(path: Path, rows: int, seed: int) -> None:
    """Prompt-completion rows whose lengths spread from ~16 to ~480 tokens (the case packing is for)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            n = int(rng.choice([8, 16, 32, 64, 128, 256, 400]) * rng.uniform(0.7, 1.0))
            f.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=8)),
                                "completion": " ".join(rng.choices(WORDS, k=n))}) + "\n")


def one(layout: str, steps: int, batch: int, dtype: str, workdir: Path) -> dict:
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.models.tiny import make_tiny_model
    from posttrain.run import run

    model_dir = make_tiny_model(workdir / "model", **MODEL)
    data = workdir / "data.jsonl"
    write_data(data, rows=steps * batch, seed=0)
    recipe = load_recipe(None, [
        f"model.name_or_path={model_dir}", f"data.train={data}", f"output_dir={workdir / layout}",
        f"data.packing={'true' if layout == 'packed' else 'false'}", "data.max_length=512",
        f"train.per_device_train_batch_size={batch}", f"train.max_steps={steps}", "train.logging_steps=1",
        "train.mixed_precision=" + ("bf16" if dtype == "bf16" else "'no'"), "train.save_final_model=false",
        "train.report=false", "train.tensorboard=false", "train.save_steps=0",
    ], ALGORITHMS["sft"][0])
    result = run("sft", recipe)
    rows = [r for r in result.metrics if "tokens_per_second" in r][1:]  # the first step pays for warm-up
    tokens_per_second = sum(r["tokens_per_second"] for r in rows) / len(rows)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    avg_len = result.metrics[-1]["num_tokens"] / (steps * batch)  # mean sequence length, for the attention term
    flops_per_token = 6 * n_params + 12 * MODEL["num_layers"] * MODEL["hidden_size"] * avg_len
    probe = matmul_flops(torch.bfloat16 if dtype == "bf16" else torch.float32)
    achieved = tokens_per_second * flops_per_token
    return {"layout": layout, "params_M": n_params / 1e6, "tokens_per_second": tokens_per_second,
            "peak_memory_mb": max(r["peak_memory_mb"] for r in rows), "achieved_gflops": achieved / 1e9,
            "matmul_probe_gflops": probe / 1e9, "fraction_of_probe": achieved / probe, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--layout", choices=["padded", "packed"], help="run one layout in this process")
    args = parser.parse_args()
    if args.layout:
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(one(args.layout, args.steps, args.batch, args.dtype, Path(tmp))), flush=True)
        return
    results = []
    for layout in ("padded", "packed"):
        cmd = [sys.executable, __file__, "--layout", layout, "--steps", str(args.steps), "--batch", str(args.batch),
               "--dtype", args.dtype]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"bench run {layout} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[0][7:]))
    print(f"\nSFT benchmark: {results[0]['params_M']:.1f}M params, {args.dtype}, batch {args.batch}, {args.steps} steps, "
          f"{results[0]['threads']} threads, mixed lengths 16-480 tokens")
    print(f"{'layout':8} {'tokens/s':>10} {'peak MB':>9} {'GFLOP/s':>9} {'probe GFLOP/s':>14} {'of probe':>9}")
    for r in results:
        print(f"{r['layout']:8} {r['tokens_per_second']:10.0f} {r['peak_memory_mb']:9.0f} {r['achieved_gflops']:9.1f} "
              f"{r['matmul_probe_gflops']:14.1f} {r['fraction_of_probe']:9.1%}")
    print(f"packed / padded speed-up: {results[1]['tokens_per_second'] / results[0]['tokens_per_second']:.2f}x")


if __name__ == "__main__":
    main()
