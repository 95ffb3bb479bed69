"""What a step does with finished trajectories: their rewards (the `rewards:` functions and the environment's) and
their figures for metrics.jsonl / TensorBoard."""

from __future__ import annotations

from typing import Callable, Optional

import torch

ENVIRONMENT_REWARD = "environment"
SUMMED = {"tools/calls": "tool_calls", "tools/errors": "tool_errors", "tools/timeouts": "tool_timeouts",
          "tools/seconds": "tool_seconds", "truncated_trajectories": "truncated", "turns/cut": "cut_turns",
          "truncated_prompts": "prompt_truncated"}
"""Figures summed over the step's trajectories: metric name -> its key in Trajectory.stats()."""


def score_trajectories(rewards, trajectories, with_environment: bool) -> Callable:
    """A `RewardSet.score` over trajectories: the functions get the model's last turn as the completion and the whole
    conversation in the `trajectory` column (a function that names `trajectory` receives it); the environment's
    reward is added to the total with weight 1 and reported as rewards/environment."""

    def score(prompts, completions, columns):
        columns = {**columns, "trajectory": [t.messages for t in trajectories]}
        if rewards.rewards:
            total_B, per_function, skipped = rewards.score(prompts, completions, columns)
        else:  # the environment alone scores
            total_B, per_function, skipped = torch.zeros(len(completions)), {}, 0
        if with_environment:
            env_B = torch.tensor([t.env_reward for t in trajectories], dtype=torch.float32)
            total_B, per_function = total_B + env_B, {**per_function, ENVIRONMENT_REWARD: env_B}
        return total_B, per_function, skipped

    return score


def agent_metrics(per_rank: list[Optional[list[dict]]]) -> dict[str, float]:
    """Every rank's trajectory stats -> turns/mean|max and the SUMMED figures; {} for a single-turn run."""
    stats = [s for part in per_rank if part for s in part]
    if not stats:
        return {}
    turns = torch.tensor([s["turns"] for s in stats], dtype=torch.float32)
    return {"turns/mean": float(turns.mean()), "turns/max": float(turns.max()),
            **{name: float(sum(s[key] for s in stats)) for name, key in SUMMED.items()}}
