"""Rewards of a `Sample` (train/engine_link.py): the one scoring step of training rollouts and held-out evaluation.

    scored = score(rewards, prompts, sample, tokenizer, with_environment=link.with_environment)
    scored.total_B, scored.per_function, scored.skipped, scored.texts

Each reward function gets one prompt per completion (a prompt's G samples repeat it), the completion text (a
multi-turn run's last model turn, with the whole conversation in the `trajectory` column), every dataset column and
`completion_ids`; an environment's own reward is added (agents/scoring.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.agents import score_trajectories


@dataclass
class Scored:
    texts: list[str]
    """The completions as the reward functions saw them."""
    total_B: torch.Tensor
    """The weighted sum of every reward per completion (a missing value counts 0)."""
    per_function: dict[str, torch.Tensor]
    """Reward name -> its value per completion, NaN where it did not apply."""
    skipped: int
    """(function, completion) pairs that gave no value."""


def score(rewards, prompts: list[dict], sample, tokenizer, with_environment: bool = False) -> Scored:
    """Score `sample`, whose rows are len(sample.completion_ids) / len(prompts) completions per prompt, in order."""
    group = len(sample.completion_ids) // max(len(prompts), 1)
    columns = {key: [p["columns"][key] for p in prompts for _ in range(group)] for key in prompts[0]["columns"]}
    columns.setdefault("completion_ids", sample.completion_ids)
    texts = sample.texts(tokenizer)
    if sample.trajectories is not None:
        scorer = score_trajectories(rewards, sample.trajectories, with_environment)
    else:
        scorer = rewards.score
    total_B, per_function, skipped = scorer([p["prompt"] for p in prompts for _ in range(group)], texts, columns)
    return Scored(texts, total_B, per_function, skipped)
