"""Sequence log-probs of preference pairs, shared by the DPO family and the held-out accuracy; the reference's side.

A preference micro-batch holds 2P rows: P chosen sequences (prompt + chosen) then their P rejected partners (see
posttrain.batch). Both halves go through the model in ONE forward; the per-token log-probs come from
`ops.logprobs.token_logprobs`, which never builds a (B, T, V) float32 log-softmax (chunked, with a recomputing
backward), and are summed over each row's completion tokens:

    sums_B, counts_B = sequence_logps(model, batch)             # [2P] sums of log p over completion tokens, [2P] counts
    chosen_P, rejected_P = split_pairs(sums_B, batch.num_pairs)

The reference's sums come from one of three places (`reference_sums`): a frozen copy (models.reference), the policy
with its LoRA adapter switched off (no second copy), or a table computed once before training
(`compute_reference_table`, cached in the run directory as ref_logprobs.safetensors, keyed by example index).
Sums are stored, never means: a length-normalised loss divides by the same token counts the policy side uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from posttrain.models.forward import policy_logprobs
from posttrain.models.load import disable_adapter
from posttrain.ops.logprobs import sequence_sum
from posttrain.batch import Batch
from posttrain.data.collate import eval_batches

CACHE_FILE = "ref_logprobs.safetensors"


def split_pairs(x_B: torch.Tensor, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [0, P) and [P, 2P) of a preference batch -> (chosen_P, rejected_P)."""
    return x_B[:num_pairs], x_B[num_pairs : 2 * num_pairs]


def sequence_logps(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over all 2P rows -> (sum of completion-token log-probs per row, completion tokens per row)."""
    mask_BT = batch.completion_mask_BT
    logprobs_BT = policy_logprobs(model, batch, mask_BT=mask_BT)  # the prompts' rows skip the output layer
    return sequence_sum(logprobs_BT, mask_BT), mask_BT.sum(-1)


def reduce_logps(sums_B: torch.Tensor, counts_B: torch.Tensor, length_normalised: bool) -> torch.Tensor:
    """Sequence log-probs as a loss wants them: sums, or means over completion tokens (SimPO, IPO)."""
    return sums_B / counts_B.clamp(min=1) if length_normalised else sums_B


def reference_sums(models, batch: Batch, use_adapter_off: bool, autocast=None) -> torch.Tensor:
    """The reference's per-row log-prob sums for `batch` (no gradient): the policy with its LoRA adapter switched off
    when `use_adapter_off`, else the frozen copy `models.reference`."""
    context = autocast() if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), context:
        if use_adapter_off:
            with disable_adapter(models.policy.model):
                sums_B, _ = sequence_logps(models.policy.model, batch)
        else:
            if models.reference is None:
                raise RuntimeError("this loss needs reference log-probs; there is no reference model (nor a cache)")
            sums_B = sequence_sum(models.reference.logprobs(batch), batch.completion_mask_BT)
    return sums_B.detach().float()


# --- the precomputed table ------------------------------------------------------------------------------------------


def examples_fingerprint(examples: Sequence[dict]) -> str:
    """A hash of the tokenised pairs: a cached table is reused only for exactly the same examples in the same order."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]]).encode())
    return h.hexdigest()


def compute_reference_table(backend, models, examples: Sequence[dict], collate, batch_size: int,
                            use_adapter_off: bool) -> torch.Tensor:
    """Reference log-prob sums for every example -> table_N2 (column 0 chosen, 1 rejected), the same on every rank.

    Each rank scores its slice of every chunk of batch_size x world examples; every rank runs the same number of
    forwards (a rank with nothing left scores a filler batch it throws away), so the collective forwards of a ZeRO-3
    sharded model stay in step. One all-reduce assembles the table.
    """
    table_N2 = torch.zeros(len(examples), 2, dtype=torch.float32, device=backend.device)
    for batch, weight in eval_batches(examples, collate, batch_size, backend.world_size, backend.rank):
        batch = batch.to(backend.device)
        sums_B = reference_sums(models, batch, use_adapter_off, backend.autocast)
        if weight > 0:
            chosen_P, rejected_P = split_pairs(sums_B, batch.num_pairs)
            table_N2[batch.example_index_B] = torch.stack([chosen_P, rejected_P], dim=-1).to(table_N2.device)
    return backend.all_reduce_sum(table_N2).cpu()


def lookup(table_N2: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The cached sums of a batch's pairs, in batch row order (chosen rows then rejected rows) -> sums_B."""
    if batch.example_index_B is None:
        raise RuntimeError("precomputed reference log-probs need batches that carry example_index_B")
    rows_P2 = table_N2.to(batch.input_ids_BT.device)[batch.example_index_B.to(batch.input_ids_BT.device)]
    return torch.cat([rows_P2[:, 0], rows_P2[:, 1]])


def cache_identity(recipe, splits: dict[str, Sequence[dict]]) -> dict[str, str]:
    """What must match for a cached table to be reused (on resume): the model, its precision, the examples."""
    m = recipe.model
    return {"model": f"{m.name_or_path}@{m.revision}", "dtype": m.dtype, "attn_implementation": m.attn_implementation,
            "mixed_precision": recipe.train.mixed_precision, "lora": str(m.lora.enabled),
            **{f"examples/{name}": examples_fingerprint(ex) for name, ex in splits.items()}}


def load_cached_tables(path: Path, identity: dict[str, str]) -> Optional[dict[str, torch.Tensor]]:
    """The tables in `path` when it exists and was computed for the same identity; else None."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}) != identity:
                return None
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception:  # a torn or foreign file: recompute
        return None


def save_tables(path: Path, tables: dict[str, torch.Tensor], identity: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tables.items()}, str(tmp), metadata=identity)
    tmp.replace(path)
