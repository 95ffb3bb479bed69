"""What a weight sync sends: the policy's full parameters as the plain transformers model names them.

    for bucket in backend.weight_buckets(policy, bucket_mb=256):   # every rank; a collective under ZeRO-3 / FSDP2
        engine.load_weights(bucket)                                  # [(name, full tensor), ...]

`sync_units` lists the tensors in a fixed order and says how each is made from the model's parameters (a LoRA layer's
weight is `W + scaling * B @ A`), `sync_buckets` groups them by size, and `Backend.weight_buckets` gathers them a
bucket at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import socket
from datetime import timedelta
from typing import Callable, Iterator

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo


@dataclasses.dataclass
class SyncUnit:
    """One tensor of a weight sync: its plain-model name, the parameters it is made of, and how."""

    name: str
    params: list
    compute: Callable[[list[torch.Tensor]], torch.Tensor]
    nbytes: int


def _full_nbytes(param) -> int:
    """ZeRO-3 keeps the full size in ds_numel (the local tensor is a shard); an FSDP2 DTensor reports its global one."""
    numel = getattr(param, "ds_numel", None)
    return int(param.numel() if numel is None else numel) * param.element_size()


def sync_units(model) -> list[SyncUnit]:
    """What a weight sync sends, in a fixed order: every parameter once (tied weights under their first name); for
    a peft LoRA model the base model's weights with `W + scaling * B @ A` folded in and the adapters left out."""
    lora = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    base = model.get_base_model() if lora else model
    adapter = model.active_adapter if lora else None  # the name of the one adapter trained
    units = [SyncUnit(name.replace(".base_layer.", "."), [param], lambda ts: ts[0], _full_nbytes(param))
             for name, param in base.named_parameters() if ".lora_" not in f".{name}"]  # a tied weight once
    by_param = {id(u.params[0]): u for u in units}
    for module in base.modules() if lora else ():
        if hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {}):
            weight = module.base_layer.weight
            a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            scale = float(module.scaling[adapter])
            if getattr(module, "fan_in_fan_out", False):
                raise NotImplementedError("weight sync of fan_in_fan_out LoRA layers (Conv1D models such as GPT-2)")
            unit = by_param[id(weight)]
            unit.params = [weight, a, b]
            unit.compute = lambda ts, scale=scale: ts[0] + scale * (ts[2].to(ts[0].dtype) @ ts[1].to(ts[0].dtype))
            unit.nbytes += _full_nbytes(a) + _full_nbytes(b)
    return units


def adapter_units(model) -> list[SyncUnit]:
    """What an adapter-only sync sends (generation.lora_sync=adapter): a peft LoRA model's lora_A / lora_B weights,
    named as peft saves them in adapter_model.safetensors (the adapter's name left out), which vLLM loads."""
    adapter = getattr(model, "active_adapter", None)
    if not hasattr(model, "peft_config") or adapter is None:
        raise TypeError(f"an adapter-only weight sync needs a peft LoRA model, got {type(model).__name__}")
    return [SyncUnit(name.replace(f".{adapter}.", "."), [param], lambda ts: ts[0], _full_nbytes(param))
            for name, param in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def sync_buckets(units: list[SyncUnit], bucket_mb: float) -> Iterator[list[SyncUnit]]:
    """`units` in order, grouped into buckets of about `bucket_mb` MiB (a unit larger than that is a bucket alone)."""
    limit = max(1, int(bucket_mb * 2**20))
    bucket: list[SyncUnit] = []
    size = 0
    for unit in units:
        if bucket and size + unit.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(unit)
        size += unit.nbytes
    if bucket:
        yield bucket


# --- to generation servers: a gloo group of trainer rank 0 (group rank 0) and every server's workers ------------------
#
#   group = open_sync_group(addr, port, rank, world_size, timeout_s)  # every member; the trainer's hosts the store
#   send_weights(group, buckets)                                       # trainer rank 0: header, then bytes, per bucket
#   for name, tensor in receive_weights(group): ...                    # each server worker, lazily (reload_weights)
#
# A bucket travels as three broadcasts from rank 0: its header's length (int64; 0 ends the sync), the header (JSON:
# name, dtype, shape, offset of each tensor) and one flat byte buffer. Gloo on CPU tensors everywhere, so any trainer
# (CPU, GPU) and any server (CPU, GPU) can meet; a GPU tensor is copied to the host once, while it is packed.

SYNC_STORE_PREFIX = "posttrain-weight-sync"
ALIGN = 16  # bytes: each tensor's offset in a bucket's buffer
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                               torch.uint8, torch.int8, torch.bool)}


