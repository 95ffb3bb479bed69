"""Rewards of a `Sample` (online/engine_link.py): the one scoring step of training rollouts and held-out evaluation.

    texts, scores = score(rewards, prompts, sample, tokenizer, link.with_environment, trainer_state)
    scores.total_B, scores.scored_B, scores.per_function, scores.skipped, scores.logged   # a rewards.Scores
    figures = RankFigures.of(sample.take_scores(texts, scores), logged, lags)   # this rank's share of a step's figures
    metrics = step_metrics(every_ranks_figures, total_B, scored_B, group)      # the whole step's reward figures

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
from posttrain.ops.advantages import zero_std_fraction
from posttrain.rewards import Scores, as_completions, reward_metrics
from posttrain.usercode import UserCodeError


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


def step_metrics(everyone: list[RankFigures], total_B: torch.Tensor, scored_B: torch.Tensor, group: int) -> dict[str, float]:
    """Reward, length and truncation figures of the whole step from every rank's gathered numbers. reward/* and
    frac_reward_zero_std are over the scored completions only (TRL's nanmean); rewards/unscored counts the others."""
    per_function = {name: torch.tensor([r for part in everyone for r in part.per_function[name]])
                    for name in everyone[0].per_function}
    lengths = torch.tensor([n for part in everyone for n in part.lengths], dtype=torch.float32)
    truncated = torch.tensor([c for part in everyone for c in part.truncated], dtype=torch.float32)
    scored_total_B = total_B[scored_B]
    metrics = {"reward/mean": scored_total_B.mean(), "reward/std": scored_total_B.std(unbiased=False),
               "rewards/unscored": (~scored_B).sum(),
               "completion_length/mean": lengths.mean(), "completion_length/max": lengths.max(),
               "completion_length/min": lengths.min(), "truncated_fraction": truncated.mean(),
               **reward_metrics(per_function)}
    untemplated = [u for part in everyone for u in part.untemplated]
    if any(untemplated):  # plain-text prompts for a chat model (rundir/health.py)
        metrics["prompts/untemplated_fraction"] = sum(untemplated) / len(untemplated)
    if group > 1:  # samples of one prompt: how many groups carry no signal
        metrics["frac_reward_zero_std"] = zero_std_fraction(total_B, group, scored_B)
    logged: dict[str, list[float]] = {}  # the reward functions' log_metric values, averaged over the step
    for part in everyone:
        for name, values in part.logged.items():
            logged.setdefault(name, []).extend(values)
    clash = sorted(set(logged) & set(metrics))
    if clash:  # the trainer's figure would be replaced by the user's
        raise UserCodeError(f"a reward function called log_metric({clash[0]!r}, ...), a metric the trainer logs "
                            "itself; give yours a name of its own")
    return {**{k: float(v) for k, v in metrics.items()}, **{k: sum(v) / len(v) for k, v in logged.items()},
            "rewards/skipped": float(sum(p.skipped for p in everyone))}
