"""A `posttrain serve` child process: started on a free port, waited for, stopped with everything it started.

    server = ServerProcess()
    answer = server.launch("127.0.0.1", serve_args(recipe, 1), "out/engines/engine.log", {TOKEN_ENV: token})
    answer["url"]                        # or answer["error"], ["code"] (2: serve refused its input), ["tail"] (its log)
    server.stop()                        # SIGTERM to serve (it stops vLLM), SIGKILL to what is left

Its owners: Ray engine actors (posttrain/launch/ray_engines.py), a node's first training rank (`generation.placement:
node`, generation/vllm_node.py) and the tests' session server (tests/conftest.py). The server does not outlive its
owner: `posttrain serve` gets SIGTERM when the owner's process ends, killed or not, and vLLM when serve's ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import psutil

from posttrain.generation.adapter_sync import max_lora_rank
from posttrain.models.facts import longest_sequence
from posttrain.generation.http import TOKEN_ENV
from posttrain.generation.serve import die_with_parent, stop_group, wait_ready

LOG_DIR = "engines"  # under output_dir: the servers' output (run.check_output_dir lets it be there)
READY_TIMEOUT_S = 600.0  # model load + vLLM start-up (large models on GPUs take minutes)
# the training process's torch.distributed rendezvous: a server started by a rank is a world of its own
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_USE_AGENT_STORE")


def serve_args(recipe, tensor_parallel_size: int) -> list[str]:
    """`posttrain serve` options for the policy's starting weights and the recipe's `generation.vllm.*` (sleep mode
    and the seed are the caller's: they depend on where the server runs)."""
    model, vllm = recipe.model, recipe.generation.vllm
    args = ["--model", model.name_or_path, "--", "--tensor-parallel-size", str(tensor_parallel_size),
            "--max-model-len", str(vllm.max_model_len or longest_sequence(recipe)),
            "--gpu-memory-utilization", str(vllm.gpu_memory_utilization)]
    if vllm.dtype != "auto":  # auto: the model's dtype on a GPU, float32 on a CPU (posttrain serve's default)
        args += ["--dtype", vllm.dtype]
    if vllm.enforce_eager:
        args.append("--enforce-eager")
    if vllm.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if vllm.enable_prefix_caching else "--no-enable-prefix-caching")
    if model.revision:
        args += ["--revision", model.revision]
    if model.tokenizer_name_or_path:
        args += ["--tokenizer", model.tokenizer_name_or_path]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    if recipe.generation.lora_sync == "adapter":  # the server serves the adapter each sync sends
        args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(model.lora.r))]
    return args


def server_env(recipe, token: str) -> dict[str, str]:
    """Variables a server gets on top of its owner's: the token, the CPU KV cache size, the driver's VLLM_*."""
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    env[TOKEN_ENV] = token
    if recipe.generation.vllm.kv_cache_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(recipe.generation.vllm.kv_cache_gb)
    return env


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """One `posttrain serve` child of this process."""

    process: Optional[subprocess.Popen] = None
    vllm_group: Optional[int] = None  # `posttrain serve` starts vLLM in a process group of its own
    log: Optional[Path] = None

    def launch(self, host: str, args: list[str], log: str, env: dict[str, str]) -> dict:
        """Start the server with `args` (serve_args) on `host` and a free port, its output in `log`, and wait until
        it answers. Returns {"url": ...}, or {"error": ..., "code": its exit code (None: still running when given
        up), "tail": the end of its log}."""
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "posttrain", "serve", "--host", host, "--port", str(port), *args]
        inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        with self.log.open("a") as out:
            self.process = subprocess.Popen(command, env={**inherited, **env}, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=die_with_parent())
        url = f"http://{host}:{port}"
        if not wait_ready(self.process, url, READY_TIMEOUT_S):
            code = self.process.poll()
            cause = (f"the server exited with code {code} while starting" if code is not None else
                     f"the server did not answer at {url} within {READY_TIMEOUT_S:.0f} s")
            self.stop()
            return {"error": cause, "code": code, "tail": log_tail(self.log)}
        self.vllm_group = next((child.pid for child in psutil.Process(self.process.pid).children()), None)
        return {"url": url}

    def stop(self) -> str:
        """Stop the server: SIGTERM (it then stops vLLM), SIGKILL to what is left after a grace period. Returns how
        it had ended before this call ("" while it was still running, or never started)."""
        if self.process is None:
            return ""
        code = self.process.poll()
        stop_group(self.process)
        try:  # a no-op after a clean stop; vLLM's processes when the server itself was killed
            os.killpg(self.vllm_group, signal.SIGKILL)
        except (ProcessLookupError, TypeError):  # gone already, or never known
            pass
        self.process = None
        return "" if code is None else f"its server exited with code {code}"
