"""What a weight sync sends: the policy's full parameters as the plain transformers model names them.

    buckets = backend.weight_buckets(policy, bucket_mb=256)   # every rank; a collective under ZeRO-3 / FSDP2
    engine.load_weights(buckets)                              # each bucket [(name, full tensor), ...], as it comes

`sync_units` lists the tensors in a fixed order and says how each is made from the model's parameters (a LoRA layer's
weight is `W + scaling * B @ A`), `sync_buckets` groups them by size, and `Backend.weight_buckets` gathers them a
bucket at a time. To generation servers the buckets travel as they are, over a gloo group
(distributed/sync_group.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch


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


def frozen_in(units: list[SyncUnit], modules: tuple[str, ...]) -> list[SyncUnit]:
    """The units inside a module named in `modules` (a dotted part of the name) whose parameters are all frozen: a
    frozen vision tower, which never changes, so an engine that has it once need not get it again."""
    return [u for u in units if not any(p.requires_grad for p in u.params) and set(u.name.split(".")) & set(modules)]


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
