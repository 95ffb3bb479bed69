"""GRPO under ZeRO-3 on 2 training processes with 2 `posttrain serve` servers, full weights and LoRA: after each run
both servers must hold exactly final/ (a checksum of every tensor). Run by hand: CI starts one server per test
session, so its test of the same path (tests/distributed/test_server_distributed.py) uses one server.

    python bench/two_servers.py            # CPU: the head_dim-32 tiny model, 3 steps each; ~3 minutes on 2 cores

Prints, per run: seconds, engine, world size, the sampler-vs-trainer log-prob gap per step and whether each server's
digests equal final/'s; exits 1 when a server does not hold final/.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_servers(model: Path, root: Path, env: dict[str, str], count: int = 2) -> list[tuple]:
    """`count` servers started at once on free ports; (process, url, log) each once all answer."""
    servers = []
    for i in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = root / f"serve{i}.log"
        process = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "--model", str(model), "--port",
                                    str(port), "--", "--max-model-len", "1024", "--enforce-eager"], env=env,
                                   stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        servers.append((process, f"http://127.0.0.1:{port}", log))
    for process, _, log in servers:
        while "ready at" not in log.read_text():
            if process.poll() is not None:
                raise RuntimeError(f"posttrain serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
            time.sleep(1)
    return servers


def stop_servers(servers: list[tuple]) -> None:
    for process, _, _ in servers:
        os.killpg(process.pid, signal.SIGTERM)
    time.sleep(12)  # posttrain serve's grace period for vLLM
    for process, _, _ in servers:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> int:
    from safetensors.torch import load_file

    from posttrain.models.tiny import make_tiny_model
    from posttrain.generation.server import TOKEN_ENV, call
    from posttrain.generation.server_worker import tensor_digest
    from posttrain.demo.tasks import write_example_data
    from tests.distributed.launch import launch
    from tests.integration.helpers import run_overrides

    os.chdir(ROOT)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", arch="llama", seed=0, num_heads=2, num_kv_heads=1)
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(16)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "POSTTRAIN_SYNC_DIGESTS": "1"}
        data = write_example_data(root / "data", n_train=32, n_eval=4)
        started = time.perf_counter()
        servers = start_servers(model, root, env)
        print(f"2 servers ready in {time.perf_counter() - started:.0f} s", flush=True)
        urls = [url for _, url, _ in servers]
        try:
            for name, extra in (("full", []), ("lora", ["model.lora.enabled=true", "model.lora.r=4",
                                                        "model.lora.alpha=8"])):
                out = root / name
                started = time.perf_counter()
                result = launch(2, "grpo", run_overrides(
                    str(model), data["prompts_train"], out, "train.max_steps=3", "train.per_device_train_batch_size=4",
                    "generation.max_completion_length=8", "algo.num_generations=4",
                    "rewards=[{name: 'tests.integration.test_grpo:length_reward'}]", "generation.engine=server",
                    f"generation.servers=[{', '.join(urls)}]", "generation.sync_bucket_mb=1", *extra,
                    learning_rate="1e-2"), accelerate_config="zero3", timeout=900)
                if not result.ok:
                    print(result.output[-6000:])
                    return 1
                want = {n: tensor_digest(t) for n, t in load_file(str(out / "final" / "model.safetensors")).items()}
                held = [call(url, "/collective_rpc", {"method": "posttrain_digests"})["results"][0] == want
                        for url in urls]
                ok = ok and all(held)
                gaps = [f"{r['sampler_logprob_gap']:.1e}" for r in result.metrics()]
                print(f"{name}: {time.perf_counter() - started:.0f} s, engine {result.facts['engine']}, world size "
                      f"{result.facts['world_size']}, sampler gap per step {gaps}, servers hold final/: {held}",
                      flush=True)
        finally:
            stop_servers(servers)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
