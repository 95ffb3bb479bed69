"""train.shared_prefix on 2 CPU processes (gloo, DDP): GRPO with a reference and two iterations a batch (old-policy
log-probs) gives the same losses, grad norms, KL and final weights with each prompt computed once per group as with
every row computed alone, and both ranks log the saving. The first step's shared-vs-plain check runs on each rank."""

from __future__ import annotations

import pytest

from tests.distributed.launch import launch
from tests.integration.helpers import assert_same_update, max_weight_diff, run_overrides

pytestmark = pytest.mark.distributed

REWARD = "tests.integration.test_grpo:length_reward"


def run(tiny_model_dir, task_data, out, mode):
    args = run_overrides(
        tiny_model_dir, task_data["prompts_train"], out, "train.max_steps=2", "train.per_device_train_batch_size=4",
        "train.gradient_accumulation_steps=1", "generation.max_completion_length=8", "generation.batch_size=1",
        "algo.num_generations=4", "algo.beta=0.05", "algo.num_iterations=2", f"rewards=[{{name: '{REWARD}'}}]",
        f"train.shared_prefix={mode}", learning_rate="1e-3", seed=5)
    result = launch(2, "grpo", args)
    assert result.ok, result.output[-6000:]
    result.check_world(2)
    return result


def test_two_processes_shared_equals_plain(tiny_model_dir, task_data, tmp_path):
    shared, plain = (run(tiny_model_dir, task_data, tmp_path / mode, mode) for mode in ("true", "false"))
    assert "the first step's shared and plain forwards agree" in shared.output
    rows = [[r for r in result.metrics() if "loss" in r] for result in (shared, plain)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [1, 2]
    for a, b in zip(*rows):
        for key in ("loss", "grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (key, a["step"], a[key], b[key])
        # each rank's group of 4 rows computes its prompt once (measured: 50 tokens a rank, not 104)
        assert a["tokens/forwarded"] < b["tokens/forwarded"] and b["shared_prefix/saved_fraction"] == 0.0
        assert a["shared_prefix/saved_fraction"] > 0.3, a
    assert_same_update(shared.final_weights(), plain.final_weights())
    assert max_weight_diff(shared.final_weights(), plain.final_weights()) < 1e-5  # measured 2.9e-6 (Adam, lr 1e-3)
