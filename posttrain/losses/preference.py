"""Pairwise preference objectives: the DPO family and the Bradley-Terry reward-model loss. All per pair (loss_P).

Every loss in PREFERENCE_LOSSES has the same signature, `loss(logits_P, *, beta, label_smoothing, simpo_gamma)`,
on the preference logits of `preference_logits`:

    logits_P = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)      # DPO family
    logits_P = policy_chosen - policy_rejected                                      # reference-free (SimPO)

where each term is a sequence log-prob: the sum of the completion's token log-probs, or their mean over its
completion tokens when the table's `length_normalised` is True. Arguments a loss does not use are ignored.
The DPO algorithm picks a row once:

    spec = PREFERENCE_LOSSES[loss_type]
    reduce = sequence_mean if spec.length_normalised else sequence_sum       # posttrain.ops.logprobs
    refs = (None, None) if spec.reference_free else (ref_chosen_P, ref_rejected_P)
    logits_P = preference_logits(reduce(...chosen...), reduce(...rejected...), *refs)
    loss_P = spec.loss(logits_P, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma)
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F


def _relative(policy_logps_P: torch.Tensor, ref_logps_P: Optional[torch.Tensor]) -> torch.Tensor:
    return policy_logps_P if ref_logps_P is None else policy_logps_P - ref_logps_P


def preference_logits(policy_chosen_logps_P: torch.Tensor, policy_rejected_logps_P: torch.Tensor,
                      ref_chosen_logps_P: Optional[torch.Tensor] = None,
                      ref_rejected_logps_P: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(pc - rc) - (pr - rr) -> logits_P; a missing reference counts as 0 (reference-free losses)."""
    chosen_P = _relative(policy_chosen_logps_P, ref_chosen_logps_P)
    return chosen_P - _relative(policy_rejected_logps_P, ref_rejected_logps_P)


def _smoothed_nll(z_P: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - e) log sigmoid(z) - e log sigmoid(-z): binary cross-entropy with the label flipped w.p. e."""
    return -(1 - label_smoothing) * F.logsigmoid(z_P) - label_smoothing * F.logsigmoid(-z_P)


def sigmoid_loss(logits_P, *, beta, label_smoothing=0.0, simpo_gamma=0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * logits). With label_smoothing e > 0 this is conservative DPO
    (cDPO, Mitchell 2023): -(1 - e) log sigmoid(beta * logits) - e log sigmoid(-beta * logits)."""
    return _smoothed_nll(beta * logits_P, label_smoothing)


def robust_loss(logits_P, *, beta, label_smoothing=0.0, simpo_gamma=0.0) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024), unbiased under preference labels flipped with probability e < 1/2:
    (-(1 - e) log sigmoid(beta * logits) + e log sigmoid(-beta * logits)) / (1 - 2e). As TRL's loss_type="robust"."""
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    z_P = beta * logits_P
    numerator_P = -(1 - label_smoothing) * F.logsigmoid(z_P) + label_smoothing * F.logsigmoid(-z_P)
    return numerator_P / (1 - 2 * label_smoothing)


def ipo_loss(logits_P, *, beta, label_smoothing=0.0, simpo_gamma=0.0) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17 with tau = beta): (logits - 1 / (2 beta))^2.

    Length-normalised by default (PREFERENCE_LOSSES["ipo"]): the log-probs are per-token means, as TRL does; the
    paper states it on sequence log-likelihoods (sums), which the algorithm may ask for with a flag.
    """
    return (logits_P - 1 / (2 * beta)) ** 2


def hinge_loss(logits_P, *, beta, label_smoothing=0.0, simpo_gamma=0.0) -> torch.Tensor:
    """SLiC hinge (Zhao et al. 2023, with the DPO reference term as in TRL): relu(1 - beta * logits)."""
    return torch.relu(1 - beta * logits_P)


def simpo_loss(logits_P, *, beta, label_smoothing=0.0, simpo_gamma=0.5) -> torch.Tensor:
    """SimPO (Meng et al. 2024): reference-free, on length-normalised log-probs, with a target margin gamma:
    -log sigmoid(beta * (pc/len_c - pr/len_r) - gamma); label smoothing as in cDPO (TRL's CPOTrainer)."""
    return _smoothed_nll(beta * logits_P - simpo_gamma, label_smoothing)


class PreferenceLoss(NamedTuple):
    loss: Callable[..., torch.Tensor]
    """(logits_P, *, beta, label_smoothing, simpo_gamma) -> loss_P."""
    reference_free: bool
    """True: logits from the policy alone; no reference model is needed."""
    length_normalised: bool
    """True: sequence log-probs are means over completion tokens, not sums."""


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss(sigmoid_loss, reference_free=False, length_normalised=False),
    "robust": PreferenceLoss(robust_loss, reference_free=False, length_normalised=False),
    "ipo": PreferenceLoss(ipo_loss, reference_free=False, length_normalised=True),
    "hinge": PreferenceLoss(hinge_loss, reference_free=False, length_normalised=False),
    "simpo": PreferenceLoss(simpo_loss, reference_free=True, length_normalised=True),
}


def implicit_rewards(policy_chosen_logps_P: torch.Tensor, policy_rejected_logps_P: torch.Tensor,
                     ref_chosen_logps_P: Optional[torch.Tensor] = None,
                     ref_rejected_logps_P: Optional[torch.Tensor] = None, *,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards beta * (policy - reference) -> detached (chosen_rewards_P, rejected_rewards_P), for
    metrics (accuracy = chosen > rejected, margin). A missing reference counts as 0 (SimPO: beta * policy)."""
    chosen_P = beta * _relative(policy_chosen_logps_P, ref_chosen_logps_P)
    rejected_P = beta * _relative(policy_rejected_logps_P, ref_rejected_logps_P)
    return chosen_P.detach(), rejected_P.detach()


def bradley_terry_loss(
    chosen_scores_P: torch.Tensor, rejected_scores_P: torch.Tensor, margin_P: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022): -log sigmoid(chosen - rejected - margin) -> loss_P.
    The optional margin (Llama 2, Touvron et al. 2023) asks for a larger gap on pairs rated far apart."""
    difference_P = chosen_scores_P - rejected_scores_P
    if margin_P is not None:
        difference_P = difference_P - margin_P
    return -F.logsigmoid(difference_P)
