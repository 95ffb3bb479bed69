"""train.shared_prefix end to end on the tiny model (CPU, fp32): GRPO with a reference, old-policy log-probs and a
token budget, and DPO, give the same losses, grad norms and final weights (DPO: reward margins too) with each prompt
computed once per micro-batch as with every row computed alone, and log the saving (tokens/forwarded,
shared_prefix/saved_fraction). tests/distributed/test_shared_prefix_distributed.py compares GRPO's KL over 2 ranks."""

from __future__ import annotations

import pytest

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import BATCH_4, assert_same_update, final_weights, metrics, run_cli, run_overrides

HERE = "tests.integration.test_grpo"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=6)


def assert_same_run(shared_dir, plain_dir, keys):
    shared, plain = metrics(shared_dir), metrics(plain_dir)
    assert [r["step"] for r in shared] == [r["step"] for r in plain]
    for a, b in zip(shared, plain):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a["step"], a[key], b[key])
        assert a["tokens/forwarded"] < b["tokens/forwarded"]  # the prompts were computed once per micro-batch
        assert a["shared_prefix/saved_fraction"] > 0.25 and b["shared_prefix/saved_fraction"] == 0.0
    assert_same_update(final_weights(shared_dir), final_weights(plain_dir))


def test_grpo_with_reference_old_policy_and_token_budget_equals_the_plain_run(tiny_model_dir, data, tmp_path):
    def run(name, mode):
        out = tmp_path / name
        assert run_cli("grpo", *run_overrides(
            tiny_model_dir, data["prompts_train"], out, "train.max_steps=4", "train.per_device_train_batch_size=4",
            "train.gradient_accumulation_steps=2", "generation.max_completion_length=8", "algo.num_generations=4",
            "algo.beta=0.1", "algo.num_iterations=2", "data.max_prompt_length=48", "train.max_tokens_per_microbatch=80",
            f"rewards=[{{name: '{HERE}:length_reward'}}]", f"train.shared_prefix={mode}",
            learning_rate="1e-3")) == 0
        return out

    # kl and clip_fraction are means over the step's micro-batches, and the budget cuts the step differently when a
    # prompt's rows go together (train/micro_batches.prompt_units): the loss, grad norm and weights are split-invariant
    assert_same_run(run("shared", "true"), run("plain", "false"), ["loss", "grad_norm"])


def test_dpo_equals_the_plain_run(tiny_model_dir, data, tmp_path):
    def run(name, mode):
        out = tmp_path / name
        assert run_cli("dpo", *run_overrides(tiny_model_dir, data["pref_train"], out, *BATCH_4, "train.max_steps=3",
                                             f"train.shared_prefix={mode}")) == 0
        return out

    assert_same_run(run("shared", "true"), run("plain", "false"), ["loss", "grad_norm", "rewards/margins"])
