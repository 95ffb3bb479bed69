"""Where a run is: what a checkpoint restores besides weights, optimisers and schedules (see checkpoint.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainState:
    """What a checkpoint must restore besides weights and optimiser: where the run is."""

    step: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0
    elapsed_seconds: float = 0.0
    best_eval_loss: Optional[float] = None
    nonfinite_skips: int = 0  # steps dropped under train.nonfinite=skip (train/guard.py)
