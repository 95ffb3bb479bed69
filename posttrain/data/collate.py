"""Examples (lists of token ids) -> `Batch` tensors, padded or packed. See posttrain.train.batch for the layouts.

    batch = collate_padded(examples, pad_id)      # [B, T], right padding, attention_mask
    batch = collate_packed(examples)              # [1, sum of lengths], position ids restart per sequence
    batch = collate_preference(pairs, pad_id)     # chosen rows then rejected rows
    input_ids_BT, attention_mask_BT = collate_prompts(prompts, pad_id)   # left padding, for generation
"""

from __future__ import annotations

import dataclasses

import torch

from posttrain.train.batch import Batch


def _right_pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def collate_padded(examples: list[dict], pad_id: int) -> Batch:
    """[{"input_ids", "completion_mask"}] -> right-padded Batch; padding is outside completion and attention masks."""
    ids = [e["input_ids"] for e in examples]
    return Batch(
        input_ids_BT=_right_pad(ids, pad_id),
        completion_mask_BT=_right_pad([e["completion_mask"] for e in examples], 0).bool(),
        attention_mask_BT=_right_pad([[1] * len(r) for r in ids], 0),
        num_sequences=len(examples),
    )


def collate_packed(examples: list[dict]) -> Batch:
    """[{"input_ids", "completion_mask"}] -> one padding-free row: sequences concatenated, position ids restarting
    at 0 (transformers finds the boundaries from them and keeps attention inside each sequence).

    Each sequence's first token is left out of the completion mask: it would be predicted from the previous
    sequence's last token.
    """
    input_ids, mask, positions, index = [], [], [], []
    for n, e in enumerate(examples):
        length = len(e["input_ids"])
        input_ids += e["input_ids"]
        mask += [0] + list(e["completion_mask"][1:])
        positions += range(length)
        index += [n] * length
    return Batch(
        input_ids_BT=_one_row(input_ids),
        completion_mask_BT=_one_row(mask).bool(),
        position_ids_BT=_one_row(positions),
        sequence_index_BT=_one_row(index),
        num_sequences=len(examples),
    )


def _one_row(values: list[int]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.long)


def collate_preference(examples: list[dict], pad_id: int) -> Batch:
    """[{"prompt_ids", "chosen_ids", "rejected_ids"(, "margin")}] -> padded Batch of 2P rows: P chosen sequences
    (prompt + chosen) then their P rejected partners; the completion mask covers the chosen / rejected tokens."""
    sequences = []
    for side in ("chosen_ids", "rejected_ids"):
        for e in examples:
            mask = [0] * len(e["prompt_ids"]) + [1] * len(e[side])
            sequences.append({"input_ids": e["prompt_ids"] + e[side], "completion_mask": mask})
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
