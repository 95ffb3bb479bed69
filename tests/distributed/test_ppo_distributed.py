"""PPO from the shipped recipes/ppo.yaml (tiny model, a few overrides) on 2 CPU processes (gloo) under DDP, ZeRO-2
and ZeRO-3 equals one process with the same global batch: the same samples, policy and critic losses, and actor AND
critic weights within 1e-5.

With generation.batch_size=1 each generate call is seeded by its prompt's global position, so completions do not
depend on the world size; whitening and the KL controller use statistics summed over ranks; each trained role's loss
is divided by its own global token count (the loop), so accumulation and ranks are invisible.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.demo.tasks import write_example_data
from tests.distributed.launch import launch
from tests.integration.helpers import max_weight_diff, run_overrides

pytestmark = pytest.mark.distributed

REWARD = "tests.integration.test_ppo:length_reward"
RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "ppo.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=4)


def overrides(tiny_model_dir, data, out, per_device, *extra):
    return run_overrides(
        tiny_model_dir, data["prompts_train"], out, "data.eval=null", "train.max_steps=2",
        f"train.per_device_train_batch_size={per_device}", "train.gradient_accumulation_steps=2",
        "generation.max_completion_length=8", "generation.batch_size=1",
        "algo.kl_target=0.01", "algo.critic_learning_rate=3e-3", f"rewards=[{{name: '{REWARD}'}}]",
        *extra, learning_rate="1e-3", seed=5,
    )


def critic_weights(output_dir):
    from safetensors.torch import load_file

    return {k: v for f in sorted((output_dir / "final-critic").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def single(tiny_model_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    result = launch(1, "ppo", overrides(tiny_model_dir, data, out, per_device=4), config=RECIPE)
    assert result.ok, result.output[-6000:]
    return result


@pytest.mark.parametrize("engine, accelerate_config", [("ddp", None), ("deepspeed-zero2", "zero2"),
                                                       ("deepspeed-zero3", "zero3")])
def test_two_processes_match_one(tiny_model_dir, data, tmp_path, single, engine, accelerate_config):
    result = launch(2, "ppo", overrides(tiny_model_dir, data, tmp_path / "run", per_device=2),
                    accelerate_config=accelerate_config, config=RECIPE)
    result.check_world(2)
    assert result.facts["engine"] == engine
    one, two = single.metrics(), result.metrics()
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for expected, got in zip(one, two):
        assert got["reward/mean"] == pytest.approx(expected["reward/mean"], abs=1e-6)
        for name in ("loss", "loss/critic", "kl", "kl_coef", "values/mean"):
            assert got[name] == pytest.approx(expected[name], abs=1e-5), (engine, expected["step"], name)
    assert max_weight_diff(single.final_weights(), result.final_weights()) < 1e-5
    critic_one, critic_two = critic_weights(single.output_dir), critic_weights(result.output_dir)
    assert critic_one and max_weight_diff(critic_one, critic_two) < 1e-5


def test_zero3_partitions_all_four_models(tiny_model_dir, data, tmp_path):
    """Under ZeRO-3 policy, critic, reference and reward model are all partitioned over the ranks; the frozen two
    hold no optimiser and, with algo.ref_offload / algo.reward_model_offload, live in CPU memory (DeepSpeed's
    parameter offload)."""
    from transformers import AutoTokenizer

    from tests.unit.test_rewards_reward_model import save_classifier

    rm = save_classifier(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir))
    out = tmp_path / "run"
    result = launch(2, "ppo", overrides(tiny_model_dir, data, out, 2, "train.max_steps=1",
                                        f"rewards=[{{name: reward_model, kwargs: {{path: '{rm}'}}}}]",
                                        "algo.ref_offload=true", "algo.reward_model_offload=true"),
                    accelerate_config="zero3", hooks=["role_facts"], env={"POSTTRAIN_HOOK_OUT": str(out / "hooks")},
                    config=RECIPE)
    assert result.ok, result.output[-6000:]
    ranks = result.hook_report("role_facts")
    assert len(ranks) == 2
    for roles in ranks:
        assert set(roles) == {"policy", "critic", "reference", "reward_model"}, roles
        for name, facts in roles.items():
            assert facts["local_fraction"] < 0.6, (name, facts)  # about half of every model on each rank
            frozen = facts["optimizer"] in (None, "DeepSpeedZeRoOffload")  # no optimiser state
            assert frozen == (name in ("reference", "reward_model")), (name, facts)
        for name in ("reference", "reward_model"):
            assert roles[name]["placement"] == "offload" and roles[name]["offload_param"] == "cpu", roles[name]
    assert all(r["reward/mean"] == r["reward/mean"] for r in result.metrics())  # scored (not NaN)
