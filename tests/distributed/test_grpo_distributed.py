"""GRPO on 2 CPU processes (gloo) under DDP, ZeRO-2 and ZeRO-3 (generation with gathered ZeRO-3 parameters) gives
the same samples, losses, held-out figures and weights as one process with the same global batch; so does ZeRO-3
with padding-free rows in token-budget micro-batches.

With generation.batch_size=1 every generate call holds one prompt's group, seeded by the prompt's global position,
so the completions do not depend on how prompts are spread over ranks; rewards are gathered for advantages
(scale_rewards=batch uses the std of the whole step), and the loop's global normaliser does the rest.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import launch
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import max_weight_diff, run_overrides

pytestmark = pytest.mark.distributed

REWARD = "tests.integration.test_grpo:length_reward"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=5)  # 5: the eval shares are 3 and 2


def overrides(tiny_model_dir, data, out, per_device, *extra):
    return run_overrides(
        tiny_model_dir, data["prompts_train"], out, f"data.eval={data['prompts_eval']}", "train.max_steps=2",
        f"train.per_device_train_batch_size={per_device}", "train.gradient_accumulation_steps=2",
        "generation.max_completion_length=8", "generation.batch_size=1",
        "algo.num_generations=2", "algo.beta=0.05", "algo.scale_rewards=batch",
        f"rewards=[{{name: '{REWARD}'}}]", *extra, learning_rate="1e-3", seed=5,
    )


SHORT = ["data.max_prompt_length=24"]  # rows of at most 32 tokens
PACKED_BUDGET = ["data.packing=true", "train.max_tokens_per_microbatch=32"]  # about one row per micro-batch


@pytest.fixture(scope="module")
def single(tiny_model_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    result = launch(1, "grpo", overrides(tiny_model_dir, data, out, per_device=4))
    assert result.ok, result.output[-6000:]
    assert any(loss != 0 for loss in result.losses().values())  # the comparison below has something to compare
    return result


@pytest.fixture(scope="module")
def single_short(tiny_model_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single_short") / "run"
    result = launch(1, "grpo", overrides(tiny_model_dir, data, out, 4, *SHORT))
    assert result.ok, result.output[-6000:]
    return result


@pytest.mark.parametrize("engine, accelerate_config", [("ddp", None), ("deepspeed-zero2", "zero2"),
                                                       ("deepspeed-zero3", "zero3"), ("fsdp2", "fsdp2")])
def test_two_processes_match_one(tiny_model_dir, data, tmp_path, single, engine, accelerate_config):
    result = launch(2, "grpo", overrides(tiny_model_dir, data, tmp_path / "run", per_device=2),
                    accelerate_config=accelerate_config)
    check_two_match_one(result, single, engine)


@pytest.mark.parametrize("engine, accelerate_config", [("deepspeed-zero3", "zero3")])
def test_packed_budget_two_processes_match_one(tiny_model_dir, data, tmp_path, single_short, engine,
                                               accelerate_config):
    """Padding-free rows regrouped into micro-batches of about one row: ranks with fewer micro-batches run fillers
    so ZeRO-3's collective forwards stay in step; the padded one-process run's samples, losses and weights."""
    result = launch(2, "grpo", overrides(tiny_model_dir, data, tmp_path / "run", 2, *SHORT, *PACKED_BUDGET),
                    accelerate_config=accelerate_config)
    check_two_match_one(result, single_short, engine)


def check_two_match_one(result, single, engine):
    result.check_world(2)
    assert result.facts["engine"] == engine
    one = {(r["step"], "eval" if "eval/reward" in r else "train"): r for r in single.metrics()}
    two = {(r["step"], "eval" if "eval/reward" in r else "train"): r for r in result.metrics()}
    assert one.keys() == two.keys() == {(0, "eval"), (1, "train"), (2, "train"), (2, "eval")}
    for key, expected in one.items():
        got = two[key]
        for name in ("reward/mean", "reward/std", "completion_length/mean", "eval/reward", "eval/completion_length"):
            if name in expected:
                assert got[name] == pytest.approx(expected[name], abs=1e-6), (engine, key, name)
        for name in ("loss", "kl", "eval/accuracy"):
            if name in expected:
                assert got[name] == pytest.approx(expected[name], abs=1e-5), (engine, key, name)
    assert max_weight_diff(single.final_weights(), result.final_weights()) < 1e-4


@pytest.mark.parametrize("accelerate_config", ["zero3", "fsdp2"])
def test_ranks_generating_different_lengths_finish_together(tiny_model_dir, data, tmp_path, accelerate_config):
    """Rank 0's completions all stop after one token, rank 1's run on: the sharded policy still generates on both
    (transformers keeps the ranks stepping together) and the run finishes. Under FSDP2 the parameters are gathered
    once per generate call: at most one all-gather per sharded module, not one per module per decoding step."""
    out = tmp_path / "run"
    result = launch(2, "grpo", overrides(tiny_model_dir, data, out, per_device=2), accelerate_config=accelerate_config,
                    hooks=["uneven_generation"], env={"POSTTRAIN_HOOK_OUT": str(out / "hooks")}, timeout=150)
    assert result.ok, result.output[-4000:]
    result.check_world(2)
    ranks = result.hook_report("uneven_generation")
    assert ranks[0]["longest"] == 1 and ranks[1]["longest"] > 1, ranks
    if accelerate_config == "fsdp2":  # gathering per forward made 16-17 all-gathers per call here
        assert ranks[0]["gathers"] == ranks[1]["gathers"], ranks
        assert all(0 < n <= ranks[0]["fsdp_modules"] for n in ranks[0]["gathers"]), ranks


def test_dynamic_sampling_keeps_the_ranks_in_step_under_zero3(tiny_model_dir, data, tmp_path):
    """algo.dynamic_sampling on 2 processes under ZeRO-3 (generation gathers parameters: a collective): each rank
    fills its own share and both draw again while either is short, so the run finishes; every group trained varies,
    and the counts are the step's, both ranks summed."""
    out = tmp_path / "run"
    args = overrides(tiny_model_dir, data, out, per_device=2) + [
        "algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.metric=reward",
        "algo.dynamic_sampling.max_batches=0", "train.max_steps=3", "data.eval=null",
        "rewards=[{name: 'tests.integration.test_dynamic_sampling:first_letter_reward'}]"]
    result = launch(2, "grpo", args, accelerate_config="zero3", timeout=300)
    assert result.ok, result.output[-6000:]
    rows = [r for r in result.metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # 4 prompts a step (2 ranks x 2), drawn 4 at a time
        assert r["frac_reward_zero_std"] == 0 and r["dynamic_sampling/groups_drawn"] == 4 * r["dynamic_sampling/batches"]
        assert r["dynamic_sampling/groups_kept"] >= 4 and r["dynamic_sampling/filler_groups"] == 0
    assert any(r["dynamic_sampling/batches"] > 1 for r in rows), rows
