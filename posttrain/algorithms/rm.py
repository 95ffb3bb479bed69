"""Bradley-Terry reward model: a one-output sequence-classification head trained on preference pairs.

    posttrain rm --config recipes/rm.yaml
    # then, as a reward for GRPO / PPO:  rewards: [{name: reward_model, kwargs: {path: runs/rm/final}}]

The model (AutoModelForSequenceClassification, num_labels 1; from a causal-LM checkpoint the score head starts
freshly initialised) reads each sequence at its last non-pad token. Per pair:

    loss = -log sigmoid(score(chosen) - score(rejected) - margin) + center_rewards_coefficient * (score(c) + score(r))^2

where margin is the data's optional `margin` column (Llama 2) and the centring term (Eisenstein et al. 2023) keeps
scores near 0. Chosen and rejected go through the model in one concatenated forward (rows [0, P) and [P, 2P)).
The step's loss is the sum over its pairs / the global pair count.

Metrics: accuracy (score(chosen) > score(rejected)), margin (mean score gap), rewards/chosen, rewards/rejected.
final/ is a Hugging Face sequence-classification directory that `posttrain.rewards.RewardModelScorer` loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import Algorithm
from posttrain.algorithms.preference_logps import split_pairs
from posttrain.config.schema import Recipe
from posttrain.errors import UserError
from posttrain.losses.preference import bradley_terry_loss
from posttrain.models.forward import sequence_scores
from posttrain.batch import Batch


@dataclass(frozen=True)
class RMAlgoConfig:
    """The reward model's knobs (algo.*)."""

    use_margin: bool = True
    """Subtract the data's `margin` column (when it has one) from the score gap (Llama 2's margin loss)."""
    center_rewards_coefficient: float = 0.0
    """Weight of (score(chosen) + score(rejected))^2 per pair, keeping scores centred on 0; 0 turns it off."""

    def validate(self, recipe: Recipe) -> None:
        if self.center_rewards_coefficient < 0:
            raise UserError(f"algo.center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}")


def pair_scores(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over the 2P rows -> (chosen scores_P, rejected scores_P), float32."""
    scores_B = sequence_scores(model, batch)
    return split_pairs(scores_B, batch.num_pairs)


class RM(Algorithm):
    name = "rm"
    data_kind = "preference"
    headline_metrics = ("accuracy", "margin")
    model_kind = "seq_cls"

    def __init__(self, recipe: Recipe):
        self.config: RMAlgoConfig = recipe.algo

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(float(batch.num_pairs), device=batch.input_ids_BT.device)

    def loss(self, model, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen_P, rejected_P = pair_scores(model, batch)
        margin_P = batch.margin_B.to(chosen_P) if self.config.use_margin and batch.margin_B is not None else None
        loss_P = bradley_terry_loss(chosen_P, rejected_P, margin_P)
        if self.config.center_rewards_coefficient > 0:
            loss_P = loss_P + self.config.center_rewards_coefficient * (chosen_P + rejected_P) ** 2
        gap_P = (chosen_P - rejected_P).detach()
        metrics = {"accuracy": (gap_P > 0).float().mean(), "margin": gap_P.mean(),
                   "rewards/chosen": chosen_P.detach().mean(), "rewards/rejected": rejected_P.detach().mean()}
        return loss_P.sum() / normaliser, metrics
