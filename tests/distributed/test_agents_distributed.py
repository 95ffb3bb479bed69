"""Multi-turn GRPO (tools + environment, hf engine) on 2 CPU processes under DDP gives the same trajectories,
losses and weights as 1 process with gradient accumulation 2.

generation.batch_size=1: each prompt's group takes its turns in engine calls of its own, seeded by the prompt's
global position and the turn, so a trajectory does not depend on which rank samples it.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import launch
from tests.integration.helpers import max_weight_diff
from tests.integration.test_agents import base

pytestmark = pytest.mark.distributed


def test_two_processes_match_one_with_accumulation(tiny_model_dir, tmp_path):
    from posttrain.demo.tasks import write_example_data

    data = write_example_data(tmp_path / "data", n_train=16, n_eval=2)
    common = ["train.per_device_train_batch_size=2", "generation.batch_size=1", "algo.scale_rewards=batch"]
    one = launch(1, "grpo", base(tiny_model_dir, data, tmp_path / "one", *common,
                                 "train.gradient_accumulation_steps=2"))
    assert one.ok, one.output[-6000:]
    two = launch(2, "grpo", base(tiny_model_dir, data, tmp_path / "two", *common))
    assert two.ok, two.output[-6000:]
    two.check_world(2)
    a, b = {r["step"]: r for r in one.metrics()}, {r["step"]: r for r in two.metrics()}
    assert sorted(a) == sorted(b) == [1, 2]
    for step in a:
        for name in ("reward/mean", "reward/std", "completion_length/mean", "turns/mean", "tools/calls",
                     "rewards/environment/mean"):
            assert b[step][name] == pytest.approx(a[step][name], abs=1e-6), (step, name)
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-5), step
    assert any(r["loss"] != 0 for r in a.values())
    assert max_weight_diff(one.final_weights(), two.final_weights()) < 1e-4
