"""Helpers for integration tests: write small data, run a command in-process, read results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.tasks import arithmetic_problems, preference_rows, prompt_rows, sft_rows, write_jsonl


def write_task_data(root: Path, n_train: int = 64, n_eval: int = 16) -> dict[str, Path]:
    held = arithmetic_problems(n_eval, 1)
    train = arithmetic_problems(n_train, 0, exclude=set(held))
    return {
        "sft_train": write_jsonl(sft_rows(train), root / "sft_train.jsonl"),
        "sft_eval": write_jsonl(sft_rows(held), root / "sft_eval.jsonl"),
        "pref_train": write_jsonl(preference_rows(train, 0), root / "pref_train.jsonl"),
        "pref_eval": write_jsonl(preference_rows(held, 1), root / "pref_eval.jsonl"),
        "prompts_train": write_jsonl(prompt_rows(train), root / "prompts_train.jsonl"),
        "prompts_eval": write_jsonl(prompt_rows(held), root / "prompts_eval.jsonl"),
    }


def run_cli(command: str, *overrides: str, config: str | None = None) -> int:
    argv = [command] + (["--config", config] if config else []) + list(overrides)
    return main(argv)


def metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(output_dir) if "loss" in r}


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((Path(output_dir) / "final").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_resume_is_exact(command: str, args, tmp_path: Path, common: list[str], stop_after: int, steps: int) -> None:
    """A run stopped after `stop_after` steps and resumed with `auto` logs the same per-step losses (1e-6) and ends
    with the same weights (1e-6) as an uninterrupted run. `args(out, *extra)` builds the overrides for one run."""
    full, split = tmp_path / "full", tmp_path / "split"
    assert main([command, *args(full, *common)]) == 0
    assert main([command, *args(split, *common, f"train.max_steps_per_run={stop_after}")]) == 0
    assert main([command, *args(split, *common, "train.resume_from_checkpoint=auto")]) == 0
    a, b = step_losses(full), step_losses(split)
    assert sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    assert max_weight_diff(final_weights(full), final_weights(split)) < 1e-6
