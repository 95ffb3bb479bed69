"""Policy-gradient objectives for the GRPO family (verl-style pure module): clipped surrogate, KL penalty, and the
aggregation of per-token losses into one scalar by a global count.

Layout: padded, one sequence per row; `advantages_B` holds one advantage per row, applied to all its tokens.
A GRPO micro-batch loss is built in three steps:

    loss_BT, clip_fraction = clipped_surrogate(logprobs_BT, old_logprobs_BT, advantages_B, completion_mask_BT,
                                               epsilon_low, epsilon_high, level="token")
    loss_BT = loss_BT * sampler_importance_weights(old_BT, sampler_BT, completion_mask_BT, mode, cap)[0]  # optional
    loss_BT, kl_BT = add_kl_penalty(loss_BT, logprobs_BT, ref_logprobs_BT, beta)          # when beta > 0
    loss = LOSS_AGGREGATIONS[loss_type].aggregate(loss_BT, completion_mask_BT, normaliser)

where `normaliser` is the sum, over the step's micro-batches and all ranks, of
`LOSS_AGGREGATIONS[loss_type].count(completion_mask_BT, max_completion_length)`: the loop computes it once per step.
The engine's importance correction (sampler_importance_weights, every mode) is in losses/sampler_correction.py.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from posttrain.ops.kl import kl_k3
from posttrain.ops.logprobs import masked_mean, masked_sum, sequence_mean


def _token_log_ratio(logprobs_BT, old_logprobs_BT, completion_mask_BT) -> torch.Tensor:
    """PPO/GRPO: log(pi(y_t) / pi_old(y_t)), one ratio per token."""
    return logprobs_BT - old_logprobs_BT


def _sequence_log_ratio(logprobs_BT, old_logprobs_BT, completion_mask_BT) -> torch.Tensor:
    """GSPO (Zheng et al. 2025): log s_i = mean over the completion of log(pi / pi_old), the same at every token, in
    the GSPO-token form s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i, its gradient flows per token."""
    log_s_B = sequence_mean(logprobs_BT - old_logprobs_BT, completion_mask_BT).detach()
    return logprobs_BT - logprobs_BT.detach() + log_s_B[:, None]


IMPORTANCE_LEVELS: dict[str, Callable[..., torch.Tensor]] = {"token": _token_log_ratio, "sequence": _sequence_log_ratio}
"""level -> (logprobs_BT, old_logprobs_BT, completion_mask_BT) -> log importance ratio_BT."""


def clipped_surrogate(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages_B: torch.Tensor,
                      completion_mask_BT: torch.Tensor, epsilon_low: float, epsilon_high: float,
                      level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped objective per token (Schulman et al. 2017) -> (loss_BT, clip_fraction).

    loss = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A). A larger epsilon_high than epsilon_low is
    DAPO's clip-higher (Yu et al. 2025); advantages_B may also be advantages_BT, one per token (PPO with GAE).
    level "token": r per token (PPO, GRPO); "sequence": GSPO's length-normalised sequence ratio (see IMPORTANCE_LEVELS).
    clip_fraction (detached): share of completion tokens whose clipped branch is the smaller objective, i.e. that get
    no gradient from this term.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"level must be one of {', '.join(IMPORTANCE_LEVELS)}, got {level!r}")
    ratio_BT = torch.exp(IMPORTANCE_LEVELS[level](logprobs_BT, old_logprobs_BT, completion_mask_BT))
    advantages_B1 = advantages_B[:, None] if advantages_B.dim() == 1 else advantages_B  # or per token (PPO)
    unclipped_BT = ratio_BT * advantages_B1
    clipped_BT = ratio_BT.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages_B1
    loss_BT = -torch.minimum(unclipped_BT, clipped_BT)
    clip_fraction = masked_mean((clipped_BT < unclipped_BT).float(), completion_mask_BT).detach()
    return loss_BT, clip_fraction


def add_kl_penalty(loss_BT: torch.Tensor, logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor,
                   beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """loss + beta * KL_k3(policy || reference) per token, before aggregation -> (loss_BT, kl_BT).

    GRPO's KL term (Shao et al. 2024, eq. 3-4) uses the k3 estimator (posttrain.ops.kl) and is added to the loss
    rather than to the reward, as in TRL; it is then aggregated exactly like the surrogate. kl_BT is returned
    undetached; detach it for metrics.
    """
    kl_BT = kl_k3(logprobs_BT, ref_logprobs_BT)
    return loss_BT + beta * kl_BT, kl_BT


# --- aggregation: (loss_BT, completion_mask_BT, normaliser) -> scalar; counts are int64 scalar tensors -----------


def _count_tokens(completion_mask_BT: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return completion_mask_BT.sum()


def _count_sequences(completion_mask_BT: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return torch.tensor(completion_mask_BT.shape[0], device=completion_mask_BT.device)


def _count_token_slots(completion_mask_BT: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return torch.tensor(completion_mask_BT.shape[0] * max_completion_length, device=completion_mask_BT.device)


def _count_micro_batches(completion_mask_BT: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return torch.tensor(1, device=completion_mask_BT.device)


def _token_sum(loss_BT: torch.Tensor, completion_mask_BT: torch.Tensor, normaliser: torch.Tensor) -> torch.Tensor:
    return masked_sum(loss_BT, completion_mask_BT) / normaliser


def _sequence_mean_sum(loss_BT: torch.Tensor, completion_mask_BT: torch.Tensor,
                       normaliser: torch.Tensor) -> torch.Tensor:
    return sequence_mean(loss_BT, completion_mask_BT).sum() / normaliser


def _token_mean(loss_BT: torch.Tensor, completion_mask_BT: torch.Tensor, normaliser: torch.Tensor) -> torch.Tensor:
    return masked_mean(loss_BT, completion_mask_BT) / normaliser


class LossAggregation(NamedTuple):
    count: Callable[[torch.Tensor, int], torch.Tensor]
    """(completion_mask_BT, max_completion_length) -> this micro-batch's units; the loop sums them into normaliser."""
    aggregate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(loss_BT, completion_mask_BT, normaliser) -> this micro-batch's share of the step's loss."""


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    # DAPO (Yu et al. 2025): token-level mean over the whole step; normaliser = completion tokens of the step.
    "dapo": LossAggregation(_count_tokens, _token_sum),
    # GRPO (Shao et al. 2024): mean over sequences of each sequence's token mean; normaliser = sequences of the step.
    "grpo": LossAggregation(_count_sequences, _sequence_mean_sum),
    # Dr. GRPO (Liu et al. 2025): token sum over a constant; normaliser = sequences of the step * max_completion_length.
    "dr_grpo": LossAggregation(_count_token_slots, _token_sum),
    # BNPO (TRL): token mean within each micro-batch, averaged over micro-batches; normaliser = micro-batches of the
    # step (all ranks). Unlike the others it depends on how the step is split, exactly as TRL's "bnpo" does.
    "bnpo": LossAggregation(_count_micro_batches, _token_mean),
}
