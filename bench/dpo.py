"""DPO throughput: pairs/s, tokens/s and peak memory for a fixed ~24M-parameter Llama-style model, with the reference
model live (a frozen copy scored every step) and with precomputed reference log-probs (scored once before training,
cached, the copy freed). Also the one-off cost of the precomputation, and the LoRA variant (reference = the
adapter-off policy, no copy) when asked.

    .venv/bin/python bench/dpo.py                       # live vs precomputed, each in its own process (clean peaks)
    .venv/bin/python bench/dpo.py --steps 20 --batch 16 --dtype bf16 --lora

tokens counts both sequences of a pair (prompt + chosen, prompt + rejected); pairs/s and tokens/s are over the
training steps after the first (warm-up); pairs/cpu-s is pairs over the process CPU time of the whole training loop
(steady on a machine shared with other jobs, where wall-clock figures are not). `setup s` is everything before the
first step (loading, and the precomputation, also shown alone as `precompute s`). Peak memory is the CUDA peak on a
GPU and the process's peak RSS on a CPU.
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
MODES = ("live", "precomputed")


def write_pairs(path: Path, rows: int, prompt_words: int, completion_words: int, seed: int) -> None:
    """Preference rows: a prompt of ~prompt_words words and two different completions of 0.5-1x completion_words."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choices(WORDS, k=prompt_words))
            chosen, rejected = (" " + " ".join(rng.choices(WORDS, k=int(completion_words * rng.uniform(0.5, 1.0))))
                                for _ in range(2))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected + " no"}) + "\n")


def time_calls() -> dict[str, tuple[float, float]]:
    """(wall, process CPU) seconds of the training loop and of the DPO setup hook (the precomputation), filled in when
    they return. CPU seconds are the robust figure on a shared machine: other processes slow the wall clock only."""
    import posttrain.algorithms.dpo as dpo
    import posttrain.train.loop as loop

    clocks: dict[str, tuple[float, float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn(*a, **k)
            clocks[name] = (time.perf_counter() - wall, time.process_time() - cpu)
            return out
        return wrapper

    loop.train = timed("train", loop.train)
    dpo.DPO.setup = timed("setup", dpo.DPO.setup)
    return clocks


def one(mode: str, args, workdir: Path) -> dict:
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.models.tiny import make_tiny_model
    from posttrain.run import run

    model_dir = make_tiny_model(workdir / "model", **MODEL)
    data = workdir / "pairs.jsonl"
    write_pairs(data, rows=args.steps * args.batch, prompt_words=args.prompt_words,
                completion_words=args.completion_words, seed=0)
    out = workdir / mode
    precision = "bf16" if args.dtype == "bf16" else "'no'"  # quoted: a bare no is YAML's false
    overrides = [
        f"model.name_or_path={model_dir}", f"data.train={data}", f"output_dir={out}", "data.max_length=1024",
        f"train.per_device_train_batch_size={args.batch}", f"train.per_device_eval_batch_size={args.batch}",
        f"train.max_steps={args.steps}", "train.logging_steps=1",
        f"train.mixed_precision={precision}", "train.save_final_model=false",
        "train.report=false", "train.tensorboard=false", "train.save_steps=0",
        f"algo.precompute_ref_logprobs={'true' if mode == 'precomputed' else 'false'}",
    ]
    if args.lora:
        overrides.append("model.lora.enabled=true")
    recipe = load_recipe(None, overrides, ALGORITHMS["dpo"][0])
    clocks = time_calls()
    started = time.perf_counter()
    result = run("dpo", recipe)
    wall = time.perf_counter() - started
    state = json.loads(next((out / "checkpoints").glob("step-*/trainer_state.json")).read_text())["state"]
    rows = [r for r in result.metrics if "tokens_per_second" in r]
    timed = rows[1:] or rows  # the first step pays for warm-up
    tokens_per_second = sum(r["tokens_per_second"] for r in timed) / len(timed)
    tokens_per_pair = state["tokens_seen"] / state["samples_seen"]
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    return {"mode": mode + ("+lora" if args.lora else ""), "params_M": n_params / 1e6,
            "pairs_per_second": tokens_per_second / tokens_per_pair, "tokens_per_second": tokens_per_second,
            "tokens_per_pair": tokens_per_pair, "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
            "setup_seconds": wall - state["elapsed_seconds"], "precompute_seconds": clocks.get("setup", (0, 0))[0],
            "pairs_per_cpu_second": state["samples_seen"] / clocks["train"][1],
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--completion-words", type=int, default=128)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--lora", action="store_true", help="also run both modes with LoRA adapters")
    parser.add_argument("--threads", type=int, help="CPU threads per run (1 keeps CPU-second figures honest on a "
                        "shared machine: waiting threads spin); default: torch's")
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode:
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(one(args.mode, args, Path(tmp))), flush=True)
        return
    results = []
    for lora in ([False, True] if args.lora else [False]):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps), "--batch", str(args.batch),
                   "--prompt-words", str(args.prompt_words), "--completion-words", str(args.completion_words),
                   "--dtype", args.dtype] + (["--lora"] if lora else [])
            env = {**os.environ, "TQDM_DISABLE": "1"}
            if args.threads:
                cmd += ["--threads", str(args.threads)]
                env["OMP_NUM_THREADS"] = str(args.threads)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                sys.exit(f"bench run {mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            results.append(json.loads(line[0][7:]))
    first = results[0]
    print(f"\nDPO benchmark: {first['params_M']:.1f}M params, {args.dtype}, {first['device']}, "
          f"{args.batch} pairs/step, "
          f"{args.steps} steps, {first['tokens_per_pair']:.0f} tokens/pair, {first['threads']} threads")
    print(f"{'reference':18} {'pairs/s':>9} {'tokens/s':>10} {'pairs/cpu-s':>12} {'peak MB':>9} {'setup s':>8} "
          f"{'precompute s':>13}")
    for r in results:
        print(f"{r['mode']:18} {r['pairs_per_second']:9.2f} {r['tokens_per_second']:10.0f} "
              f"{r['pairs_per_cpu_second']:12.3f} {r['peak_memory_mb']:9.0f} {r['setup_seconds']:8.1f} "
              f"{r['precompute_seconds']:13.1f}")
    for i in range(0, len(results), 2):
        live, cached = results[i], results[i + 1]
        print(f"{cached['mode']} / {live['mode']}: {cached['pairs_per_second'] / live['pairs_per_second']:.2f}x pairs/s "
              f"({cached['pairs_per_cpu_second'] / live['pairs_per_cpu_second']:.2f}x per CPU second), "
              f"{cached['peak_memory_mb'] / live['peak_memory_mb']:.2f}x peak memory")


if __name__ == "__main__":
    main()
