"""A tiny Qwen3-MoE under GRPO with routing replay and the load-balancing loss: 2 processes under ZeRO-3 (its MoE
blocks gathered as leaf modules), DDP and FSDP2, and 2 processes splitting every row (sequence parallelism), give the
losses, router metrics and weights of 1 process with the same global batch.

The setup is test_grpo_distributed's (one prompt's group per generate call, batch-scaled rewards); num_iterations=2
makes step 2 replay the routing recorded in step 1's old-policy forward. The load-balancing loss is a statistic of
each micro-batch (as in transformers and Megatron), so both runs keep micro-batches of one group (2 sequences): 1
process x 4 micro-batches, 2 data-parallel processes x 2, a sequence-parallel pair (one data rank) x 4.
"""

from __future__ import annotations

import pytest

from posttrain.demo.tasks import write_example_data
from tests.distributed.launch import ENGINE_NAMES, ENGINES, launch
from tests.distributed.test_sequence_parallel import check_sharded
from tests.integration.helpers import max_weight_diff, run_overrides

pytestmark = pytest.mark.distributed

REWARD = "tests.integration.test_grpo:length_reward"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=16, n_eval=4)


def overrides(model_dir, data, out, accumulation):
    return run_overrides(
        model_dir, data["prompts_train"], out, "train.max_steps=2", "train.per_device_train_batch_size=2",
        f"train.gradient_accumulation_steps={accumulation}", "generation.max_completion_length=8", "generation.batch_size=1",
        "algo.num_generations=2", "algo.scale_rewards=batch", "algo.num_iterations=2",
        "algo.routing_replay=old_policy", "model.router_aux_loss_coef=0.01", f"rewards=[{{name: '{REWARD}'}}]",
        learning_rate="2e-2", seed=5)


@pytest.fixture(scope="module")
def single(tiny_moe_model_dir, data, tmp_path_factory):
    result = launch(1, "grpo", overrides(tiny_moe_model_dir, data, tmp_path_factory.mktemp("one") / "run", 4))
    assert result.ok, result.output[-6000:]
    return result


@pytest.mark.parametrize("engine", ["zero3", "ddp", "fsdp2"])
def test_two_processes_match_one(tiny_moe_model_dir, data, tmp_path, single, engine):
    two = launch(2, "grpo", overrides(tiny_moe_model_dir, data, tmp_path / "two", accumulation=2),
                 hooks=["engine_facts"], **ENGINES[engine])
    assert two.ok, two.output[-6000:]
    two.check_world(2)
    assert two.facts["engine"] == ENGINE_NAMES[engine]
    leaves = ["Qwen3MoeSparseMoeBlock"] if engine == "zero3" else []
    assert [r["z3_leaf_modules"] for r in two.hook_report("engine_facts")] == [leaves] * 2
    check_same_run(single, two, engine)


def test_sequence_parallel_pair_matches_one(tiny_moe_model_dir, data, tmp_path):
    """Each rank's routers see half of every row: the load-balancing loss is taken over the group's router logits
    gathered into whole rows (its gradient summed over the pair is one process's), and the routing recorded on both
    halves is gathered, then each rank replays its half. 9 completion tokens make rows of 27 tokens, which the pair
    pads to 28 and cuts back to 27 in what it gathers (the shared runs' 26 would not show a missing cut)."""
    odd = ["generation.max_completion_length=9"]
    single = launch(1, "grpo", overrides(tiny_moe_model_dir, data, tmp_path / "one", 4) + odd)
    assert single.ok, single.output[-6000:]
    out = tmp_path / "sp"
    pair = launch(2, "grpo", overrides(tiny_moe_model_dir, data, out, 4) + odd + ["train.sequence_parallel_size=2"],
                  hooks=["sp_facts"], env={"POSTTRAIN_HOOK_OUT": str(out / "hooks")})
    assert pair.ok, pair.output[-6000:]
    pair.check_world(2)
    check_sharded(pair)
    check_same_run(single, pair, "sequence_parallel_size=2")


def check_same_run(single, two, what: str) -> None:
    one_rows, two_rows = ({r["step"]: r for r in run.metrics()} for run in (single, two))
    assert sorted(one_rows) == sorted(two_rows) == [1, 2]
    assert one_rows[2]["routing_agreement"] < 1.0  # step 2 replayed routing its router would not have chosen
    for step, expected in one_rows.items():
        for name in ("loss", "router_aux_loss", "routing_agreement", "reward/mean"):
            assert two_rows[step][name] == pytest.approx(expected[name], abs=1e-5), (what, step, name)
    assert max_weight_diff(single.final_weights(), two.final_weights()) < 1e-4
