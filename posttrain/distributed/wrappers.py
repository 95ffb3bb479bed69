"""What the engines wrap a module in, seen from outside: the module inside, and whether a layer is a sharded copy.

    inner = unwrap_module(model)          # through DDP / DeepSpeed (.module) and torch.compile (._orig_mod)
    plain_class(layer)                    # FSDP2's fully_shard gives a module a subclass of its class: the original
"""

from __future__ import annotations


def unwrap_module(model):
    """The model inside DDP / DeepSpeed (.module) and torch.compile (._orig_mod) wrappers."""
    while ((inner := getattr(model, "module", None)) is not None
           or (inner := getattr(model, "_orig_mod", None)) is not None):
        model = inner
    return model


def plain_class(module) -> type:
    """The class a module was built as: FSDP2's fully_shard swaps it for a subclass of FSDPModule."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
