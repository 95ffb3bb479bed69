"""Test hook (sp_facts): what DeepSpeed's Ulysses attention saw on this rank, so a sequence-parallel test can tell a
sharded run from one where every rank quietly ran whole rows (which would give the same update).

Writes <POSTTRAIN_HOOK_OUT>/sp_facts-rank<r>.json when the run ends (Backend.end): calls (Ulysses forwards), local_lengths and
global_lengths (the shard length each call got and the row length after the exchange, distinct values), odd_rows
(sharded forwards whose rows had an odd length, so were padded).
"""

import json
import os
from pathlib import Path

from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

from posttrain.distributed.backend import Backend
from posttrain.distributed.sequence_parallel import SequenceParallel

_report = {"calls": 0, "local_lengths": [], "global_lengths": [], "odd_rows": 0}
_forward = UlyssesSPAttentionHF.forward
_shard_inputs = SequenceParallel.shard_inputs


def _seen(self, input_ids_BT):
    _report["odd_rows"] += input_ids_BT.shape[1] % 2
    return _shard_inputs(self, input_ids_BT)


def _counted(self, module, query, *args, **kwargs):
    out = _forward(self, module, query, *args, **kwargs)
    _report["calls"] += 1
    for key, value in (("local_lengths", self.local_seq_length), ("global_lengths", self.global_seq_length)):
        if value not in _report[key]:
            _report[key].append(value)
    return out


_end = Backend.end


def _write_then_end(self) -> None:
    folder = Path(os.environ["POSTTRAIN_HOOK_OUT"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"sp_facts-rank{os.environ['RANK']}.json").write_text(json.dumps(_report))
    _end(self)


UlyssesSPAttentionHF.forward = _counted
SequenceParallel.shard_inputs = _seen
Backend.end = _write_then_end
