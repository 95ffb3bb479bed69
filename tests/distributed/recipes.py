"""The small SFT run every distributed test shares: tiny model, arithmetic task, 4 steps, a checkpoint at step 2."""

from __future__ import annotations

from pathlib import Path

from tests.integration.helpers import run_overrides

STEPS = 4


def sft_overrides(model_dir: Path, data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return run_overrides(model_dir, data["sft_train"], out, f"train.max_steps={STEPS}", "train.save_steps=2", *extra)


TWO_PROCESS_SPLIT = ["train.per_device_train_batch_size=1", "train.gradient_accumulation_steps=2"]
