"""Rewards of a `Sample` (online/engine_link.py): the one scoring step of training rollouts and held-out evaluation.

    texts, scores = score(rewards, prompts, sample, tokenizer, link.with_environment, trainer_state)
    scores.total_B, scores.scored_B, scores.per_function, scores.skipped, scores.logged   # a rewards.Scores
    figures = RankFigures.of(sample.take_scores(texts, scores), logged, lags)   # this rank's share of a step's figures

Each reward function is called on TRL's contract (rewards/combine.py): one prompt per completion (a prompt's G
samples repeat it), the completions in the dataset's shape (a multi-turn run: every message after the prompt, with
the whole conversation in the `trajectory` column), `completion_ids`, `trainer_state` and every dataset column; an
environment's own reward is added (agents/scoring.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from posttrain.agents import score_trajectories
from posttrain.errors import RunStopped
from posttrain.rewards import Scores, as_completions


def score(rewards, prompts: list[dict], sample, tokenizer, with_environment: bool = False,
          trainer_state=None) -> tuple[list[str], Scores]:
    """Score `sample`, whose rows are len(sample.completion_ids) / len(prompts) completions per prompt, in order;
    `trainer_state` is what the functions get as trainer_state. Returns the completions as the functions saw them
    (a multi-turn run: the last model turn) and their Scores."""
    group = len(sample.completion_ids) // max(len(prompts), 1)
    columns = {key: [p["columns"][key] for p in prompts for _ in range(group)] for key in prompts[0]["columns"]}
    repeated = [p["prompt"] for p in prompts for _ in range(group)]
    texts = sample.completion_texts(tokenizer)
    if sample.trajectories is not None:
        scorer = score_trajectories(rewards, sample.trajectories, with_environment)
    else:
        scorer = rewards.score
    scores = scorer(repeated, as_completions(repeated, texts), columns, sample.completion_ids, trainer_state)
    return texts, scores


class UnscoredSteps:
    """A step none of whose completions any reward scored (every function skipped its batch, on_error: skip, or
    returned None) trains on nothing: every advantage is 0. One such step after scored ones is an outage the recipe
    chose to ride out; a run whose every step so far is unscored, or `limit` such steps in a row, stops (it used to
    train at loss 0 to exit 0)."""

    def __init__(self, limit: int = 3):
        self.limit, self.scored_once, self.in_a_row = limit, False, 0

    def check(self, scored_B: torch.Tensor, skipped: dict[str, int], step: int) -> None:
        """scored_B: the step's completions on every rank (the same on all, so all stop alike); skipped: reward
        name -> completions it gave no value."""
        if scored_B.numel() == 0 or scored_B.any():
            self.scored_once, self.in_a_row = True, 0
            return
        self.in_a_row += 1
        if self.scored_once and self.in_a_row < self.limit:
            return
        what = ", ".join(f"'{name}' {count} of {len(scored_B)}" for name, count in skipped.items())
        since = f"the last {self.in_a_row} steps" if self.scored_once else f"every step so far (to step {step + 1})"
        raise RunStopped(f"no reward scored any completion of {since} ({what} missing): those steps train on nothing "
                         "(every advantage is 0). The warnings above say why each reward gave none (on_error: skip "
                         "hides a failing reward, None means 'not applicable'); fix the reward and rerun")


@dataclass
class RankFigures:
    """One rank's share of a step's figures, gathered from every rank (rank 0's first) so rewards, advantages and
    metrics are computed on the whole step; one value per completion unless said."""

    total: list[float]
    """The weighted total reward."""
    scored: list[bool]
    """Some reward scored the completion."""
    per_function: dict[str, list[float]]
    """Each reward function's value (NaN: missing)."""
    skipped: int
    """(function, completion) values missing, on this rank."""
    logged: dict[str, list[float]]
    """The reward functions' log_metric values (name -> every value logged)."""
    lengths: list[int]
    """Completion tokens."""
    truncated: list[bool]
    """Hit max_completion_length without end of sequence."""
    lags: list[int]
    """Optimiser steps from the sampling policy to the one trained."""
    agent: Optional[list[dict]]
    """Multi-turn runs: each trajectory's stats (agents.Trajectory.stats); None for single-turn sampling."""
    untemplated: list[bool] = field(default_factory=list)
    """Per prompt: plain text tokenised as it is for a tokenizer with a chat template (rundir/health.py)."""
    versions: list[tuple[int, int, int, bool]] = field(default_factory=list)
    """Versions spanned, tokens older than the row's latest version, tokens, dropped (online/partial.py)."""

    @classmethod
    def of(cls, sample, logged: dict[str, list[float]], lags: list[int]) -> "RankFigures":
        """A scored Sample's figures; `logged`: the reward functions' log_metric values of every draw of the step;
        `lags`: each completion's policy lag at the step trained."""
        return cls(total=sample.total, scored=sample.scored, per_function=sample.per_function,
                   skipped=sample.skipped, logged=logged, lengths=[len(ids) for ids in sample.completion_ids],
                   truncated=sample.truncated, lags=lags,
                   agent=[t.stats() for t in sample.trajectories] if sample.trajectories is not None else None,
                   untemplated=[bool(p.get("untemplated")) for p in sample.prompts],
                   versions=sample.version_figures())
