"""The trainer side of a weight sync through vLLM's weight-transfer API: a client over the servers' RL routes, and
the `gloo-posttrain` trainer engine (its worker side is `posttrain.generation.vllm_weight_transfer`).

    client = ServersClient(servers, token, request_timeout_s=300, sync_timeout_s=600)
    engine = GlooTrainerEngine.trainer_init(GlooTrainerInitInfo(addr, client.world_size() + 1, 600), client=client)
    engine.source = pairs                      # [(name, full tensor)], in buckets of generation.sync_bucket_mb
    engine.send_weights()                      # start, update (the broadcast), finish: on every server at once

The four phases are vLLM's (`VLLMWeightSyncClient`, `TrainerWeightTransferEngine`), so the same calls drive a
`posttrain serve` server and a stock `vllm.entrypoints.openai.api_server` started with
`--weight-transfer-config '{"backend": "gloo-posttrain"}'` (the plugin is loaded in every vLLM process of an
environment where posttrain is installed). Torch-only and vLLM-free on this side: a trainer needs no vLLM to sync
into a server. Every HTTP call has a deadline (generation/http.py), and a miss stops the run naming the server and the
phase; the gloo group has the sync deadline too, so a server that stops in the middle of a sync is never a hang.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import ClassVar, Iterable, Optional

from posttrain.distributed.weight_sync import SyncStore, open_sync_group, send_weights
from posttrain.errors import RunStopped
from posttrain.generation.http import ServerUnavailable, call

logger = logging.getLogger(__name__)

BACKEND = "gloo-posttrain"


def any_true(answer) -> bool:
    """Whether any worker answered True to a /collective_rpc call. vLLM sends a result that is not a dict or list as
    its str(): False arrives as "False", which is truthy (every server, even one just started, read as left inside a
    weight update)."""
    results = answer.get("results") if isinstance(answer, dict) else None
    return isinstance(results, list) and any(r is True or r == "True" for r in results)


class ServersClient:
    """vLLM's `VLLMWeightSyncClient` over every server at once: each call goes to all of them in parallel and
    returns when all have answered; a failure stops the run naming the server and the phase."""

    def __init__(self, servers: list[str], token: Optional[str], request_timeout_s: float, sync_timeout_s: float,
                 name=lambda url: f"generation server {url}"):
        self.servers, self.token, self.name = list(servers), token, name
        self.timeout, self.sync_timeout = request_timeout_s, sync_timeout_s
        self.offsets: list[int] = []  # each server's first rank in the sync group (set by `world_size`)

    def world_size(self) -> int:
        """Workers over all servers (each server's tensor x pipeline parallel size); sets each one's rank offset."""
        sizes = self._all("/get_world_size?include_dp=false", None, "init", self.timeout)
        offset, self.offsets = 1, []
        for url, answer in zip(self.servers, sizes):
            size = answer.get("world_size") if isinstance(answer, dict) else None
            if type(size) is not int or not 0 < size < 2**16:
                raise RunStopped(f"{self.name(url)} gave {size!r} as its number of workers (/get_world_size)",
                                 shared=False)
            self.offsets.append(offset)
            offset += size
        return offset - 1

    def end_abandoned_updates(self) -> None:
        """Before this trainer's first sync: a server left inside a weight update by a trainer that died mid-sync
        ends it (posttrain serve's worker extension; a stock server has none and is left as it is)."""
        for url in self.servers:
            try:
                ended = call(url, "/collective_rpc", {"method": "posttrain_end_abandoned_update"},
                             timeout=self.sync_timeout, token=self.token)
            except ServerUnavailable:
                continue
            if any_true(ended):
                logger.warning("%s was still inside a weight update that an earlier trainer never finished; ended it "
                               "(this trainer's first sync replaces the weights)", self.name(url))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        bodies = [{"init_info": {**init_info, "rank_offset": offset}} for offset in self.offsets]
        self._all("/init_weight_transfer_engine", bodies, "init", self.sync_timeout)

    def start_weight_update(self) -> None:
        self._all("/start_weight_update", {}, "start", self.sync_timeout)

    def update_weights(self, update_info: dict) -> None:
        self._all("/update_weights", {"update_info": update_info}, "update", self.sync_timeout)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        self._all("/finish_weight_update", body, "finish", self.sync_timeout)

    def _all(self, path: str, body, phase: str, timeout: float) -> list:
        """`path` on every server at once (`body`: one for all, or a list with one per server); their answers."""
        bodies = body if isinstance(body, list) else [body] * len(self.servers)
        calls = [Background(call, url, path, b, timeout, self.token) for url, b in zip(self.servers, bodies)]
        answers = []
        for url, running in zip(self.servers, calls):
            try:
                answers.append(running.join())
            except ServerUnavailable as error:
                raise RunStopped(f"{self.name(url)} failed during a weight sync ({phase} phase, {path}): {error}. "
                                 "Check that it is running and was started with the weight-transfer backend "
                                 f"{BACKEND} (posttrain serve does it); checkpoints already saved are complete: "
                                 "continue with train.resume_from_checkpoint=auto", shared=False) from None
        return answers


@dataclass
class GlooTrainerInitInfo:
    """vLLM's `TrainerInitInfo` for gloo-posttrain: where this trainer hosts the group, its size, the deadline."""

    backend: ClassVar[str] = BACKEND
    addr: str
    world_size: int
    timeout_s: float = 600.0
    rank: int = 0


class GlooTrainerEngine:
    """vLLM's `TrainerWeightTransferEngine` for gloo-posttrain: trainer rank 0 hosts the sync group and broadcasts
    the buckets of `source` while the servers load them; the others only iterate `source` (their part of a
    ZeRO-3 / FSDP2 gather)."""

    def __init__(self, *, client, source=None, is_sender: bool = True, group=None):
        self.client, self.source, self.is_sender, self.group = client, source, is_sender, group

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None) -> "GlooTrainerEngine":
        """Open the group: host its store on init_info.addr, ask every server to join (all at once: the group forms
        only when every member is in), join as rank 0."""
        if init_info.rank != 0:
            return cls(client=client, source=source, is_sender=False)
        store = SyncStore(init_info.addr, init_info.world_size, init_info.timeout_s)
        worker_info = {"addr": init_info.addr, "port": store.port, "key": store.key,
                       "world_size": init_info.world_size, "timeout_s": init_info.timeout_s}
        client.end_abandoned_updates()
        joining = Background(client.init_weight_transfer_engine, worker_info)
        try:
            group = open_sync_group(init_info.addr, store.port, 0, init_info.world_size, init_info.timeout_s,
                                    init_info.addr, store=store, key=store.key)
        except RuntimeError as e:  # a server did not join within the deadline
            joining.join()  # its own error names the server, when it has one
            raise RunStopped(f"the weight-sync group did not form within {init_info.timeout_s:g} s "
                             f"({str(e).splitlines()[0]}); generation.sync_timeout_s sets it", shared=False) from None
        joining.join()
        return cls(client=client, source=source, group=group)

    def send_weights(self, update_info: Optional[dict] = None) -> int:
        """One sync, every phase on every server: start, update (the servers receive while this broadcasts), finish.
        `update_info`: the backend's (GlooUpdateInfo: an adapter's name and config). Returns the bytes sent (0 on
        the other ranks)."""
        if not self.is_sender:
            for _ in self.source:
                pass
            return 0
        self.client.start_weight_update()
        updating = Background(self.client.update_weights, update_info or {})
        try:
            sent = send_weights(self.group, self.source)
        except RuntimeError as e:  # gloo: a member left, or the deadline passed
            self.shutdown()
            updating.join()  # names the server when its HTTP call failed first
            raise RunStopped(f"the weight sync failed while sending ({str(e).splitlines()[0]}); checkpoints "
                             "already saved are complete: continue with train.resume_from_checkpoint=auto",
                             shared=False) from None
        updating.join()
        self.client.finish_weight_update()
        return sent

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def wire_buckets(named_tensors: Iterable, bucket_bytes: int):
    """(name, tensor) pairs -> lists of about `bucket_bytes` on the host, as the gloo wire sends them (a tensor
    larger than that is a bucket alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().cpu()))
        size += nbytes
    if bucket:
        yield bucket


class Background(threading.Thread):
    """Run fn(*args) in a thread; `join()` returns its result or raises its exception."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # re-raised in the caller's thread
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return self.result
