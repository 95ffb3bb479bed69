"""Weight sync to `posttrain serve` servers: seconds per sync against a raw broadcast of the same bytes in the same
gloo group (the floor any sync over that group pays). Target: sync <= 1.2x raw.

    .venv/bin/python bench/weight_sync.py                          # 1 server, ~24M-parameter Llama (~100 MB fp32)
    .venv/bin/python bench/weight_sync.py --servers 2 --repeats 5

A sync is what the trainer's rank 0 does after an optimiser step (`ServerEngine.load_weights` + the version stamp),
through vLLM's weight-transfer API with the gloo-posttrain backend: /start_weight_update (vLLM's layerwise reload
begins), /update_weights while each `--bucket-mb` bucket is packed and broadcast (header, then bytes) and loaded,
/finish_weight_update (oneDNN repacking on a CPU), the prefix-cache reset and the version stamp. The raw baseline broadcasts byte buffers of the same bucket sizes
to the same workers and drops them. Needs vLLM (`make setup EXTRAS=dev,vllm`); the servers run fp32 on the CPU here.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)  # as bench/generation.py


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "--model", str(model_dir), "--port",
                                    str(port), "--", "--max-model-len", "256", "--enforce-eager"],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    while "ready at" not in log.read_text():
        if process.poll() is not None:
            raise SystemExit(f"posttrain serve failed:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    return process, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("POSTTRAIN_SERVER_TOKEN", secrets.token_urlsafe(16))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vllm

    from posttrain.config.schema import GenerationConfig
    from posttrain.models.tiny import make_tiny_model
    from posttrain.rollout.server import ServerEngine
    from posttrain.rollout.weight_transfer import Background, wire_buckets

    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    model_dir = make_tiny_model(work / "model", seed=0, **MODEL)
    servers = []
    try:
        for i in range(args.servers):  # one at a time: start-up is CPU-bound
            servers.append(start_server(model_dir, work / f"serve-{i}.log"))
        urls = [url for _, url in servers]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine = ServerEngine(GenerationConfig(engine="vllm", placement="servers", servers=tuple(urls), sync_bucket_mb=args.bucket_mb),
                              AutoTokenizer.from_pretrained(model_dir), sends_weights=True)
        named = list(model.named_parameters())
        sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in wire_buckets(iter(named), engine.bucket_bytes)]

        def sync(version: int) -> None:
            engine.load_weights(iter(named))
            engine.version = version

        def raw() -> None:
            receivers = [Background(engine._rpc, url, "/collective_rpc",
                                    {"method": "posttrain_broadcast_only", "args": [json.dumps(sizes)]})
                         for url in urls]
            for size in sizes:
                engine._transfer.group.broadcast(torch.empty(size, dtype=torch.uint8))
            for receiver in receivers:
                receiver.join()

        sync(0)  # opens the group; not timed
        raw()
        timings = {"sync": [], "raw": [], "server_receive": [], "server_total": []}
        for version in range(1, args.repeats + 1):  # interleaved, so load drifts hit both alike
            for name, fn in (("sync", lambda: sync(version)), ("raw", raw)):
                started = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - started)
            seconds = [engine._rpc(url, "/collective_rpc", {"method": "posttrain_sync_seconds"})["results"][0]
                       for url in urls]
            timings["server_receive"].append(max(r["receive_s"] for r in seconds))
            timings["server_total"].append(max(r["total_s"] for r in seconds))
        median = {k: sorted(v)[len(v) // 2] for k, v in timings.items()}
        total = sum(sizes)
        print(json.dumps({
            "servers": args.servers, "bytes": total, "buckets": len(sizes), "bucket_mb": args.bucket_mb,
            "sync_s": round(median["sync"], 3), "raw_broadcast_s": round(median["raw"], 3),
            "ratio": round(median["sync"] / median["raw"], 2),
            "server_total_s": round(median["server_total"], 3),
            "server_waiting_for_bytes_s": round(median["server_receive"], 3),
            "sync_mb_per_s": round(total / 2**20 / median["sync"], 1), "repeats": args.repeats,
            "vllm": vllm.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
        }))
        engine.close()
    finally:
        for process, _ in servers:
            process.send_signal(signal.SIGTERM)  # posttrain serve stops vLLM's whole process group
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
