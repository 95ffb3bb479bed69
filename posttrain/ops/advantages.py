"""Advantages as pure functions (verl-style): group-relative ones for GRPO-family algorithms, and the per-token
estimators PPO picks from ADVANTAGE_ESTIMATORS (gae, reinforce++, rloo, grpo), each with its default whitening.

Rewards come laid out as consecutive groups of `group_size` completions of the same prompt:
rewards_B = [r(p0, c0), ..., r(p0, c_{G-1}), r(p1, c0), ...]. Whole groups must be passed together, so the loop
gathers a step's rewards across ranks before calling these.

Standard deviations are the unbiased (Bessel-corrected, divide by n - 1) sample std, torch.std's default, as in
TRL's GRPOTrainer, so numbers and recipes carry over: rewards {0, 1} in a group of 2 have std 0.7071 and get
advantages -+0.5 / (0.7071 + 1e-4) = -+0.7070 (the population std, 0.5, would give -+1).

A completion no reward function scored (`scored_B` False) is handled as TRL's GRPOTrainer does: left out of every
mean and std, advantage 0.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

STD_EPSILON = 1e-4
"""Added to the std before dividing, as in TRL, so a group whose rewards are all equal gets advantage 0."""


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample std (Bessel-corrected) over the non-NaN values, NaN where there are fewer than two: TRL's nanstd."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~x.isnan()).sum(dim=dim, keepdim=keepdim)
    squares = torch.nansum((x - mean) ** 2, dim=dim, keepdim=keepdim)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.nan).sqrt()


def _group_scale(rewards_GN: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): each group's own std."""
    return nanstd(rewards_GN, dim=1, keepdim=True) + STD_EPSILON


def _batch_scale(rewards_GN: torch.Tensor) -> torch.Tensor:
    """One std over every reward passed in; the mean stays per group (Liu et al. 2025, "Tricks or Traps?", Lite PPO)."""
    return (nanstd(rewards_GN) + STD_EPSILON).expand(rewards_GN.shape[0], 1)


def _no_scale(rewards_GN: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): the std division biases the update towards
    prompts that are too easy or too hard, so leave it out."""
    return rewards_GN.new_ones(rewards_GN.shape[0], 1)


REWARD_SCALES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"group": _group_scale, "batch": _batch_scale,
                                                                     "none": _no_scale}
"""scale_rewards -> divisor of each group's mean-centred rewards: rewards_GN (groups, group_size) -> (groups, 1);
NaN (an unscored completion) is left out of the std."""


def _groups(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2 or rewards_B.shape[0] % group_size:
        raise ValueError(f"need group_size (num_generations) >= 2 that splits the {rewards_B.shape[0]} rewards into "
                         f"whole groups, got {group_size}")
    return rewards_B.view(-1, group_size)


def _scored_groups(rewards_B: torch.Tensor, group_size: int, scored_B: torch.Tensor | None) -> torch.Tensor:
    """rewards_GN with NaN where no reward function scored the completion (scored_B False; None: all scored)."""
    rewards_GN = _groups(rewards_B, group_size)
    if scored_B is None:
        return rewards_GN
    return torch.where(_groups(scored_B.bool(), group_size), rewards_GN, torch.nan)


def group_advantages(rewards_B: torch.Tensor, group_size: int, scale_rewards: str = "group",
                     scored_B: torch.Tensor | None = None) -> torch.Tensor:
    """(reward - mean of its group) / scale -> advantages_B; the scale by `scale_rewards`, see REWARD_SCALES.

    scored_B (bool, None: all) marks the completions some reward function scored. As in TRL's GRPOTrainer, an
    unscored one (every function returned None) is left out of its group's mean and std (and the batch std) and gets
    advantage 0; so does every completion of a group with fewer than two scored ones when the std divides."""
    if scale_rewards not in REWARD_SCALES:
        raise ValueError(f"scale_rewards must be one of {', '.join(REWARD_SCALES)}, got {scale_rewards!r}")
    rewards_GN = _scored_groups(rewards_B, group_size, scored_B)
    centred_GN = rewards_GN - torch.nanmean(rewards_GN, dim=1, keepdim=True)
    return torch.nan_to_num(centred_GN / REWARD_SCALES[scale_rewards](rewards_GN), nan=0.0).reshape(-1)


def zero_std_fraction(rewards_B: torch.Tensor, group_size: int, scored_B: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of groups whose scored rewards are all equal (std isclose to 0, as TRL; a group with fewer than two
    scored completions has no std and is not counted, as TRL): no learning signal -> scalar."""
    std_G = nanstd(_scored_groups(rewards_B, group_size, scored_B), dim=1)
    return torch.isclose(std_G, torch.zeros_like(std_G)).float().mean()


# --- PPO-family estimators over per-token rewards (padded layout, aligned with input_ids_BT) -----------------------
#
# Token rewards of a completion: -kl_coef * KL at every completion token, plus the completion's score (reward model
# and/or reward functions) at its LAST completion token (Ziegler et al. 2019; Huang et al. 2024, "The N+ Implementation
# Details of RLHF with PPO"). Positions outside completion_mask_BT (prompt, padding) carry nothing and no value leaks
# across them: the bootstrap value after the last completion token is 0.


def last_token_mask(completion_mask_BT: torch.Tensor) -> torch.Tensor:
    """bool_BT: True at the last completion token of each row (none for an empty row)."""
    mask_BT = completion_mask_BT.bool()
    index_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT, index_BT, -1).max(dim=1).values
    return (index_BT == last_B[:, None]) & mask_BT


