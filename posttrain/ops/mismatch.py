"""How far a generation engine's log-probs are from the trainer's for the same sampled tokens: the figures of
trainer-engine mismatch (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
TRL logs the mean and max of the difference, verl the KL and the ratio's spread).

    figures = mismatch_figures(trainer_logprobs_N, sampler_logprobs_N)   # one entry per completion token

Pure: tensors in, scalar tensors out; the caller gathers the tokens of a step (all ranks) first, so the quantiles and
the max are the step's own.
"""

from __future__ import annotations

import torch

QUANTILE_LIMIT = 2**24
"""torch.quantile's largest input; a step with more tokens is measured on an even stride of them."""


def _quantiles(x_N: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    if x_N.numel() > QUANTILE_LIMIT:
        x_N = x_N[:: -(-x_N.numel() // QUANTILE_LIMIT)]
    return torch.quantile(x_N.double(), torch.tensor(qs, dtype=torch.float64)).float()


def _k3(log_ratio_N: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r (ops.kl.kl_k3) as expm1(log r) - log r: at the 1e-5 nats a synced engine shows, exp(x) - 1
    in float32 loses every digit (and goes below 0); this form keeps them."""
    return torch.expm1(log_ratio_N) - log_ratio_N


def mismatch_figures(trainer_logprobs_N: torch.Tensor, sampler_logprobs_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token |trainer - engine| log-prob mean / p50 / p99 / max, the k3 estimate of KL(engine || trainer) (the
    engine sampled the tokens, so its side is the expectation's), and the 1st / 50th / 99th percentiles of the
    importance ratio pi_trainer / pi_engine. {} for no tokens."""
    if trainer_logprobs_N.numel() == 0:
        return {}
    trainer_N, sampler_N = trainer_logprobs_N.float(), sampler_logprobs_N.float()
    gap_N = (trainer_N - sampler_N).abs()
    gap_q = _quantiles(gap_N, (0.5, 0.99))
    ratio_q = _quantiles(torch.exp((trainer_N - sampler_N).clamp(-20.0, 20.0)), (0.01, 0.5, 0.99))
    return {"mismatch/logprob_diff/mean": gap_N.mean(), "mismatch/logprob_diff/p50": gap_q[0],
            "mismatch/logprob_diff/p99": gap_q[1], "mismatch/logprob_diff/max": gap_N.max(),
            "mismatch/k3": _k3(trainer_N.double() - sampler_N.double()).mean().float(),
            "mismatch/is_ratio/p1": ratio_q[0], "mismatch/is_ratio/p50": ratio_q[1],
            "mismatch/is_ratio/p99": ratio_q[2]}
