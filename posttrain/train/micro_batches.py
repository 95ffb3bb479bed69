"""Loop phase 1's shaping of a rank's micro-batches: padding-free forwards (`data.packing`) and micro-batches bounded
by tokens (`train.max_tokens_per_microbatch`), for every algorithm and every source.

    micro_batches = shape(source.step_batches(step), recipe, pad_id, agree)

With a budget, the rank's rows are regrouped: its micro-batches are cut into units (a row; a preference pair, whose
chosen and rejected rows the loss needs together), the units are spread over the fewest micro-batches of at most
`budget` real tokens that every rank can agree on (data/token_budget.py), and each micro-batch is trimmed to its own
longest row. A rank that needs fewer micro-batches than another runs fillers (`Batch.filler`: a copy of one unit that
weighs 0), so ZeRO-3 and FSDP, whose forwards are collectives, stay in step. GRPO groups need not stay together:
their advantages are attached per row before the split; but with shared prefixes (train.shared_prefix) a prompt's
rows are one unit (as many of them as the budget holds), counted by the tokens their forward computes, the prompt
once, so the budget holds the rows it really has room for. The update does not change with the split because the loop
counts the normaliser over all micro-batches of the step afterwards, once (train/loop.py, phase 3).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from posttrain.batch import Batch, share_prefixes
from posttrain.data.token_budget import fewest_micro_batches, micro_batches_within_budget
from posttrain.errors import UserError
from posttrain.ops.shared_prefix import prefix_groups


def shape(batches: Sequence[Batch], recipe, pad_id: int, agree: Callable[[int], int],
          shared_prefix: bool = False) -> list[Batch]:
    """This rank's micro-batches as the recipe asks: padding-free (data.packing), within the token budget, and with
    their shared prefixes found (`shared_prefix`: train.shared_prefix as run.py resolved it; found again after the
    budget regroups rows). `agree(count)` returns the largest count any rank asks for (a collective: every rank
    calls it once a step)."""
    budget = recipe.train.max_tokens_per_microbatch
    padded = [b for b in batches if b.attention_mask_BT is not None]
    if budget is not None and len(padded) == len(batches):
        units = [unit for batch in batches for unit in split_units(batch)]
        if shared_prefix:  # a prompt's rows go together, so the micro-batch computes the prompt once
            units = prompt_units(units, budget, pad_id)
        tokens = [unit_tokens(unit, shared_prefix) for unit in units]
        count = agree(fewest_micro_batches(tokens, budget))
        parts = micro_batches_within_budget(tokens, budget, count)
        batches = [concat([units[i] for i in part], pad_id) if part else
                   dataclasses.replace(units[0], filler=True) for part in parts]
    if recipe.data.packing:
        batches = [dataclasses.replace(b, padding_free=True) if b.attention_mask_BT is not None else b
                   for b in batches]
    if shared_prefix:
        batches = [share_prefixes(b) for b in batches]
    return list(batches)


def check_token_budget(recipe, algorithm) -> None:
    """train.max_tokens_per_microbatch must hold the longest unit the run can make, or that unit would break it."""
    budget = recipe.train.max_tokens_per_microbatch
    if budget is None:
        return
    longest, what = longest_unit(recipe, algorithm)
    if budget < longest:
        raise UserError(f"train.max_tokens_per_microbatch={budget} is below {what} = {longest}: one unit of the "
                        f"{algorithm.name} loss would not fit; raise it to at least {longest}")


def longest_unit(recipe, algorithm) -> tuple[int, str]:
    """(tokens, what they are) of the longest unit a micro-batch of the run can hold: a row of data.max_length; a
    preference pair's two rows; a prompt plus its completion for generated data. The smallest budget there is."""
    if algorithm.data_kind == "prompt" or algorithm.source_kind == "distill":
        from posttrain.models.facts import longest_sequence

        longest = longest_sequence(recipe)
        if algorithm.source_kind == "distill" and recipe.data.max_length > longest:  # the dataset's own rows too
            return recipe.data.max_length, "data.max_length"
        return longest, "the longest prompt + generation.max_completion_length"
    if algorithm.data_kind == "preference":
        return 2 * recipe.data.max_length, f"a preference pair: 2 x data.max_length ({recipe.data.max_length})"
    return recipe.data.max_length, "data.max_length"


def split_units(batch: Batch) -> list[Batch]:
    """A padded micro-batch -> its units, each a Batch of its own rows (one row; a preference pair's chosen and
    rejected rows) trimmed to its longest row."""
    if batch.num_pairs:
        return [_select(batch, [p, batch.num_pairs + p], [p]) for p in range(batch.num_pairs)]
    return [_select(batch, [b], None) for b in range(batch.input_ids_BT.shape[0])]


