"""Weight sync to `posttrain serve` servers: seconds per sync against a raw broadcast of the same bytes in the same
gloo group (the floor any sync over that group pays). Target: sync <= 1.2x raw.

    .venv/bin/python bench/weight_sync.py                          # 1 server, ~24M-parameter Llama (~100 MB fp32)
    .venv/bin/python bench/weight_sync.py --servers 2 --repeats 5
    .venv/bin/python bench/weight_sync.py --lora 16                # a LoRA policy: merged vs adapter-only syncs

A sync is what the trainer's rank 0 does after an optimiser step (`Backend.weight_buckets` -> `ServerEngine.load_weights`
+ the version stamp: the backend's buckets travel as they come),
through vLLM's weight-transfer API with the gloo-posttrain backend: /start_weight_update (vLLM's layerwise reload
begins), /update_weights while each `--bucket-mb` bucket is packed and broadcast (header, then bytes) and loaded,
/finish_weight_update (oneDNN repacking on a CPU), the prefix-cache reset and the version stamp. The raw baseline broadcasts byte buffers of the same bucket sizes
to the same workers and drops them. With --lora R the policy has rank-R adapters on every linear layer and the
servers are LoRA-enabled: a merged sync (W + scaling * B @ A, every tensor) against an adapter-only sync
(generation.lora_sync=adapter: the lora_A / lora_B tensors, written on the server and served under a new name),
whose probe of the server and check against the trainer's log-probs is timed apart. Needs vLLM (`make setup EXTRAS=dev,vllm`); the servers run fp32 on the CPU here.
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


def start_server(model_dir: Path, log: Path, extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "--model", str(model_dir), "--port",
                                    str(port), "--", "--max-model-len", "256", "--enforce-eager", *extra],
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
    parser.add_argument("--lora", type=int, default=0, help="rank of a LoRA policy: time merged vs adapter syncs")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("POSTTRAIN_SERVER_TOKEN", secrets.token_urlsafe(16))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vllm

    from posttrain.config.schema import GenerationConfig
    from posttrain.models.tiny import make_tiny_model
    from posttrain.generation.adapter_sync import max_lora_rank
    from posttrain.generation.server import ServerEngine
    from posttrain.config.schema import Recipe
    from posttrain.distributed.backend import Backend
    from posttrain.generation.weight_transfer import Background

    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    model_dir = make_tiny_model(work / "model", seed=0, **MODEL)
    servers = []
    try:
        lora = ("--enable-lora", "--max-lora-rank", str(max_lora_rank(args.lora))) if args.lora else ()
        for i in range(args.servers):  # one at a time: start-up is CPU-bound
            servers.append(start_server(model_dir, work / f"serve-{i}.log", lora))
        urls = [url for _, url in servers]
        if args.lora:
            return print(json.dumps(lora_syncs(model_dir, urls, args)))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine = ServerEngine(GenerationConfig(engine="vllm", placement="servers", servers=tuple(urls), sync_bucket_mb=args.bucket_mb),
                              AutoTokenizer.from_pretrained(model_dir), sends_weights=True)
        backend = Backend(Recipe(output_dir=str(work / "run")))
        sizes = [sum(t.numel() * t.element_size() for _, t in bucket)
                 for bucket in backend.weight_buckets(model, args.bucket_mb)]

        def sync(version: int) -> None:
            engine.load_weights(backend.weight_buckets(model, args.bucket_mb))
            engine.set_version(version)

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


def lora_syncs(model_dir: Path, urls: list[str], args) -> dict:
    """Median seconds and bytes of adapter-only syncs (first, while the servers hold the starting base weights) and
    of merged syncs of the same LoRA policy."""
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.config import LoraConfig
    from posttrain.config.schema import GenerationConfig
    from posttrain.distributed.weight_sync import adapter_units, sync_units
    from posttrain.models.load import apply_lora
    from posttrain.generation.adapter_sync import adapter_config, check_delivery
    from posttrain.generation.server import ServerEngine

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                        LoraConfig(enabled=True, r=args.lora, alpha=2 * args.lora)).eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.01)  # as after some training: B starts at 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GenerationConfig(engine="vllm", placement="servers", servers=tuple(urls), sync_bucket_mb=args.bucket_mb)

    class Role:  # what check_delivery asks of the policy role
        train = staticmethod(policy.train)

        @staticmethod
        def logprobs(batch, temperature=1.0):
            from posttrain.models.forward import policy_logprobs

            return policy_logprobs(policy, batch, temperature)

    def tensors(units):
        with torch.no_grad():
            return [(u.name, u.compute([p.data for p in u.params])) for u in units]

    out = {"servers": len(urls), "lora_rank": args.lora, "repeats": args.repeats, "vllm": vllm.__version__}
    for kind, units in (("adapter", adapter_units(policy)), ("merged", sync_units(policy))):
        named = tensors(units)
        engine = ServerEngine(config, tokenizer, sends_weights=True)
        if kind == "adapter":
            engine.send_adapters(adapter_config(policy), "bench")
        sync_s, probe_s = [], []
        for version in range(args.repeats + 1):  # the first opens the group: not timed
            started = time.perf_counter()
            engine.load_weights([named])
            engine.set_version(version)
            synced = time.perf_counter()
            check_delivery(engine.delivery_probes(), Role, "cpu", 1e-3, version)
            if version:
                sync_s.append(synced - started)
                probe_s.append(time.perf_counter() - synced)
        engine.close()
        out[f"{kind}_bytes"] = sum(t.numel() * t.element_size() for _, t in named)
        out[f"{kind}_sync_s"] = round(sorted(sync_s)[len(sync_s) // 2], 3)
        if kind == "adapter":
            out["adapter_probe_s"] = round(sorted(probe_s)[len(probe_s) // 2], 3)
    out["bytes_ratio"] = round(out["merged_bytes"] / out["adapter_bytes"], 1)
    return out


if __name__ == "__main__":
    main()
