"""Per-token estimators of KL(policy || reference) from samples of the policy (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With log r = ref_logprob - logprob at a sampled token:

    k1 = -log r                unbiased, high variance, can be negative
    k2 = (log r)^2 / 2         biased, low variance, >= 0
    k3 = (r - 1) - log r       unbiased, low variance, >= 0  (GRPO's KL term, Shao et al. 2024)

Unclamped, as in TRL. Position 0 and padding (both log-probs 0) give 0 for each.
"""

from __future__ import annotations

import torch


def kl_k1(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k1 = logprob - ref_logprob per token -> kl_BT."""
    return logprobs_BT - ref_logprobs_BT


def kl_k2(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k2 = (logprob - ref_logprob)^2 / 2 per token -> kl_BT."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT) ** 2


def kl_k3(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 per token -> kl_BT."""
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


class KLController:
    """The KL coefficient of a KL-penalised reward (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", sec. 2.2). Fixed when `target` is None; otherwise adaptive: after each step with measured KL,

        error = clip(kl / target - 1, -0.2, 0.2);   value *= 1 + error * n_steps / horizon

    so the coefficient grows while the policy drifts further than `target` nats from the reference and shrinks
    while it stays closer. Its state (value) goes into checkpoints."""

    def __init__(self, init: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = float(init), target, horizon

    def update(self, kl: float, n_steps: int) -> float:
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
