"""A rank killed with SIGKILL mid-run (issue #15): the other stops by itself within a bounded time, naming the lost
rank, and the run resumed with `auto` ends exactly as the uninterrupted one."""

from __future__ import annotations

import time

import pytest

from posttrain.rundir.files import verify
from tests.distributed.launch import ENGINES, launch
from tests.distributed.recipes import TWO_PROCESS_SPLIT, sft_overrides
from tests.integration.helpers import max_weight_diff

pytestmark = pytest.mark.distributed


def test_a_killed_rank_stops_the_run_with_its_name_and_resume_is_exact(two_process_run, tiny_model_dir, task_data,
                                                                       tmp_path):
    reference = two_process_run("zero3")
    assert reference.ok, reference.output[-3000:]
    overrides = sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *TWO_PROCESS_SPLIT, "train.ddp_timeout=900")
    killed_at = tmp_path / "killed-at"
    killed = launch(2, "sft", overrides, hooks=["fail_rank"], timeout=300, **ENGINES["zero3"],
                    env={"POSTTRAIN_TEST_FAIL_HOW": "kill", "POSTTRAIN_TEST_FAIL_CALL": "5",  # in step 3
                         "POSTTRAIN_TEST_KILLED_AT": str(killed_at)})
    stopped_after = time.time() - float(killed_at.read_text())
    assert not killed.ok and "killed after" not in killed.output
    assert "posttrain: error (rank 0): lost rank 1" in killed.output, killed.output[-4000:]
    assert "Traceback" not in killed.output.split("posttrain: error (rank 0)")[0][-2000:]
    assert stopped_after < 60, f"{stopped_after:.0f} s: rank 0 waited for the collective timeout (900 s)"
    assert verify(tmp_path / "run" / "checkpoints" / "step-2") is None and not (tmp_path / "run" / "final").exists()

    resumed = launch(2, "sft", [*overrides, "train.resume_from_checkpoint=auto"], **ENGINES["zero3"])
    resumed.check_world(2)
    assert resumed.losses() == pytest.approx(reference.losses(), abs=1e-6)
    assert max_weight_diff(resumed.final_weights(), reference.final_weights()) < 1e-6


def test_a_nan_gradient_under_deepspeed_stops_at_its_step(tiny_model_dir, task_data, tmp_path):
    """A finite loss with a NaN gradient under ZeRO-3: DeepSpeed skips its update and reports the norm as inf, and the
    step's guard stops the run there (train.nonfinite=stop) with nothing of the step saved."""
    out = tmp_path / "run"
    result = launch(1, "sft", sft_overrides(tiny_model_dir, task_data, out, "train.gradient_accumulation_steps=2"),
                    hooks=["fail_rank"], **ENGINES["zero3"],
                    env={"POSTTRAIN_TEST_FAIL_HOW": "nan_grad", "POSTTRAIN_TEST_FAIL_RANK": "0",
                         "POSTTRAIN_TEST_FAIL_CALL": "3"})  # in step 2
    assert result.returncode == 1, result.output[-3000:]
    assert "posttrain: error: step 2: the loss is finite and the gradient norm is inf" in result.output, \
        result.output[-3000:]
    assert not (out / "final").exists() and not (out / "checkpoints" / "step-2").exists()
