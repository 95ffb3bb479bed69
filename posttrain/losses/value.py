"""The critic's objective: clipped value loss (PPO as in OpenAI baselines; Huang et al. 2022, "The 37 Implementation
Details of PPO", detail 9).

    loss_BT, clip_fraction = clipped_value_loss(values_BT, old_values_BT, returns_BT, completion_mask_BT, clip)
    loss = masked_sum(loss_BT, completion_mask_BT) / normaliser           # normaliser: completion tokens of the step
"""

from __future__ import annotations

from typing import Optional

import torch

from posttrain.ops.logprobs import masked_mean


def clipped_value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       completion_mask_BT: torch.Tensor, clip: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2) per token, V_clipped = V_old + clip(V - V_old, -clip, clip)
    -> (loss_BT, clip_fraction). clip None: the plain 0.5 * (V - R)^2 and clip_fraction 0. clip_fraction (detached):
    share of completion tokens where the clipped branch is the larger loss (no gradient from this token)."""
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        return 0.5 * unclipped_BT, torch.zeros((), device=values_BT.device)
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    clipped_BT = (clipped_values_BT - returns_BT) ** 2
    loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
    return loss_BT, masked_mean((clipped_BT > unclipped_BT).float(), completion_mask_BT).detach()