def local_address_towards(host: str) -> str:
    """The address of this machine on the interface that reaches `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


class SyncStore:
    """The rendezvous store of a sync group, hosted by the trainer on `addr` only (any free port), with a random
    `key` that names every entry: a member learns it from the trainer over the token-guarded HTTP channel, so a
    process that can reach the port but does not hold the run's token finds nothing there to read or overwrite."""

    def __init__(self, addr: str, world_size: int, timeout_s: float):
        self.addr = addr
        self.key = secrets.token_hex(16)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)  # TCPStore alone listens on every interface
        self._listener.bind((addr, 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.store = TCPStore(addr, self.port, world_size, True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=self._listener.fileno())


def open_sync_group(addr: str, port: int, rank: int, world_size: int, timeout_s: float, my_addr: str,
                    store: "SyncStore | None" = None, key: str = ""):
    """Join (rank > 0) or create (rank 0, passing its `SyncStore`) a gloo process group outside the default one;
    blocks until all `world_size` members have joined or `timeout_s` has passed (RuntimeError). `my_addr`: this
    member's address as the others reach it; `key`: the store's key (SyncStore.key), sent by the trainer."""
    timeout = timedelta(seconds=timeout_s)
    base = store.store if store is not None else TCPStore(addr, port, world_size, False, timeout=timeout)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=my_addr)]
    options._timeout = timeout
    return SyncGroup(ProcessGroupGloo(PrefixStore(f"{SYNC_STORE_PREFIX}/{key}", base), rank, world_size, options), base)


@dataclasses.dataclass
class SyncGroup:
    """A sync group and the store it met through (which must live as long as the group)."""

    group: object
    store: object

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` from group rank 0 into every member's `tensor` (in place); returns it."""
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def broadcast_async(self, tensor: torch.Tensor):
        """As `broadcast`, returning at once; the returned work's `wait()` says it is done."""
        return self.group.broadcast(tensor, 0)

    def close(self) -> None:
        if hasattr(self.group, "abort"):
            self.group.abort()


def pack_bucket(bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """[(name, tensor)] -> (header, payload): the JSON header (name, dtype, shape, offset of each tensor) and every
    tensor's bytes in one flat buffer (each at an offset aligned to ALIGN bytes), both uint8 on the CPU."""
    entries, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // ALIGN) * ALIGN  # the receiver views the bytes as the dtype: aligned for any of them
        entries.append({"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
        offset += tensor.numel() * tensor.element_size()
    payload = torch.empty(offset, dtype=torch.uint8)
    for entry, (_, tensor) in zip(entries, bucket):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[entry["offset"] : entry["offset"] + flat.numel()].copy_(flat)
    return torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8), payload


def send_weights(group: SyncGroup, buckets) -> int:
    """Rank 0 of `group`: every bucket of `buckets` ([(name, tensor)] lists), then the end mark. Returns bytes sent.
    The next bucket is gathered and packed while the previous one is on the wire (two buckets in memory at most)."""
    sent, in_flight = 0, []
    for bucket in buckets:
        header, payload = pack_bucket(bucket)
        for work in in_flight:
            work.wait()
        buffers = (torch.tensor([header.numel()], dtype=torch.int64), header, payload)  # alive until sent: the loop
        in_flight = [group.broadcast_async(t) for t in buffers]  # waits on them before replacing them
        sent += payload.numel()
    for work in in_flight:
        work.wait()
    group.broadcast(torch.tensor([0], dtype=torch.int64))
    return sent


def receive_buckets(group: SyncGroup):
    """Rank > 0 of `group`: yield each bucket `send_weights` sends as [(name, tensor)], until its end mark. The
    tensors are views of the bucket's own buffer."""
    while True:
        length = int(group.broadcast(torch.zeros(1, dtype=torch.int64)))
        if length == 0:
            return
        entries = json.loads(bytes(group.broadcast(torch.empty(length, dtype=torch.uint8)).numpy()))
        end = max((e["offset"] + _nbytes(e) for e in entries), default=0)
        payload = group.broadcast(torch.empty(end, dtype=torch.uint8))
        yield [(e["name"], payload[e["offset"] : e["offset"] + _nbytes(e)].view(_DTYPES[e["dtype"]]).view(e["shape"]))
               for e in entries]


def receive_weights(group: SyncGroup):
    """Rank > 0 of `group`: yield (name, tensor) as `send_weights` sends them, until its end mark."""
    for bucket in receive_buckets(group):
        yield from bucket


def _nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * _DTYPES[entry["dtype"]].itemsize
