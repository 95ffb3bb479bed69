"""posttrain's gloo transport as a vLLM weight-transfer backend, `gloo-posttrain` (the worker side; imports vLLM).

    pip install posttrain[vllm]      # declares the plugin, which every vLLM process loads (entry point group
                                     # vllm.general_plugins: posttrain.generation.vllm_weight_transfer:register)
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \
        --weight-transfer-config '{"backend": "gloo-posttrain"}' --enable-scale-out --logprobs-mode processed_logprobs

vLLM 0.32's weight-transfer API runs every sync as four phases driven over HTTP; a backend says how the bytes travel.
vLLM ships `nccl` (GPU to GPU) and `ipc` (same GPU); this one is gloo over TCP, so a CPU server (CI, a laptop) and
any trainer run the same four phases a GPU pair runs with `nccl`:
- init: each worker joins the trainer's gloo group (`posttrain.distributed.weight_sync`) as rank_offset + its rank;
- start: vLLM's layerwise reload begins (each layer is reprocessed, oneDNN repacking on a CPU, once all of its
  tensors have arrived, so no layer ever runs half new, half old);
- update: the broadcast buckets go into `model.load_weights` as they arrive, the next received while one is loaded;
- finish: the layerwise reload ends; a tied lm_head is reprocessed from the new embedding.
An adapter-only sync (generation.lora_sync=adapter) names the adapter in its update info: its tensors are written to
this machine's adapter directory (`posttrain.generation.adapter_sync`), where the LoRA resolver registered here finds
them. With POSTTRAIN_SYNC_DIGESTS=1 each worker keeps a SHA-256 per received tensor (`digests`; tests).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver

from posttrain.distributed.sync_group import local_address_towards, open_sync_group, receive_buckets
from posttrain.generation.adapter_sync import adapter_root, parse_name, write_adapter
from posttrain.generation.server_worker import prefetched, repack_tied_lm_head, tensor_digest
from posttrain.generation.weight_transfer import BACKEND


def register() -> None:
    """The vLLM plugin (group vllm.general_plugins): `gloo-posttrain` in both of vLLM's weight-transfer registries,
    and the resolver of posttrain's adapters. vLLM may call it more than once per process; registering twice would
    raise, so it checks first."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.lora.resolver import LoRAResolverRegistry

    if RESOLVER not in LoRAResolverRegistry.get_supported_resolvers():
        LoRAResolverRegistry.register_resolver(RESOLVER, AdapterResolver())

    trainer_module = "posttrain.generation.weight_transfer"
    for factory, module, cls in ((WeightTransferEngineFactory, __name__, "GlooWeightTransferEngine"),
                                 (WeightTransferTrainerFactory, trainer_module, "GlooTrainerEngine")):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, module, cls)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's sync group meets (sent by the trainer at /init_weight_transfer_engine)."""

    addr: str
    port: int
    key: str
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """Names, dtypes and shapes travel in each bucket's header; an adapter-only sync names the adapter here."""

    adapter_name: str = ""
    """lora_sync=adapter: the name the adapter is served under ("": the tensors are the model's own weights)."""
    adapter_config: Optional[dict] = None
    """lora_sync=adapter: its adapter_config.json."""


RESOLVER = "posttrain-adapters"


