"""Supervised fine-tuning: negative log-likelihood of the completion tokens."""

from __future__ import annotations

import torch

from posttrain.ops.logprobs import masked_sum


def sft_loss_sum(logprobs_BT: torch.Tensor, completion_mask_BT: torch.Tensor) -> torch.Tensor:
    """-sum of log p(token) over the completion tokens -> scalar.

    A sum, not a mean: the loop divides by the step's global completion-token count (summed over micro-batches and
    ranks), so every token of the step weighs the same however the step is split.
    """
    return -masked_sum(logprobs_BT, completion_mask_BT)
