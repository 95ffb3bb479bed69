"""What a step does with finished trajectories: their rewards (the `rewards:` functions and the environment's) and
their figures for metrics.jsonl / TensorBoard."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from posttrain.rewards.combine import Logged, Scores

ENVIRONMENT_REWARD = "environment"
SUMMED = {"tools/calls": "tool_calls", "tools/errors": "tool_errors", "tools/timeouts": "tool_timeouts",
          "tools/seconds": "tool_seconds", "truncated_trajectories": "truncated", "turns/cut": "cut_turns",
          "truncated_prompts": "prompt_truncated"}
"""Figures summed over the step's trajectories: metric name -> its key in Trajectory.stats()."""


def score_trajectories(rewards, trajectories, with_environment: bool) -> Callable:
    """A `RewardSet.score` over trajectories: as in TRL's multi-turn GRPO, each completion is every message after the
    prompt (model turns, tool and environment turns); the whole conversation is also in the `trajectory` column. The
    environment's reward is added to the total with weight 1 and reported as rewards/environment."""

    def score(prompts, completions, columns, completion_ids=None, trainer_state=None) -> Scores:
        completions = [t.completion_messages for t in trajectories]
        columns = {**columns, "trajectory": [t.messages for t in trajectories]}
        if rewards.rewards:
            scores = rewards.score(prompts, completions, columns, completion_ids, trainer_state)
        else:  # the environment alone scores
            scores = Scores(torch.zeros(len(completions)), {}, 0, Logged({}, {}))
        if with_environment:
            env_B = torch.tensor([t.env_reward for t in trajectories], dtype=torch.float32)
            scores = scores._replace(total_B=scores.total_B + env_B,
                                     per_function={**scores.per_function, ENVIRONMENT_REWARD: env_B})
        return scores

    return score


def agent_metrics(per_rank: list[Optional[list[dict]]]) -> dict[str, float]:
    """Every rank's trajectory stats -> turns/mean|max and the SUMMED figures; {} for a single-turn run."""
    stats = [s for part in per_rank if part for s in part]
    if not stats:
        return {}
    turns = torch.tensor([s["turns"] for s in stats], dtype=torch.float32)
    return {"turns/mean": float(turns.mean()), "turns/max": float(turns.max()),
            **{name: float(sum(s[key] for s in stats)) for name, key in SUMMED.items()}}
