"""Examples (lists of token ids) -> `Batch` tensors, padded or packed. See posttrain.batch for the layouts.

    batch = collate_padded(examples, pad_id(tokenizer))   # [B, T], right padding, attention_mask (one pad rule)
    batch = collate_packed(examples)              # [1, sum of lengths], position ids restart per sequence
    batch = collate_preference(pairs, pad_id)     # chosen rows then rejected rows
    input_ids_BT, attention_mask_BT = collate_prompts(prompts, pad_id)   # left padding, for generation
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from posttrain.batch import Batch


def pad_id(tokenizer) -> int:
    """The one id every place pads with (the trainer's regrouped rows, the online batch, the HF engine's prompts): the
    tokenizer's pad token, else its end of sequence (load_tokenizer gives a tokenizer without one its eos as pad).
    Padding is masked out of every loss, so any id would do; one rule keeps batches from the same rows identical.
    0 without a tokenizer (batches of ids built without one)."""
    if tokenizer is None:
        return 0
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def _right_pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def collate_padded(examples: list[dict], pad_id: int) -> Batch:
    """[{"input_ids", "completion_mask"}] -> right-padded Batch; padding is outside completion and attention masks."""
    ids = [e["input_ids"] for e in examples]
    return Batch(input_ids_BT=_right_pad(ids, pad_id), num_sequences=len(examples),
                 completion_mask_BT=_right_pad([e["completion_mask"] for e in examples], 0).bool(),
                 attention_mask_BT=_right_pad([[1] * len(r) for r in ids], 0))


def collate_packed(examples: list[dict], row_length: int | None = None, pad_id: int = 0) -> Batch:
    """[{"input_ids", "completion_mask"}] -> padding-free rows: sequences concatenated, position ids restarting at 0
    (transformers keeps attention inside each sequence from them). row_length None: one row; else first-fit-decreasing
    rows of at most `row_length` tokens (attention ~rows x row_length^2, not (all tokens)^2), short rows filled with
    untrained `pad_id` segments. Each sequence's first token is out of the completion mask (it would be predicted
    from the previous sequence); `sequence_index_BT` numbers sequences in the order given (-1 for filler)."""
    lengths = [len(e["input_ids"]) for e in examples]
    bins: list[list[int]] = []
    sizes: list[int] = []
    for n in sorted(range(len(examples)), key=lambda n: -lengths[n]) if row_length else range(len(examples)):
        slot = next((b for b, size in enumerate(sizes) if not row_length or size + lengths[n] <= row_length), len(bins))
        if slot == len(bins):  # nothing fits: a new row
            bins.append([])
            sizes.append(0)
        bins[slot].append(n)
        sizes[slot] += lengths[n]
    rows = [sorted(members) for members in bins]  # each row's sequences in the order given, then filler
    ids = [[t for n in row for t in examples[n]["input_ids"]] for row in rows]
    mask = [[m for n in row for m in [0, *examples[n]["completion_mask"][1:]]] for row in rows]
    index = [[n for n in row for _ in range(lengths[n])] for row in rows]
    positions = [[p for n in row for p in range(lengths[n])] + list(range(max(sizes) - size))
                 for row, size in zip(rows, sizes)]
    return Batch(input_ids_BT=_right_pad(ids, pad_id), num_sequences=len(examples),
                 completion_mask_BT=_right_pad(mask, 0).bool(), sequence_index_BT=_right_pad(index, -1),
                 position_ids_BT=torch.tensor(positions, dtype=torch.long))


def collate_preference(examples: list[dict], pad_id: int) -> Batch:
    """[{"prompt_ids", "chosen_ids", "rejected_ids"(, "margin")}] -> padded Batch of 2P rows: P chosen sequences
    (prompt + chosen) then their P rejected partners; the completion mask covers the chosen / rejected tokens."""
    sequences = [{"input_ids": e["prompt_ids"] + e[side],
                  "completion_mask": [0] * len(e["prompt_ids"]) + [1] * len(e[side])}
                 for side in ("chosen_ids", "rejected_ids") for e in examples]
    margin_B = torch.tensor([e["margin"] for e in examples], dtype=torch.float32) if "margin" in examples[0] else None
    return dataclasses.replace(collate_padded(sequences, pad_id), num_pairs=len(examples), margin_B=margin_B)


def collate_prompts(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[{"prompt_ids"}] -> (input_ids_BT, attention_mask_BT), LEFT padded so every prompt ends at the last column,
    where generation continues."""
    ids = [e["prompt_ids"] for e in examples]
    width = max(len(r) for r in ids)
    input_ids_BT = torch.tensor([[pad_id] * (width - len(r)) + r for r in ids], dtype=torch.long)
    attention_mask_BT = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], dtype=torch.long)
    return input_ids_BT, attention_mask_BT


def eval_batches(examples: Sequence[dict], collate: Callable[[list[dict]], Batch], batch_size: int, world_size: int,
                 rank: int) -> list[tuple[Batch, float]]:
    """This rank's eval micro-batches with a weight (0 for a filler batch), the same COUNT on every rank so that
    collective forwards (ZeRO-3) stay in step."""
    out = []
    chunk = batch_size * world_size
    for start in range(0, len(examples), chunk):
        mine = list(range(start + rank * batch_size, min(start + (rank + 1) * batch_size, len(examples))))
        weight, mine = (1.0, mine) if mine else (0.0, [start])
        batch = collate([examples[i] for i in mine])
        out.append((dataclasses.replace(batch, example_index_B=torch.tensor(mine)), weight))
    return out
