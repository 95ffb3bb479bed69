"""Off-policy corrections for completions a generation engine sampled (TRL 1.16's `vllm_importance_sampling_mode`,
verl's rollout correction, IcePop): pure functions, picked once from SAMPLER_CORRECTIONS.

An engine samples from pi_sampler, not exactly from the trainer's pi_old: other kernels and precision (vLLM), or an
older policy (generation.max_staleness). The surrogate's gradient is an expectation under pi_old, so each completion
token's loss is multiplied by a weight built from rho = pi_old(y) / pi_sampler(y):

    mode               rho per        outside [low, high]          peer
    token_truncate     token          clamped to the bound         TRL; verl rollout_is=token; TIS (Yao et al. 2025)
    token_mask         token          weight 0                     TRL; verl rollout_rs=token
    sequence_truncate  sequence (*)   clamped to the bound         TRL; verl rollout_is=sequence
    sequence_mask      sequence (*)   weight 0 for the whole row   TRL; verl rollout_rs=sequence
    geometric_mask     sequence (**)  weight 0 for the whole row   verl rollout_rs=geometric
    icepop             token          weight 0, both sides         IcePop (Ling team 2025): low defaults to 1 / high

(*) the product of the row's token ratios, exp(sum log rho), as TRL and verl; (**) their geometric mean, exp(mean log
rho). `high` is algo.vllm_is_cap (TRL's vllm_importance_sampling_clip_max), `low` algo.vllm_is_min (clip_min; None:
no lower bound, except icepop's 1 / high, verl's default for a two-sided mask). Inside [low, high] the weight is rho
itself in every mode (a masked mode keeps the ratio, as TRL does). Log-ratios are clamped to +-20 before exp (verl's
safety bound), which changes nothing for bounds inside [2e-9, 4.8e8]. Outside the completion the weight is 1.

    weights_BT, metrics = sampler_importance_weights(old_BT, sampler_BT, completion_mask_BT, "icepop", 5.0, 0.5)
    loss_BT = loss_BT * weights_BT
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from posttrain.ops.logprobs import masked_mean, sequence_mean, sequence_sum

SAFETY_LOG_BOUND = 20.0
"""|log rho| above this is clamped before exp (verl's bound): no overflow to inf, no underflow to 0."""


def _per_token(log_ratio_BT: torch.Tensor, completion_mask_BT: torch.Tensor) -> torch.Tensor:
    return log_ratio_BT


def _per_sequence(log_ratio_BT: torch.Tensor, completion_mask_BT: torch.Tensor) -> torch.Tensor:
    """log of the product of the completion's token ratios, the same at every position of the row."""
    return sequence_sum(log_ratio_BT, completion_mask_BT)[:, None].expand_as(log_ratio_BT)


def _geometric(log_ratio_BT: torch.Tensor, completion_mask_BT: torch.Tensor) -> torch.Tensor:
    """log of the geometric mean of the completion's token ratios (length-normalised), at every position."""
    return sequence_mean(log_ratio_BT, completion_mask_BT)[:, None].expand_as(log_ratio_BT)


def _truncate(ratio_BT: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ratio_BT.clamp(min=low, max=high)


def _mask(ratio_BT: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ratio_BT.masked_fill((ratio_BT < low) | (ratio_BT > high), 0.0)


class SamplerCorrection(NamedTuple):
    log_ratio: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(log rho per token_BT, completion_mask_BT) -> the log ratio each position is weighted by."""
    bound: Callable[[torch.Tensor, float, float], torch.Tensor]
    """(ratio_BT, low, high) -> weights_BT: truncate or mask outside [low, high]."""
    two_sided: bool = False
    """Without algo.vllm_is_min the lower bound is 1 / high (else none)."""


SAMPLER_CORRECTIONS: dict[str, SamplerCorrection] = {
    "token_truncate": SamplerCorrection(_per_token, _truncate),
    "token_mask": SamplerCorrection(_per_token, _mask),
    "sequence_truncate": SamplerCorrection(_per_sequence, _truncate),
    "sequence_mask": SamplerCorrection(_per_sequence, _mask),
    "geometric_mask": SamplerCorrection(_geometric, _mask),
    "icepop": SamplerCorrection(_per_token, _mask, two_sided=True),
}
"""algo.vllm_importance_sampling_mode -> how the weight is made (see the module's table)."""


def correction_bounds(mode: str, high: Optional[float], low: Optional[float]) -> tuple[float, float]:
    """The [low, high] a mode applies: None is unbounded on that side, except icepop's low (1 / high)."""
    if low is None and SAMPLER_CORRECTIONS[mode].two_sided and high is not None:
        low = 1.0 / high
    return (0.0 if low is None else float(low)), (float("inf") if high is None else float(high))


def sampler_importance_weights(old_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor,
                               completion_mask_BT: torch.Tensor, mode: str = "token_truncate",
                               high: Optional[float] = 2.0, low: Optional[float] = None,
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pi_old / pi_sampler weights by `mode` (SAMPLER_CORRECTIONS) -> (weights_BT, metrics), all detached.

    metrics, over completion tokens: is_ratio (mean of the mode's rho before the bounds), is_capped_fraction (share
    whose weight a truncation changed), is_masked_fraction (share a mask set to 0). A log-prob the engine could not
    give (NaN) counts as a ratio of 1, as TRL does.

    Any policy lag: pi_old is the trainer's policy when the batch is first trained, pi_sampler whichever version
    sampled it, so the ratio pi / pi_old stays a trust region around the current policy and this weight alone carries
    the distance to the sampler (the decoupled objective of Hilton et al. 2022 and AReaL, Fu et al. 2025;
    docs/generation.md).
    """
    correction = SAMPLER_CORRECTIONS[mode]
    low_bound, high_bound = correction_bounds(mode, high, low)
    with torch.no_grad():
        inside_BT = completion_mask_BT.bool()
        token_log_ratio_BT = torch.nan_to_num(old_logprobs_BT.float() - sampler_logprobs_BT.float(), nan=0.0)
        token_log_ratio_BT = torch.where(inside_BT, token_log_ratio_BT, torch.zeros_like(token_log_ratio_BT))
        log_ratio_BT = correction.log_ratio(token_log_ratio_BT, completion_mask_BT)
        ratio_BT = torch.exp(log_ratio_BT.clamp(-SAFETY_LOG_BOUND, SAFETY_LOG_BOUND))
        bounded_BT = correction.bound(ratio_BT, low_bound, high_bound)
        weights_BT = torch.where(inside_BT, bounded_BT, torch.ones_like(bounded_BT))
        masked_BT = (bounded_BT == 0) & (ratio_BT != 0)
        metrics = {"is_ratio": masked_mean(ratio_BT, completion_mask_BT),
                   "is_capped_fraction": masked_mean(((bounded_BT != ratio_BT) & ~masked_BT).float(),
                                                     completion_mask_BT),
                   "is_masked_fraction": masked_mean(masked_BT.float(), completion_mask_BT)}
    return weights_BT.to(old_logprobs_BT.dtype), metrics