def unit_tokens(unit: Batch, shared_prefix: bool = False) -> int:
    """Real tokens of a unit: what its padding-free forward computes (`shared_prefix`: its rows' shared prefix once,
    as its shared-prefix forward computes it)."""
    shared = share_prefixes(unit) if shared_prefix else unit
    return shared.prefix_layout().forwarded_tokens() if shared.shares_prefix else int(unit.attention_mask_BT.sum())


def prompt_units(units: Sequence[Batch], budget: int, pad_id: int) -> list[Batch]:
    """Row units -> units of the rows that share a prefix (rows with the same tokens before their first completion
    token: a prompt's G completions), each as many of those rows as `budget` holds when their shared prefix is
    counted once: P + sum of the rows' own tokens, not G x P + ... (ops/shared_prefix.prefix_groups decides which of
    them share, and how much). Preference pairs and rows that share nothing stay as they are."""
    by_prompt: dict[tuple, list[Batch]] = {}
    for index, unit in enumerate(units):
        completion = unit.completion_mask_BT[0].nonzero()
        if unit.num_pairs or not len(completion):  # a pair already shares its prompt; a row trained on nowhere alone
            by_prompt[("unit", index)] = [unit]
            continue
        by_prompt.setdefault(tuple(unit.input_ids_BT[0, : int(completion[0])].tolist()), []).append(unit)
    out = []
    for rows in by_prompt.values():
        if len(rows) == 1:
            out += rows
            continue
        group = concat(rows, pad_id)
        group_B, shared_B = prefix_groups(group.input_ids_BT, group.attention_mask_BT.bool())
        lengths = group.attention_mask_BT.sum(-1).tolist()
        for g in dict.fromkeys(group_B.tolist()):  # each set of rows that does share, in order
            members = [b for b, of in enumerate(group_B.tolist()) if of == g]
            shared, chunk, used = int(shared_B[members[0]]), [], 0
            for b in members:
                if chunk and used + lengths[b] - shared > budget:
                    out.append(concat([rows[r] for r in chunk], pad_id))
                    chunk, used = [], 0
                chunk.append(b)
                used += lengths[b] - shared + (shared if len(chunk) == 1 else 0)
            out.append(concat([rows[r] for r in chunk], pad_id))
    return out


def concat(units: Sequence[Batch], pad_id: int) -> Batch:
    """Units -> one padded micro-batch, right-padded to its longest row (preference: every unit's chosen row, then
    every rejected row, the layout posttrain.batch describes)."""
    first = units[0]
    width = max(u.input_ids_BT.shape[1] for u in units)
    fields = {}
    for name, value in first._tensors():
        kind = _kind(first, value)
        parts = [_pad_tokens(getattr(u, name), width, pad_id if name == "input_ids_BT" else 0) if kind == "token"
                 else getattr(u, name) for u in units]
        if kind != "pair" and first.num_pairs:  # chosen rows of every unit, then rejected rows
            parts = [p[:1] for p in parts] + [p[1:] for p in parts]
        fields[name] = torch.cat(parts)
    return dataclasses.replace(first, num_sequences=sum(u.num_sequences for u in units),
                               num_pairs=sum(u.num_pairs for u in units), **fields)


def _kind(batch: Batch, value: torch.Tensor) -> str:
    """How a tensor field lines up: 'token' (rows x tokens), 'row' (one value per row) or 'pair' (one per pair)."""
    rows, length = batch.input_ids_BT.shape
    if value.dim() >= 2 and value.shape[0] == rows and value.shape[1] == length:
        return "token"
    if value.dim() >= 1 and value.shape[0] == rows:
        return "row"
    if batch.num_pairs and value.dim() >= 1 and value.shape[0] == batch.num_pairs:
        return "pair"
    raise ValueError(f"a batch field of shape {tuple(value.shape)} lines up with neither its {rows} rows nor its "
                     f"{batch.num_pairs} pairs")


def _select(batch: Batch, rows: list[int], pairs: list[int] | None) -> Batch:
    """Rows `rows` (and pairs `pairs`) of a padded batch, trimmed to the longest selected row."""
    width = int(batch.attention_mask_BT[rows].sum(-1).max())
    fields = {}
    for name, value in batch._tensors():
        kind = _kind(batch, value)
        picked = value[pairs] if kind == "pair" else value[rows]
        fields[name] = picked[:, :width] if kind == "token" else picked
    return dataclasses.replace(batch, num_sequences=len(rows), num_pairs=len(pairs or []), **fields)


def _pad_tokens(x_BT: torch.Tensor, width: int, value) -> torch.Tensor:
    pad = [0, 0] * (x_BT.dim() - 2) + [0, width - x_BT.shape[1]]
    return torch.nn.functional.pad(x_BT, pad, value=value)
