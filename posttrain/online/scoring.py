"""Rewards of a `Sample` (online/engine_link.py): the one scoring step of training rollouts and held-out evaluation.

    texts, scores = score(rewards, prompts, sample, tokenizer, link.with_environment, trainer_state)
    scores.total_B, scores.scored_B, scores.per_function, scores.skipped, scores.logged   # a rewards.Scores

Each reward function is called on TRL's contract (rewards/combine.py): one prompt per completion (a prompt's G
samples repeat it), the completions in the dataset's shape (a multi-turn run: every message after the prompt, with
the whole conversation in the `trajectory` column), `completion_ids`, `trainer_state` and every dataset column; an
environment's own reward is added (agents/scoring.py).
"""

from __future__ import annotations

from posttrain.agents import score_trajectories
from posttrain.rewards import Scores, as_completions


def score(rewards, prompts: list[dict], sample, tokenizer, with_environment: bool = False,
          trainer_state=None) -> tuple[list[str], Scores]:
    """Score `sample`, whose rows are len(sample.completion_ids) / len(prompts) completions per prompt, in order;
    `trainer_state` is what the functions get as trainer_state. Returns the completions as the functions saw them
    (a multi-turn run: the last model turn) and their Scores."""
    group = len(sample.completion_ids) // max(len(prompts), 1)
    columns = {key: [p["columns"][key] for p in prompts for _ in range(group)] for key in prompts[0]["columns"]}
    repeated = [p["prompt"] for p in prompts for _ in range(group)]
    texts = sample.texts(tokenizer)
    if sample.trajectories is not None:
        scorer = score_trajectories(rewards, sample.trajectories, with_environment)
    else:
        scorer = rewards.score
    scores = scorer(repeated, as_completions(repeated, texts), columns, sample.completion_ids, trainer_state)
    return texts, scores
