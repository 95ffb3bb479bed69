"""A vision-language model on 2 CPU processes (gloo): SFT and DPO with images under DDP and DeepSpeed ZeRO-3 give the
losses and weights of one process with the same global batch (2 processes x micro-batch 1 x accumulation 2 == 1
process x micro-batch 4). Each rank builds its micro-batches' pixel tensors from its own rows; under ZeRO-3 the vision
tower is partitioned like the rest. Three steps each, on the shipped shapes set."""

from __future__ import annotations

import pytest

from tests.distributed.launch import ENGINE_NAMES, ENGINES, launch
from tests.integration.helpers import assert_same_update, final_weights, metrics, run_cli, run_overrides

pytestmark = pytest.mark.distributed

STEPS = 3
ONE = ["train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=1"]
TWO = ["train.per_device_train_batch_size=1", "train.gradient_accumulation_steps=2"]
FILES = {"sft": "sft_train.jsonl", "dpo": "dpo_train.jsonl"}


def overrides(tiny_vlm_dir, shapes_dir, command, out, *extra):
    return run_overrides(tiny_vlm_dir, shapes_dir / FILES[command], out, f"train.max_steps={STEPS}",
                         "data.max_length=128", *extra)


@pytest.mark.parametrize("command", ["sft", "dpo"])
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_two_processes_equal_one(tiny_vlm_dir, shapes_dir, tmp_path, command, engine):
    single = tmp_path / "one"
    assert run_cli(command, *overrides(tiny_vlm_dir, shapes_dir, command, single, *ONE)) == 0
    result = launch(2, command, overrides(tiny_vlm_dir, shapes_dir, command, tmp_path / "two", *TWO),
                    **ENGINES[engine])
    assert result.ok, result.output[-3000:]
    result.check_world(2)
    assert result.facts["engine"] == ENGINE_NAMES[engine]
    one, two = metrics(single), result.metrics()
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-5, abs=1e-5), (engine, a, b)
    assert_same_update(final_weights(single), result.final_weights())
