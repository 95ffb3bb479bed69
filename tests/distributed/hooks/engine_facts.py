"""Test hook (engine_facts): what the engine really did with the parameters, seen from inside every rank.

Writes <output_dir>/hooks/engine_facts-rank<r>.json with
  created_partitioned   right after the policy is made (before prepare): every parameter is already a ZeRO-3
                        partition (zero.Init at from_pretrained), i.e. no rank ever held the whole model
  local_fraction        after prepare: parameter elements this rank stores / elements of the model
                        (1.0 replicated: DDP, ZeRO-1/2; about 1/world sharded: ZeRO-3, FSDP2)
  z3_leaf_modules       after prepare: classes of the modules ZeRO-3 gathers as one unit (MoE blocks)
  checksums             at export: a checksum of the full (gathered) parameters from every rank, all equal when the
                        replicas agree
  exported_max_diff     at export: max |final/*.safetensors - gathered parameter| over all tensors
  exported_missing      parameters absent from final/
  exported_bytes, parameter_bytes   size of the exported tensors and of the model's parameters
  sync_buckets          at export: how many buckets a weight sync (Backend.weight_buckets, 0.05 MiB each) made
  sync_missing, sync_extra          tensors of final/ the sync did not send, and tensors it sent that final/ lacks
  sync_max_diff         max |final/*.safetensors - synced tensor| over all tensors
"""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

import posttrain.run as run_module
from posttrain.distributed.backend import Backend

_RANK = int(os.environ["RANK"])
_report: dict = {}


def _write(output_dir) -> None:
    folder = Path(output_dir) / "hooks"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"engine_facts-rank{_RANK}.json").write_text(json.dumps(_report, indent=1))


_load_policy = run_module.load_policy


def _inspect_load_policy(recipe, algorithm):
    model = _load_policy(recipe, algorithm)
    _report["created_partitioned"] = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    return model


_prepare = Backend.prepare


def _inspect_prepare(self, model, optimizer, **kwargs):
    model, optimizer = _prepare(self, model, optimizer, **kwargs)
    _report["z3_leaf_modules"] = sorted({type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)})
    local = total = 0
    for p in self.unwrap(model).parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partition
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        elif hasattr(p, "to_local"):  # FSDP2 DTensor shard
            local, total = local + p.to_local().numel(), total + p.numel()
        else:
            local, total = local + p.numel(), total + p.numel()
    _report["local_fraction"] = local / total
    return model, optimizer


_export_final = run_module.export_final


def _inspect_export_final(backend, model, tokenizer, output_dir, *args, **kwargs):
    final = _export_final(backend, model, tokenizer, output_dir, *args, **kwargs)  # ends with a barrier
    exported = {}
    for f in sorted((Path(output_dir) / "final").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    full = {}
    with backend.gathered_parameters(model):  # ZeRO-3: whole parameters for the duration
        for name, p in backend.unwrap(model).named_parameters():
            full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p.data).detach().to("cpu", torch.float32).clone()
    checksum = sum(float((t.double() * (i + 1)).sum()) for i, t in enumerate(full.values()))
    _report["checksums"] = backend.all_gather_object(checksum)
    _report["exported_missing"] = sorted(set(full) - set(exported))
    _report["exported_max_diff"] = max(
        (float((exported[k].float() - t).abs().max()) for k, t in full.items() if k in exported), default=float("nan")
    )
    _report["exported_bytes"] = sum(t.numel() * t.element_size() for t in exported.values())
    _report["parameter_bytes"] = sum(t.numel() * 4 for t in full.values())
    synced, buckets = {}, 0
    for bucket in backend.weight_buckets(model, bucket_mb=0.05):  # what an engine would be sent, every rank
        buckets += 1
        synced.update((name, t.detach().to("cpu", torch.float32).clone()) for name, t in bucket)
    _report["sync_buckets"] = buckets
    _report["sync_missing"] = sorted(set(exported) - set(synced))
    _report["sync_extra"] = sorted(set(synced) - set(exported))
    _report["sync_max_diff"] = max(
        (float((exported[k].float() - t).abs().max()) for k, t in synced.items() if k in exported), default=float("nan")
    )
    _write(output_dir)
    return final


run_module.load_policy = _inspect_load_policy
run_module.export_final = _inspect_export_final
Backend.prepare = _inspect_prepare
