"""What a weight sync sends: the policy's full parameters as the plain transformers model names them.

    for bucket in backend.weight_buckets(policy, bucket_mb=256):   # every rank; a collective under ZeRO-3 / FSDP2
        engine.load_weights(bucket)                                  # [(name, full tensor), ...]

`sync_units` lists the tensors in a fixed order and says how each is made from the model's parameters (a LoRA layer's
weight is `W + scaling * B @ A`); `Backend.weight_buckets` gathers them a bucket at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class SyncUnit:
    """One tensor of a weight sync: its plain-model name, the parameters it is made of, and how."""

    name: str
    params: list
    compute: Callable[[list[torch.Tensor]], torch.Tensor]
    nbytes: int


def _full_nbytes(param) -> int:
    numel = getattr(param, "ds_numel", None)  # ZeRO-3 keeps the full size here; the local tensor is a shard
    if numel is None:
        numel = param.numel()  # an FSDP2 DTensor reports its global size
    return int(numel) * param.element_size()


def sync_units(model) -> list[SyncUnit]:
    """What a weight sync sends, in a fixed order: every parameter once (tied weights under their first name); for
    a peft LoRA model the base model's weights with `W + scaling * B @ A` folded in and the adapters left out."""
    lora = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    base = model.get_base_model() if lora else model
    adapter = model.active_adapter if lora else None  # the name of the one adapter trained
    units, seen = [], set()
    for module_name, module in base.named_modules():
        for leaf, param in module.named_parameters(prefix=module_name, recurse=False):
            if id(param) in seen or ".lora_" in f".{leaf}":
                continue
            seen.add(id(param))
            name = leaf.replace(".base_layer.", ".")
            units.append(SyncUnit(name, [param], lambda ts: ts[0], _full_nbytes(param)))
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


