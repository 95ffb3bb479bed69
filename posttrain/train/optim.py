"""AdamW with decoupled weight decay (not on biases or norms) and the LR schedules, from torch / transformers."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from posttrain.config.schema import TrainConfig

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def make_optimizer(model: torch.nn.Module, t: TrainConfig, learning_rate: float | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; `learning_rate` overrides train.learning_rate (a critic's own rate)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # fused: one kernel for every tensor (CPU and CUDA, float dtypes); DeepSpeed steps its own flat partitions with it
    fused = t.fused_optimizer and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                      for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=t.learning_rate if learning_rate is None else learning_rate,
                             betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, fused=fused or None)


def warmup_steps(t: TrainConfig, total_steps: int) -> int:
    return t.warmup_steps if t.warmup_steps > 0 else math.ceil(t.warmup_ratio * total_steps)


def warmup_trains_nothing(t: TrainConfig, total_steps: int) -> str:
    """Warmup starts at learning rate 0 (transformers' schedules, as TRL's): step 1 of a run with warmup does not move
    the weights. A one-step run with warmup (a smoke test of a recipe with warmup_ratio, say) then trains nothing,
    and used to say nothing: the warning for it, or ''."""
    if total_steps != 1 or not warmup_steps(t, total_steps):
        return ""
    given = f"train.warmup_steps={t.warmup_steps}" if t.warmup_steps > 0 else f"train.warmup_ratio={t.warmup_ratio}"
    return (f"{given} gives step 1, the run's only step, learning rate 0 (warmup starts from 0): this run trains "
            "nothing. Set train.warmup_steps=0 and train.warmup_ratio=0, or train more steps")


def make_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig, total_steps: int):
    return get_scheduler(SCHEDULES[t.lr_scheduler_type], optimizer=optimizer,
                         num_warmup_steps=warmup_steps(t, total_steps), num_training_steps=total_steps)