def token_rewards(score_B: torch.Tensor, kl_BT: torch.Tensor, completion_mask_BT: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """r_t = -kl_coef * kl_t on completion tokens, + score at the last completion token -> rewards_BT (0 elsewhere)."""
    mask_BT = completion_mask_BT.bool()
    rewards_BT = torch.where(mask_BT, -kl_coef * kl_BT, torch.zeros_like(kl_BT))
    return rewards_BT + last_token_mask(mask_BT) * score_B[:, None].to(rewards_BT)


def gae(rewards_BT: torch.Tensor, values_BT: torch.Tensor, completion_mask_BT: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's completion tokens ->
    (advantages_BT, returns_BT), both 0 outside the mask.

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is the next completion
    token of the row (V_next = A_next = 0 after the last one); returns_t = A_t + V_t (the value target)."""
    mask_BT = completion_mask_BT.bool()
    zeros_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    next_value_B, next_advantage_B = zeros_B, zeros_B
    advantages_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        m_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        advantages_BT[:, t] = torch.where(m_B, advantage_B, zeros_B)
        next_value_B = torch.where(m_B, values_BT[:, t], next_value_B)
        next_advantage_B = torch.where(m_B, advantage_B, next_advantage_B)
    returns_BT = torch.where(mask_BT, advantages_BT + values_BT, torch.zeros_like(values_BT))
    return advantages_BT, returns_BT


def discounted_returns(rewards_BT: torch.Tensor, completion_mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over each row's completion tokens (0 outside) -> returns_BT. REINFORCE++'s
    advantage before whitening (Hu 2025), and RLOO's / GRPO's with their baselined scores."""
    advantages_BT, _ = gae(rewards_BT, torch.zeros_like(rewards_BT), completion_mask_BT, gamma, 1.0)
    return advantages_BT


def rloo_scores(score_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): each score minus the mean of the OTHER
    samples of its prompt -> score_B. Equals G / (G - 1) * (score - group mean)."""
    score_GN = _groups(score_B, group_size)
    baseline_GN = (score_GN.sum(dim=1, keepdim=True) - score_GN) / (group_size - 1)
    return (score_GN - baseline_GN).reshape(-1)


def raw_scores(score_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """No score baseline -> score_B unchanged: the critic's values (GAE) or the step's whitening (REINFORCE++, Hu 2025)
    centre the advantages instead."""
    return score_B


def grpo_scores(score_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): each score standardised within its prompt's group (group sample std
    + 1e-4, see group_advantages) -> score_B."""
    return group_advantages(score_B, group_size, "group")


def discounted_advantages(rewards_BT: torch.Tensor, values_BT: torch.Tensor, completion_mask_BT: torch.Tensor,
                          gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE (Williams 1992) with the baseline already in the score: each token's discounted return is both its
    advantage and the critic's target -> (advantages_BT, returns_BT). values_BT and lam are unused (GAE's arguments)."""
    returns_BT = discounted_returns(rewards_BT, completion_mask_BT, gamma)
    return returns_BT, returns_BT


class AdvantageEstimator(NamedTuple):
    baseline: Callable[[torch.Tensor, int], torch.Tensor]
    """(score_B of the whole step, group_size) -> score_B, before the scores become token rewards; whole groups."""
    token_advantages: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float],
                               tuple[torch.Tensor, torch.Tensor]]
    """(rewards_BT, values_BT, completion_mask_BT, gamma, lam) -> (advantages_BT, returns_BT) of one micro-batch."""
    whiten: bool
    """Whiten the advantages over the step unless algo.whiten_advantages says otherwise (OpenRLHF and verl whiten
    GAE and REINFORCE++ only: whitening a group-baselined score by token-weighted statistics lets one completion's
    length move the others' advantages, even across zero)."""
    needs_groups: bool
    """Compares the samples of one prompt: num_generations >= 2."""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    # GAE (Schulman et al. 2016) on the critic's values, gamma and lam.
    "gae": AdvantageEstimator(raw_scores, gae, whiten=True, needs_groups=False),
    # REINFORCE++ (Hu 2025): discounted returns; whitening over the whole step is its baseline.
    "reinforce++": AdvantageEstimator(raw_scores, discounted_advantages, whiten=True, needs_groups=False),
    # RLOO (Kool et al. 2019; Ahmadian et al. 2024): the score minus the mean of the prompt's other samples.
    "rloo": AdvantageEstimator(rloo_scores, discounted_advantages, whiten=False, needs_groups=True),
    # GRPO (Shao et al. 2024): the score standardised within its prompt's group.
    "grpo": AdvantageEstimator(grpo_scores, discounted_advantages, whiten=False, needs_groups=True),
}
"""algo.advantage_estimator -> how PPO turns the step's scores (and the critic's values) into per-token advantages."""


def masked_moments(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] of x over the mask, float64 -> shape (3,). Summed over ranks, then `whiten`."""
    m_BT = mask_BT.to(torch.float64)
    x64_BT = x_BT.to(torch.float64) * m_BT
    return torch.stack([x64_BT.sum(), (x64_BT * x_BT.to(torch.float64)).sum(), m_BT.sum()])


def whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, moments: torch.Tensor, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked positions whose `masked_moments` (possibly summed over ranks)
    are given; shift_mean=False keeps the mean (scales only). Population variance. 0 outside the mask."""
    total, total_sq, count = moments.to(torch.float64).unbind()
    count = count.clamp(min=1)
    mean = total / count
    var = (total_sq / count - mean**2).clamp(min=0)
    out = (x_BT.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask_BT.bool(), out, torch.zeros_like(out)).to(x_BT.dtype)
