"""A gloo group between trainer rank 0 (group rank 0) and every generation server's workers, and the wire format of a
weight sync over it; it knows tensors and buckets, nothing of vLLM (generation/weight_transfer.py drives it from the
trainer, generation/vllm_weight_transfer.py from a server).

    group = open_sync_group(addr, port, rank, world_size, timeout_s)  # every member; the trainer's hosts the store
    send_weights(group, buckets)                                       # trainer rank 0: the buckets as they come
    for bucket in receive_buckets(group): ...                          # each server worker, a bucket at a time

A bucket travels as three broadcasts from rank 0: its header's length (int64; 0 ends the sync), the header (JSON:
name, dtype, shape, offset of each tensor) and one flat byte buffer. Gloo on CPU tensors everywhere, so any trainer
(CPU, GPU) and any server (CPU, GPU) can meet; a GPU tensor is copied to the host once, while it is packed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import socket
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

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


def _nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * _DTYPES[entry["dtype"]].itemsize
