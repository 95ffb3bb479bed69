"""Sequence parallelism (train.sequence_parallel_size=2) on 2 CPU processes over gloo: each row split in two halves,
DeepSpeed's Ulysses attention exchanging them. The pair trains on the same rows, so SP=2 is compared with ONE
process on the same global batch: the same losses, gradient norms and weights (SFT and GRPO; SFT with gradient
checkpointing too), resumed runs equal uninterrupted ones, and ZeRO-3 shards the weights under it. The SFT rows (micro-batch 1) have odd and even lengths,
so rows padded to a multiple of 2 are in every run.
"""

from __future__ import annotations

import pytest

from posttrain.demo.tasks import write_example_data
from tests.distributed.launch import launch
from tests.distributed.recipes import sft_overrides
from tests.integration.helpers import (ONE_PROCESS_SPLITS, assert_same_update, max_weight_diff, run_overrides,
                                      step_losses)

pytestmark = pytest.mark.distributed

SP = ["train.sequence_parallel_size=2"]
MB1_ACC4 = ONE_PROCESS_SPLITS["mb1_acc4"]  # the shared one-process SFT run's split (conftest.one_process)


def check_same_steps(one: list[dict], two: list[dict], loss_tol: float = 1e-5) -> None:
    """Per-step loss and grad norm (and SFT's mean_token_accuracy) of an SP=2 run against one process."""
    one = {r["step"]: r for r in one if "loss" in r}
    two = {r["step"]: r for r in two if "loss" in r}
    assert one.keys() == two.keys() and one
    for step, expected in one.items():
        assert two[step]["loss"] == pytest.approx(expected["loss"], abs=loss_tol), step
        assert two[step]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), step
        if "mean_token_accuracy" in expected:  # SFT: the argmax of each slice's rows, gathered over the group
            assert two[step]["mean_token_accuracy"] == pytest.approx(expected["mean_token_accuracy"], abs=1e-6), step


@pytest.fixture(scope="module")
def sft_sp(tiny_model_dir, task_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp-two") / "run"
    result = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, out, *MB1_ACC4, *SP), hooks=["sp_facts"],
                    env={"POSTTRAIN_HOOK_OUT": str(out / "hooks")})
    assert result.ok, result.output[-4000:]
    result.check_world(2)
    return result


def check_sharded(result) -> None:
    """Both ranks ran Ulysses attention on half rows, some of them padded (an odd row length)."""
    ranks = [r for r in result.hook_report("sp_facts")]
    assert len(ranks) == 2 and all(r["calls"] > 0 for r in ranks), ranks
    assert ranks[0]["local_lengths"] == ranks[1]["local_lengths"], ranks
    assert all(g == 2 * n for g, n in zip(ranks[0]["global_lengths"], ranks[0]["local_lengths"]))
    assert all(r["odd_rows"] > 0 for r in ranks), ranks


def test_sft_sp2_matches_one_process(one_process, sft_sp):
    check_sharded(sft_sp)
    assert sft_sp.facts["sequence_parallel"] == "2"  # the start line says so
    check_same_steps(one_process.metrics["mb1_acc4"], sft_sp.metrics())
    assert_same_update(one_process["mb1_acc4"][1], sft_sp.final_weights())
    assert sft_sp.trainer_state()["state"]["samples_seen"] == 4 * len(sft_sp.losses())  # the pair counts its rows once


def test_sft_sp2_gradient_checkpointing_matches_one_process(tiny_model_dir, task_data, tmp_path, one_process):
    """Each layer's forward recomputed in the backward runs Ulysses over the same half rows as its first forward
    (a recomputation with the model's own attention would make whole-row tensors: torch's CheckpointError), and
    recomputing changes nothing: the same update as the one process without checkpointing."""
    out = tmp_path / "run"
    result = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, out, *MB1_ACC4, *SP,
                                            "train.gradient_checkpointing=true"),
                    hooks=["sp_facts"], env={"POSTTRAIN_HOOK_OUT": str(out / "hooks")})
    assert result.ok, result.output[-4000:]
    check_sharded(result)
    check_same_steps(one_process.metrics["mb1_acc4"], result.metrics())
    assert_same_update(one_process["mb1_acc4"][1], result.final_weights())


def test_sft_sp2_resume_matches_uninterrupted(tiny_model_dir, task_data, tmp_path, sft_sp):
    """Resumed from the SP run's step-2 checkpoint, the last two steps are the uninterrupted run's."""
    out = sft_sp.copy_at(2, tmp_path / "run")
    result = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, out, *MB1_ACC4, *SP,
                                            "train.resume_from_checkpoint=auto"))
    assert result.ok, result.output[-4000:]
    full = sft_sp.losses()
    resumed = step_losses(out)
    assert sorted(resumed) == sorted(full)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6)
    assert max_weight_diff(sft_sp.final_weights(), result.final_weights()) < 1e-6


def test_sft_sp2_under_zero3(tiny_model_dir, task_data, tmp_path, one_process):
    result = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *MB1_ACC4, *SP),
                    accelerate_config="zero3")
    assert result.ok, result.output[-4000:]
    result.check_world(2)
    assert result.facts["engine"] == "deepspeed-zero3"
    check_same_steps(one_process.metrics["mb1_acc4"], result.metrics())
    assert_same_update(one_process["mb1_acc4"][1], result.final_weights())


def grpo_overrides(model_dir, data, out, *extra):
    return run_overrides(
        model_dir, data["prompts_train"], out, "train.max_steps=2", "train.per_device_train_batch_size=4",
        "train.gradient_accumulation_steps=1", "generation.max_completion_length=9", "generation.batch_size=1",
        "algo.num_generations=2", "algo.beta=0.05", "algo.scale_rewards=batch",
        "rewards=[{name: 'tests.integration.test_grpo:length_reward'}]", *extra, learning_rate="1e-3", seed=5)


def test_grpo_sp2_matches_one_process(tiny_model_dir, tmp_path):
    """Policy, old-policy and reference forwards sharded; generation is not (each prompt's group is seeded by its
    position, so the pair and the single process sample the same completions)."""
    data = write_example_data(tmp_path / "data", n_train=16, n_eval=2)
    single = launch(1, "grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "one"))
    assert single.ok, single.output[-4000:]
    result = launch(2, "grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "two", *SP))
    assert result.ok, result.output[-4000:]
    result.check_world(2)
    one, two = single.metrics(), result.metrics()
    check_same_steps(one, two)
    for a, b in zip(one, two):
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5)
    assert max_weight_diff(single.final_weights(), result.final_weights()) < 1e-4
