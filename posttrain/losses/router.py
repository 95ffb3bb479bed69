"""Mixture-of-experts router math: the load-balancing loss and how often a replayed routing agrees with the router.

    aux = load_balancing_loss(router_logits_LNE, top_k, mask_N)     # Switch Transformer's auxiliary loss
    agree = routing_agreement(chosen_NK, replayed_NK, mask_N)         # (matches, token-expert choices)

N tokens (batch x sequence, flattened as the router sees them), E experts, K experts routed per token, L MoE layers.
"""

from __future__ import annotations

import torch


def load_balancing_loss(router_logits_LNE: torch.Tensor, top_k: int, mask_N: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eqs. 4-6) over every layer's tokens together:
    E * sum_e f_e * P_e, with f_e the fraction of top-k assignments that go to expert e and P_e its mean router
    probability, both over the real tokens (mask_N) of all L layers. 1.0 when routing is uniform; as transformers'
    `load_balancing_loss_func` (Qwen3-MoE, Mixtral) computes it, so a coefficient means what it means there."""
    num_experts = router_logits_LNE.shape[-1]
    probs_LNE = router_logits_LNE.float().softmax(dim=-1)
    chosen_LNK = probs_LNE.topk(top_k, dim=-1).indices
    weight_LN = mask_N.float().expand(probs_LNE.shape[:2])
    assigned_E = torch.zeros(num_experts, device=probs_LNE.device).scatter_add_(
        0, chosen_LNK.reshape(-1), weight_LN[..., None].expand(chosen_LNK.shape).reshape(-1))
    rows = weight_LN.sum().clamp(min=1)
    prob_E = (probs_LNE * weight_LN[..., None]).sum(dim=(0, 1))
    return num_experts * (assigned_E / rows * prob_E / rows).sum()


def routing_agreement(chosen_NK: torch.Tensor, replayed_NK: torch.Tensor, mask_N: torch.Tensor) -> torch.Tensor:
    """(matches, choices): how many of the replayed token-expert choices of the real tokens the router would have made
    itself (its own top-k), and how many there are. Their ratio is R2/R3's routing agreement (1.0: replay changed
    nothing); kept as two counts so layers and micro-batches sum before one division."""
    matches_NK = (replayed_NK[:, :, None] == chosen_NK[:, None, :]).any(dim=-1)
    weight_N = mask_N.float()
    return torch.stack([(matches_NK.float() * weight_N[:, None]).sum(), weight_N.sum() * replayed_NK.shape[-1]])
