"""Supervised fine-tuning: token cross-entropy over the completion mask.

    posttrain sft --config recipes/sft.yaml

The loss of a step is (sum of -log p over completion tokens of all micro-batches and ranks) / (their count): the
loop passes that global count as `normaliser`, so accumulation and world size do not change the update.

Metrics: `mean_token_logprob`, and TRL's `mean_token_accuracy` (the fraction of loss tokens that are the argmax of
the distribution predicting them), from the same forward: with the fused output layer the argmax is taken inside
its logits chunks (models/forward.policy_logprobs_top1), so it costs no (B, T, V) tensor.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.base import Algorithm
from posttrain.models.forward import policy_logprobs_top1
from posttrain.config.schema import Recipe, SFTAlgoConfig
from posttrain.losses.sft import sft_loss_sum
from posttrain.batch import Batch


class SFT(Algorithm):
    name = "sft"
    logprobs_only = True
    headline_metrics = ("mean_token_accuracy",)  # as TRL's SFT console

    def __init__(self, recipe: Recipe):
        self.config: SFTAlgoConfig = recipe.algo

    def count(self, batch: Batch) -> torch.Tensor:
        return batch.completion_mask_BT.sum()

    def loss(self, model, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask_BT = batch.completion_mask_BT
        logprobs_BT, top1_BT = policy_logprobs_top1(model, batch, mask_BT=mask_BT)  # the output layer on the loss's rows
        loss = sft_loss_sum(logprobs_BT, mask_BT) / normaliser
        n = mask_BT.sum().clamp(min=1)
        metrics = {"mean_token_logprob": (logprobs_BT.detach() * mask_BT).sum() / n,
                   "mean_token_accuracy": (top1_BT & mask_BT.bool()).sum() / n}
        return loss, metrics
