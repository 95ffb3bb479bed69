"""Launch posttrain on several local processes for tests: 2 CPU processes over gloo, quick and isolated.

    from tests.distributed.launch import ENGINES, launch

    r = launch(2, "sft", overrides)                                   # torchrun --nproc_per_node 2 -m posttrain sft ...
    r = launch(2, "sft", overrides, accelerate_config="zero3")        # accelerate launch --config_file
                                                                      #   recipes/accelerate/zero3.yaml --num_processes 2 ...
    r = launch(2, "sft", overrides, nnodes=2)                         # 2 torchrun agents ("nodes") x 1 process, 127.0.0.1
    r = launch(1, "sft", overrides)                                   # a plain `python -m posttrain sft ...`
    r = launch(2, "sft", overrides, hooks=["engine_facts"])           # test-only monkeypatches in every worker (below)

    r = launch(2, "sft", overrides, **ENGINES["zero2"])               # the engines tested for every algorithm

    assert r.returncode == 0, r.output                                # r.output: stdout + stderr of every process
    r.check_world(2)                                                  # the start line AND trainer_state.json agree
    r.facts["engine"], r.losses(), r.final_weights(), r.metrics()

`overrides` are the usual `key.sub=value` strings and must include output_dir=...; `r.output_dir` is read from
them. `accelerate_config` is a file name under recipes/accelerate/ (without .yaml) or any path, e.g. a TRL config.
`env` adds environment variables (e.g. ACCELERATE_USE_DEEPSPEED=true for torchrun). Every process gets
OMP_NUM_THREADS=1, offline Hugging Face, a free rendezvous port, and TORCH_EXTENSIONS_DIR (DeepSpeed's JIT-built
CPU ops are compiled once, tens of seconds each, then reused). Why assert the world size: a launch that quietly
starts ONE process (as `accelerate launch --cpu --num_processes 2` does; posttrain now refuses that one) would
pass any equivalence test, so a distributed test that does not check proves nothing.

Hooks: `hooks=["name"]` imports tests/distributed/hooks/name.py in every worker (through hooks/site/sitecustomize.py on
PYTHONPATH), so a test can inject a failure or inspect the engine's parameters without any test switch in product
code. Write a hook's findings under the run's output_dir and read them back in the test (see hooks/engine_facts.py).
Hooks load in launched workers only (they have a RANK), not in a plain `launch(1, ...)` process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from tests.integration.helpers import final_weights, metrics, step_losses

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = ROOT / "recipes" / "accelerate"
HOOKS_DIR = Path(__file__).resolve().parent / "hooks"
EXTENSIONS_DIR = Path.home() / ".cache" / "posttrain" / "torch_extensions"
# variables a launcher sets for its workers: a test run inside another launched process must not inherit them
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


# The engines every algorithm is tested under: how to launch each (`launch(2, cmd, overrides, **ENGINES[name])`)
# and the engine name rank 0's start line then shows. DDP goes through plain torchrun, the others through
# `accelerate launch` with the shipped configs, so both documented launch paths and every config file are exercised.
ENGINES: dict[str, dict] = {
    "ddp": {},
    "zero2": {"accelerate_config": "zero2"},
    "zero3": {"accelerate_config": "zero3"},
    "fsdp2": {"accelerate_config": "fsdp2"},
}
ENGINE_NAMES = {"ddp": "ddp", "zero2": "deepspeed-zero2", "zero3": "deepspeed-zero3", "fsdp2": "fsdp2"}
SHARDED_PARAMETERS = ("zero3", "fsdp2")  # each rank stores about 1/world of the parameters


@dataclass
class Result:
    returncode: int
    output: str
    output_dir: Path
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def facts(self) -> dict[str, str]:
        """The `k=v` facts of rank 0's start line: world_size, nodes, engine, offload, precision, global_batch..."""
        for line in self.output.splitlines():
            if "posttrain command=" in line:
                line = line[line.index("posttrain command="):].removeprefix("posttrain ")
                return dict(part.split("=", 1) for part in line.split(" | ") if "=" in part)
        raise AssertionError(f"no start line in the output:\n{self.output[-4000:]}")

    def trainer_state(self, step: Optional[int] = None) -> dict:
        checkpoints = sorted((self.output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
        path = checkpoints[-1] if step is None else self.output_dir / "checkpoints" / f"step-{step}"
        return json.loads((path / "trainer_state.json").read_text())

    def check_world(self, world_size: int, nodes: int = 1) -> None:
        """The run really had `world_size` processes on `nodes` nodes (start line and checkpoint agree)."""
        assert self.ok, self.output[-6000:]
        assert self.facts["world_size"] == str(world_size), self.facts
        assert self.facts["nodes"] == str(nodes), self.facts
        if any((self.output_dir / "checkpoints").glob("step-*")):  # save_steps 0 writes none (final/ alone)
            assert self.trainer_state()["run"]["world_size"] == world_size

    def metrics(self) -> list[dict]:
        return metrics(self.output_dir)

    def losses(self) -> dict[int, float]:
        return step_losses(self.output_dir)

    def final_weights(self) -> dict[str, torch.Tensor]:
        return final_weights(self.output_dir)

    def copy_at(self, step: int, into: Path) -> Path:
        """A copy of this run's directory as it was when checkpoint `step` was its newest (to test resuming)."""
        later = [p.name for p in (self.output_dir / "checkpoints").glob("step-*") if int(p.name[5:]) > step]
        shutil.copytree(self.output_dir, into, ignore=lambda d, names: [
            n for n in names if (Path(d) == self.output_dir and n in ("final", "hooks")) or n in later])
        return into

    def hook_report(self, name: str) -> list[dict]:
        """What hook `name` wrote, one dict per rank (files <output_dir>/hooks/<name>-rank<r>.json)."""
        files = sorted((self.output_dir / "hooks").glob(f"{name}-rank*.json"))
        return [json.loads(f.read_text()) for f in files]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(hooks: Sequence[str] = (), env: Optional[dict[str, str]] = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PET_")) and k not in LAUNCHER_VARIABLES}
    out.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    out.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    paths = [str(ROOT)] + ([str(HOOKS_DIR / "site")] if hooks else []) + [p for p in [out.get("PYTHONPATH")] if p]
    out["PYTHONPATH"] = os.pathsep.join(paths)
    if hooks:
        out["POSTTRAIN_TEST_HOOKS"] = ",".join(hooks)
    out.update(env or {})
    return out


def _config_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix in (".yaml", ".yml") and path.exists() else ACCELERATE_CONFIGS / f"{name}.yaml"


def commands(n_procs: int, command: str, overrides: Sequence[str], accelerate_config: Optional[str], nnodes: int,
             config: Optional[str]) -> list[list[str]]:
    """One argv per launcher process to start (several for a multi-node run)."""
    program = ["-m", "posttrain", command] + (["--config", config] if config else []) + list(overrides)
    port = str(free_port())
    if accelerate_config is not None:
        return [[sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                 str(_config_path(accelerate_config)), "--num_processes", str(n_procs), "--num_machines", "1",
                 "--main_process_port", port] + program]
    if n_procs == 1 and nnodes == 1:
        return [[sys.executable] + program]
    if n_procs % nnodes:
        raise ValueError(f"{n_procs} processes do not split over {nnodes} nodes")
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node),
             "--nproc_per_node", str(n_procs // nnodes), "--master_addr", "127.0.0.1", "--master_port", port]
            + program for node in range(nnodes)]


def launch(
    n_procs: int,
    command: str,
    overrides: Sequence[str],
    accelerate_config: Optional[str] = None,
    nnodes: int = 1,
    env: Optional[dict[str, str]] = None,
    hooks: Sequence[str] = (),
    config: Optional[str] = None,
    timeout: float = 420,
) -> Result:
    """Start the run, wait for every process (killing them all after `timeout` s), return what happened."""
    out_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")), None)
    if out_dir is None:
        raise ValueError("overrides must set output_dir=...")
    started = time.perf_counter()
    argvs = commands(n_procs, command, overrides, accelerate_config, nnodes, config)
    logs = [tempfile.TemporaryFile(mode="w+") for _ in argvs]  # files, not pipes: a full pipe would stall a rank
    procs = [subprocess.Popen(argv, cwd=ROOT, env=worker_env(hooks, env), stdout=log, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for argv, log in zip(argvs, logs)]
    killed = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, started + timeout - time.perf_counter()))
        except subprocess.TimeoutExpired:
            killed = True
            for p in procs:  # each launcher leads its own session: its workers go with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if killed:
        texts.append(f"[launch] killed after {timeout:.0f} s")
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return Result(code, "\n".join(texts), Path(out_dir), time.perf_counter() - started)
