"""Group-relative advantages for GRPO-family algorithms (verl-style pure functions).

Rewards come laid out as consecutive groups of `group_size` completions of the same prompt:
rewards_B = [r(p0, c0), ..., r(p0, c_{G-1}), r(p1, c0), ...]. Whole groups must be passed together, so the loop
gathers a step's rewards across ranks before calling these.

Standard deviations are the unbiased (Bessel-corrected, divide by n - 1) sample std, torch.std's default, as in
TRL's GRPOTrainer, so numbers and recipes carry over: rewards {0, 1} in a group of 2 have std 0.7071 and get
advantages -+0.5 / (0.7071 + 1e-4) = -+0.7070 (the population std, 0.5, would give -+1).
"""

from __future__ import annotations

from typing import Callable

import torch

STD_EPSILON = 1e-4
"""Added to the std before dividing, as in TRL, so a group whose rewards are all equal gets advantage 0."""


def _group_scale(rewards_GN: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): each group's own std."""
    return rewards_GN.std(dim=1, keepdim=True) + STD_EPSILON


def _batch_scale(rewards_GN: torch.Tensor) -> torch.Tensor:
    """One std over every reward passed in; the mean stays per group (Liu et al. 2025, "Tricks or Traps?", Lite PPO)."""
    return (rewards_GN.std() + STD_EPSILON).expand(rewards_GN.shape[0], 1)


def _no_scale(rewards_GN: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): the std division biases the update towards
    prompts that are too easy or too hard, so leave it out."""
    return rewards_GN.new_ones(rewards_GN.shape[0], 1)


REWARD_SCALES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "group": _group_scale,
    "batch": _batch_scale,
    "none": _no_scale,
}
"""scale_rewards -> divisor of each group's mean-centred rewards: rewards_GN (groups, group_size) -> (groups, 1)."""


def _groups(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2 or rewards_B.shape[0] % group_size:
        raise ValueError(
            f"need group_size (num_generations) >= 2 that splits the {rewards_B.shape[0]} rewards into whole groups, "
            f"got {group_size}"
        )
    return rewards_B.view(-1, group_size)


def group_advantages(rewards_B: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """(reward - mean of its group) / scale -> advantages_B.

    scale_rewards: "group" (GRPO: group sample std + 1e-4), "batch" (sample std of all rewards passed in + 1e-4),
    "none" (Dr. GRPO: 1, mean-centring only). See REWARD_SCALES.
    """
    if scale_rewards not in REWARD_SCALES:
        raise ValueError(f"scale_rewards must be one of {', '.join(REWARD_SCALES)}, got {scale_rewards!r}")
    rewards_GN = _groups(rewards_B, group_size)
    centred_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    return (centred_GN / REWARD_SCALES[scale_rewards](rewards_GN)).reshape(-1)


def zero_std_fraction(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Fraction of groups whose rewards are all equal (std isclose to 0, as TRL): no learning signal -> scalar."""
    std_G = _groups(rewards_B, group_size).std(dim=1)
    return torch.isclose(std_G, torch.zeros_like(std_G)).float().mean()
