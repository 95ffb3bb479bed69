"""Rewards of a `Sample` (train/engine_link.py): the one scoring step of training rollouts and held-out evaluation.

    scored = score(rewards, prompts, sample, tokenizer, link.with_environment, trainer_state)
    scored.total_B, scored.scored_B, scored.per_function, scored.skipped, scored.logged, scored.texts

Each reward function is called on TRL's contract (rewards/combine.py): one prompt per completion (a prompt's G
samples repeat it), the completions in the dataset's shape (a multi-turn run: every message after the prompt, with
the whole conversation in the `trajectory` column), `completion_ids`, `trainer_state` and every dataset column; an
environment's own reward is added (agents/scoring.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.agents import score_trajectories
from posttrain.rewards import as_completions


@dataclass
class Scored:
    texts: list[str]
    """The completions as the reward functions saw them."""
    total_B: torch.Tensor
    """The weighted sum of every reward per completion (a missing value counts 0)."""
    scored_B: torch.Tensor
    """bool: some reward scored the completion (else TRL's unscorable completion: advantage 0, out of the metrics)."""
    per_function: dict[str, torch.Tensor]
    """Reward name -> its value per completion, NaN where it did not apply."""
    skipped: int
    """(function, completion) pairs that gave no value."""
    logged: object
    """What the functions logged (rewards.combine.Logged: log_metric figures, log_extra columns)."""


def score(rewards, prompts: list[dict], sample, tokenizer, with_environment: bool = False,
          trainer_state=None) -> Scored:
    """Score `sample`, whose rows are len(sample.completion_ids) / len(prompts) completions per prompt, in order;
    `trainer_state` is what the functions get as trainer_state."""
    group = len(sample.completion_ids) // max(len(prompts), 1)
    columns = {key: [p["columns"][key] for p in prompts for _ in range(group)] for key in prompts[0]["columns"]}
    repeated = [p["prompt"] for p in prompts for _ in range(group)]
    texts = sample.texts(tokenizer)
    if sample.trajectories is not None:
        scorer = score_trajectories(rewards, sample.trajectories, with_environment)
    else:
        scorer = rewards.score
    scores = scorer(repeated, as_completions(repeated, texts), columns, sample.completion_ids, trainer_state)
    return Scored(texts, scores.total_B, scores.scored_B, scores.per_function, scores.skipped, scores.logged)
