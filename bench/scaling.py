"""Throughput and memory of one SFT recipe on 1 and 2 processes under each engine, as a table.

    python bench/scaling.py                                  # CPU: a ~3M-parameter model, 2 gloo processes
    python bench/scaling.py --engines ddp zero3 --steps 20 --hidden-size 512 --layers 8
    python bench/scaling.py --engines zero2_offload zero3_offload

Every run is a real `posttrain sft` launch (plain process, torchrun, or accelerate launch with the shipped
recipes/accelerate/*.yaml; see tests/distributed/launch.py). Weak scaling: each process keeps the same micro-batch,
so the global batch doubles with 2 processes. tokens/s is the mean over the logging windows after the first
(start-up and warm-up excluded); peak memory is per rank: peak RSS on CPU, max CUDA allocation on GPU. On a
2-core machine 2 processes share the cores, so read the CPU numbers as overheads, not as GPU scaling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.models.tiny import make_tiny_model  # noqa: E402
from posttrain.demo.tasks import arithmetic_problems, sft_rows, write_jsonl  # noqa: E402
from tests.distributed.launch import ENGINES, launch  # noqa: E402

CONFIGS = {**ENGINES, "zero1": {"accelerate_config": "zero1"}, "zero2_offload": {"accelerate_config": "zero2_offload"},
           "zero3_offload": {"accelerate_config": "zero3_offload"}}


def bench_one(engine: str, n_procs: int, model: Path, data: Path, out: Path, args) -> dict:
    overrides = [
        f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}", "data.packing=true",
        f"data.max_length={args.max_length}", f"train.per_device_train_batch_size={args.micro_batch}",
        f"train.max_steps={args.steps}", f"train.logging_steps={args.logging_steps}", "train.save_final_model=false",
        f"train.save_steps={args.steps * 10}", "train.report=false", "train.tensorboard=false",
    ]
    how = CONFIGS[engine] if (n_procs > 1 or engine != "ddp") else {}  # 1 process "ddp" = a plain process
    run = launch(n_procs, "sft", overrides, timeout=args.timeout, **how)
    if not run.ok:
        return {"error": run.output.strip().splitlines()[-1][:80]}
    rows = [r for r in run.metrics() if "tokens_per_second" in r]
    windows = rows[1:] or rows
    ranks = sorted(k for k in rows[-1] if k.startswith("peak_memory_mb/rank")) or ["peak_memory_mb"]
    return {
        "engine": run.facts["engine"], "offload": run.facts["offload"], "world": int(run.facts["world_size"]),
        "tokens_per_s": statistics.mean(r["tokens_per_second"] for r in windows),
        "peak_mb": [rows[-1][k] for k in ranks], "seconds": run.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(CONFIGS))
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--logging-steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", hidden_size=args.hidden_size, num_layers=args.layers,
                                num_heads=max(1, args.hidden_size // 64), num_kv_heads=max(1, args.hidden_size // 128),
                                intermediate_size=args.hidden_size * 11 // 4)
        data = write_jsonl(sft_rows(arithmetic_problems(2000, 0)), root / "train.jsonl")
        print(f"model: hidden {args.hidden_size}, {args.layers} layers; micro-batch {args.micro_batch} per process "
              f"(packed, max_length {args.max_length}); {args.steps} steps\n")
        header = f"{'config':<15}{'procs':>6}  {'engine':<17}{'offload':<16}{'tokens/s':>10}  {'peak MB per rank':<22}{'wall s':>7}"
        print(header)
        print("-" * len(header))
        for engine in args.engines:
            for n in args.procs:
                r = bench_one(engine, n, model, data, root / f"{engine}-{n}", args)
                if "error" in r:
                    print(f"{engine:<15}{n:>6}  failed: {r['error']}")
                    continue
                peaks = " / ".join(f"{mb:.0f}" for mb in r["peak_mb"])
                print(f"{engine:<15}{r['world']:>6}  {r['engine']:<17}{r['offload']:<16}{r['tokens_per_s']:>10.0f}  "
                      f"{peaks:<22}{r['seconds']:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
