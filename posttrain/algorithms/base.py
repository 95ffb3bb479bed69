"""What the loop needs from an algorithm: prepare (no gradient), the loss-unit count, and the loss.

An algorithm is a small plug-in, not a trainer subclass. The loop owns batching, accumulation, normalisation,
optimiser steps, logging and checkpoints; an algorithm owns its math.

    count(batch)                 -> scalar tensor: loss units in this micro-batch (tokens, sequences or pairs)
    loss(model, batch, normaliser) -> (loss, metrics): sum over units / normaliser, where normaliser is the GLOBAL
                                    count over all micro-batches of the step and all ranks (computed by the loop)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from posttrain.train.batch import Batch


@dataclass
class Models:
    """The models an algorithm may use. `policy` is the prepared (wrapped) trainable model."""

    policy: Any
    reference: Optional[Any] = None
    tokenizer: Any = None
    extra: dict = field(default_factory=dict)


class Algorithm(Protocol):
    name: str
    """The CLI command (sft, rm, dpo, grpo)."""
    data_kind: str
    """What rows it trains on: 'sft' (text/messages/prompt-completion), 'preference' or 'prompt'."""

    def prepare(self, batch: Batch, models: Models) -> Batch:
        """Add what needs no gradient (reference log-probs, advantages). Runs under torch.no_grad()."""
        ...

    def count(self, batch: Batch) -> torch.Tensor:
        """Loss units in this micro-batch; summed by the loop over micro-batches and ranks into `normaliser`."""
        ...

    def loss(self, model: Any, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + objective. Returns (loss to backpropagate, detached per-micro-batch metrics)."""
        ...
