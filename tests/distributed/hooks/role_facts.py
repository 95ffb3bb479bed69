"""Test hook (role_facts): how every model role of an online run is held, seen from inside every rank when the loop
has run.

Writes <POSTTRAIN_HOOK_OUT>/role_facts-rank<r>.json: for each role present (policy, critic, reference, reward_model)
  local_fraction   parameter elements this rank stores / elements of the model (about 1/world under ZeRO-3)
  trains           the Role says it trains
  optimizer        the class of its optimiser (see _optimizer): None or DeepSpeedZeRoOffload for a frozen role
  placement        the Role's placement (local / offload)
  offload_param    the DeepSpeed engine offloads its parameters to the CPU (None: not a DeepSpeed engine)
"""

import json
import os
from pathlib import Path

import posttrain.train.loop as loop
from posttrain.algorithms.base import ROLE_NAMES

_RANK = int(os.environ["RANK"])


def _local_fraction(model) -> float:
    local = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partition
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        else:
            local, total = local + p.numel(), total + p.numel()
    return local / total


def _optimizer(role):
    """The class of its optimiser: its own, else what its DeepSpeed engine holds as one (for a ZeRO-3 engine built
    without an optimiser that is DeepSpeedZeRoOffload, which only gathers and releases parameters: no state)."""
    optimizer = role.optimizer or getattr(role.model, "optimizer", None)
    return None if optimizer is None else type(getattr(optimizer, "optimizer", optimizer)).__name__


def _offload_param(model):
    config = getattr(model, "_config", None)  # a DeepSpeed engine
    if config is None:
        return None
    offload = config.zero_config.offload_param
    return str(getattr(offload.device, "value", offload.device)) if offload else "none"


_train = loop.train


def _inspect_train(ctx):
    state = _train(ctx)
    report = {}
    for name in ROLE_NAMES:
        role = getattr(ctx.models, name)
        if role is not None:
            report[name] = {"local_fraction": _local_fraction(role.model), "trains": role.trains,
                            "optimizer": _optimizer(role), "placement": role.placement,
                            "offload_param": _offload_param(role.model)}
    folder = Path(os.environ["POSTTRAIN_HOOK_OUT"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"role_facts-rank{_RANK}.json").write_text(json.dumps(report, indent=1))
    return state


loop.train = _inspect_train
