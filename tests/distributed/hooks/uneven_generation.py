"""Test hook (uneven_generation): rank 0 stops every generation after one token, the other ranks go to the recipe's
max_completion_length, as when one rank's completions all end early.

Writes <POSTTRAIN_HOOK_OUT>/uneven_generation-rank<r>.json:
  longest        the longest completion this rank generated
  gathers        FSDP2 parameter all-gathers (dist.all_gather_single) inside each generate call, in order
  fsdp_modules   how many FSDP2-sharded modules the generating model has
"""

import dataclasses
import json
import os
from pathlib import Path

import torch.distributed as dist

import posttrain.generation.hf as hf

_RANK = int(os.environ["RANK"])
_report = {"longest": 0, "gathers": [], "fsdp_modules": 0}
_inside = [False]


_all_gather_single = dist.all_gather_single


def _counted_all_gather_single(*args, **kwargs):
    if _inside[0]:
        _report["gathers"][-1] += 1
    return _all_gather_single(*args, **kwargs)


dist.all_gather_single = _counted_all_gather_single

_generate = hf.HFEngine.generate


def _uneven(self, prompt_ids, params):
    if _RANK == 0:
        params = dataclasses.replace(params, max_new_tokens=1)
    from torch.distributed.fsdp import FSDPModule

    _report["fsdp_modules"] = sum(isinstance(m, FSDPModule) for m in self.model.modules())
    _report["gathers"].append(0)
    _inside[0] = True
    try:
        out = _generate(self, prompt_ids, params)
    finally:
        _inside[0] = False
    _report["longest"] = max([_report["longest"]] + [len(c) for c in out.completion_ids])
    folder = Path(os.environ["POSTTRAIN_HOOK_OUT"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"uneven_generation-rank{_RANK}.json").write_text(json.dumps(_report))
    return out


hf.HFEngine.generate = _uneven
