"""One long sequence without and with sequence parallelism: peak memory per process and seconds per step of SFT on
one row of --seq tokens, SP=1 (one process) against SP=2 (two processes, DeepSpeed Ulysses over gloo on a CPU, NCCL on
GPUs), side by side, each in fresh processes (clean peaks).

    .venv/bin/python bench/sequence_parallel.py                      # 16,384 tokens, the 20m Llama, 2 steps
    .venv/bin/python bench/sequence_parallel.py --seq 4096 --steps 3 --size tiny

The two runs train the same row with the same seed, so their losses agree (printed beside the figures); the update
is the same (tests/distributed/test_sequence_parallel.py). Peak memory is each process's peak RSS on a CPU (model,
optimiser, activations and the interpreter's baseline), CUDA's peak on a GPU; the SP=2 figure is the larger of its
two ranks. s/step is the last step's wall time (its tokens / its logged tokens_per_second). The machine's cores are
split between the processes (OMP_NUM_THREADS), so on a CPU both runs use all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_shapes import SIZES, VOCAB_WORDS  # noqa: E402  the generated shapes every bench shares

ROOT = Path(__file__).resolve().parents[1]


def prepare(work: Path, size: str, seq: int) -> tuple[Path, Path]:
    """The generated model (positions for the whole row) and one plain-text row longer than --seq tokens."""
    from posttrain.models.tiny import make_tiny_model

    shape = dict(SIZES[size])
    shape.pop("vocab")
    model = work / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, max_position_embeddings=2 * seq, **shape)
    data = work / f"row-{seq}.jsonl"
    words = [VOCAB_WORDS[(i * 7919) % len(VOCAB_WORDS)] for i in range(2 * seq)]
    data.write_text(json.dumps({"text": " ".join(words)}) + "\n")
    return model, data


def run(a, size: int, model: Path, data: Path, work: Path) -> dict:
    out = work / f"sp{size}"
    overrides = [f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}", f"data.max_length={a.seq}",
                 f"train.max_steps={a.steps}", "train.per_device_train_batch_size=1",
                 "train.gradient_accumulation_steps=1", "train.logging_steps=1", "train.report=false",
                 "train.tensorboard=false", "train.save_final_model=false", "train.save_steps=0", "seed=3",
                 f"train.sequence_parallel_size={size}"]
    threads = max(1, (os.cpu_count() or 1) // size)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    launcher = [sys.executable, "-m", "posttrain"] if size == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={size}", f"--master_port={free_port()}",
        "-m", "posttrain"]
    done = subprocess.run([*launcher, "sft", *overrides], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"SP={size} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    last = rows[-1]
    peaks = [v for k, v in last.items() if k.startswith("peak_memory_mb/rank")] or [last["peak_memory_mb"]]
    tokens = rows[-1]["num_tokens"] - (rows[-2]["num_tokens"] if len(rows) > 1 else 0)
    return {"sp": size, "processes": size, "peak_mb": max(peaks), "s_per_step": tokens / last["tokens_per_second"],
            "tokens": tokens, "losses": [r["loss"] for r in rows]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384, help="tokens in the row")
    p.add_argument("--size", default="20m", choices=sorted(SIZES), help="generated model (bench/compare_trl.py)")
    p.add_argument("--steps", type=int, default=2, help="optimiser steps; s/step is the last one's")
    p.add_argument("--work", type=Path, default=None, help="keep the model and runs here (default: a temp dir)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model, data = prepare(work, a.size, a.seq)
        results = [run(a, size, model, data, work) for size in (1, 2)]
    print(f"SFT, one row of {results[0]['tokens']} tokens, model {a.size}, {a.steps} steps, {os.cpu_count()} cores")
    print(f"{'':28}" + "".join(f"{'SP=' + str(r['sp']):>14}" for r in results))
    print(f"{'processes':28}" + "".join(f"{r['processes']:>14}" for r in results))
    print(f"{'peak memory / process (MB)':28}" + "".join(f"{r['peak_mb']:>14.0f}" for r in results))
    print(f"{'s/step (last step)':28}" + "".join(f"{r['s_per_step']:>14.1f}" for r in results))
    print(f"{'loss per step':28}" + "".join(f"{' '.join(f'{x:.4f}' for x in r['losses']):>14}" for r in results))


if __name__ == "__main__":
    main()