class AdapterResolver(LoRAResolver):
    """Finds a posttrain adapter by name in this machine's adapter directory (written by the workers at a sync)."""

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> Optional[LoRARequest]:
        try:
            parse_name(lora_name)
        except ValueError:
            return None
        path = adapter_root() / lora_name
        if not (path / "adapter_config.json").is_file():
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(path),  # the id is vLLM's to set
                           base_model_name=base_model_name)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker side of `gloo-posttrain` (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.digests: dict[str, str] = {}  # SHA-256 per tensor of the last sync (POSTTRAIN_SYNC_DIGESTS=1)
        self.seconds = {"receive_s": 0.0, "total_s": 0.0}  # of the last sync: waiting for bytes, start to finish
        self._started = 0.0
        self._reloading = False  # vLLM's layerwise reload began (the first bucket of a full-weight sync)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_sync_group(init_info.addr, init_info.port, rank, init_info.world_size, init_info.timeout_s,
                                     local_address_towards(init_info.addr), key=init_info.key)

    def start_weight_update(self) -> None:
        self._started = time.perf_counter()
        self.digests, self.seconds = {}, {"receive_s": 0.0, "total_s": 0.0}
        self._reloading = False  # begun at the first update that carries the model's weights (not an adapter)

    def update_weights(self, update_info: dict) -> None:
        """As vLLM's, without its `torch.accelerator.synchronize()`, which fails on a machine with no accelerator."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo-posttrain: /update_weights before /init_weight_transfer_engine")
        keep_digests = os.environ.get("POSTTRAIN_SYNC_DIGESTS") == "1"
        adapter: dict[str, torch.Tensor] = {}
        if not update_info.adapter_name and not self._reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._reloading = True
        buckets = prefetched(receive_buckets(self.group))  # the next bucket arrives while this one loads
        while True:
            waited = time.perf_counter()
            bucket = next(buckets, None)
            self.seconds["receive_s"] += time.perf_counter() - waited
            if bucket is None:
                break
            if keep_digests:
                self.digests.update((name, tensor_digest(tensor)) for name, tensor in bucket)
            if update_info.adapter_name:
                adapter.update((name, tensor.clone()) for name, tensor in bucket)
            else:
                self.model.load_weights([(name, tensor.to(self.device)) for name, tensor in bucket])
        if update_info.adapter_name:
            write_adapter(adapter_root(), update_info.adapter_name, adapter, update_info.adapter_config or {})

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:  # an adapter-only sync left the model as it was
            finalize_layerwise_reload(self.model, self.model_config)
            repack_tied_lm_head(self.model)
            self._reloading = False
        self.seconds["total_s"] = time.perf_counter() - self._started

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class WeightSyncExtension:
    """Methods added to vLLM's worker, called through /collective_rpc (JSON in and out): what vLLM's weight-transfer
    API has no route for (the vocabulary the start-up checks compare, the last sync's digests and seconds, the raw
    broadcast of bench/weight_sync.py)."""

    def posttrain_describe(self) -> dict:
        """What the trainer checks before it starts: vocabulary size, and this worker's rank among the server's."""
        config = self.model_runner.model_config.hf_text_config
        return {"vocab_size": int(config.vocab_size), "rank": int(self.rank),
                "world_size": int(self.parallel_config.world_size)}

    def posttrain_end_abandoned_update(self) -> bool:
        """End a weight update its trainer never finished (killed, or cut off, between /start_weight_update and
        /finish_weight_update): vLLM refuses every later start until it ends, so the next trainer ends it before
        its first sync, which then replaces whatever half of the weights arrived. True when there was one."""
        if not getattr(self, "_weight_update_active", False):
            return False
        try:
            self.weight_transfer_engine.finish_weight_update()
        finally:
            self._weight_update_active = False
            self.weight_transfer_engine.reset_weight_update_target()
        return True

    def posttrain_digests(self) -> dict:
        """SHA-256 per tensor of the last sync this worker received (empty before the first; POSTTRAIN_SYNC_DIGESTS=1
        in the server's environment)."""
        return dict(getattr(self.weight_transfer_engine, "digests", {}))

    def posttrain_sync_seconds(self) -> dict:
        """Of the last sync: seconds the loader waited for bytes (receive_s) and start to finish (total_s)."""
        return dict(getattr(self.weight_transfer_engine, "seconds", {}))

    def posttrain_broadcast_only(self, sizes: str) -> None:
        """bench/weight_sync.py's baseline: take part in plain broadcasts of these byte counts in the transfer group
        and drop the bytes."""
        for size in json.loads(sizes):
            self.weight_transfer_engine.group.broadcast(torch.empty(size, dtype=torch.uint8))


register()  # importing the module (posttrain serve's --worker-extension-cls) registers the backend in the worker, so
# a posttrain serve server has it even where posttrain's plugin entry point is not installed
