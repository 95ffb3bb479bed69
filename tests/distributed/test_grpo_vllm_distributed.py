"""The in-process vLLM engine under 2 training processes with DeepSpeed ZeRO-3 (CPU, gloo): each rank holds its own
engine (generation.vllm.placement: rank), every weight sync gathers the partitioned policy a bucket at a time on every
rank and each rank loads it into its engine. With generation.batch_size=1 every prompt's samples are seeded by its
global position, so the 2-process run samples, scores and trains exactly what one process with the same global batch
does, and the engines keep sampling from the current policy (the sampler-vs-trainer gap stays at float noise). With
generation.vllm.placement: node the 2 ranks share one engine, which the node's first rank starts in a process of its
own (`posttrain serve`) and syncs; the rows keep their seeds, so the run again equals the one process."""

from __future__ import annotations

import os
import re

import psutil
import pytest

from posttrain.generation.vllm_engine import vllm_available
from posttrain.demo.tasks import write_example_data
from tests.distributed.launch import launch
from tests.integration.helpers import max_weight_diff, run_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")]
REWARD = "tests.integration.test_grpo:length_reward"


def overrides(model_dir, data, out, per_device):
    return run_overrides(
        model_dir, data["prompts_train"], out, f"data.eval={data['prompts_eval']}", "train.max_steps=2",
        f"train.per_device_train_batch_size={per_device}", "train.gradient_accumulation_steps=2",
        "generation.max_completion_length=8", "generation.batch_size=1", "algo.num_generations=2",
        "algo.scale_rewards=batch", f"rewards=[{{name: '{REWARD}'}}]", "generation.engine=vllm",
        "generation.vllm.kv_cache_gb=1", "generation.sync_bucket_mb=1", learning_rate="1e-2", seed=5)


@pytest.fixture(scope="module")
def single(tiny_vllm_model_dir, tmp_path_factory):
    """One process, the 2-process runs' global batch: what they must equal."""
    tmp = tmp_path_factory.mktemp("grpo-vllm-single")
    data = write_example_data(tmp / "data", n_train=32, n_eval=5)
    run = launch(1, "grpo", overrides(tiny_vllm_model_dir, data, tmp / "single", 4), timeout=600)
    assert run.ok, run.output[-6000:]
    return data, run


def check_equals_one_process(single, two) -> None:
    two.check_world(2)
    assert two.facts["engine"] == "deepspeed-zero3"
    assert "Traceback" not in single.output + two.output, two.output[-3000:]  # vLLM ends before the groups do

    one_rows = {(r["step"], "eval" if "eval/reward" in r else "train"): r for r in single.metrics()}
    two_rows = {(r["step"], "eval" if "eval/reward" in r else "train"): r for r in two.metrics()}
    assert one_rows.keys() == two_rows.keys() == {(0, "eval"), (1, "train"), (2, "train"), (2, "eval")}
    for key, expected in one_rows.items():
        got = two_rows[key]
        for name in ("reward/mean", "reward/std", "completion_length/mean", "eval/reward", "eval/completion_length"):
            if name in expected:
                assert got[name] == pytest.approx(expected[name], abs=1e-6), (key, name)
        if key[1] == "train":
            assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5), key
            for run in (expected, got):  # synced before every generation: the engines sample from the current policy
                assert run["sampler_logprob_gap"] < 2e-3 and run["policy_lag"] == 0, run
                assert run["time/sync"] > 0 or key[0] == 1, run  # the first batch samples the starting weights
    assert one_rows[(2, "train")]["reward/mean"] != one_rows[(1, "train")]["reward/mean"]  # the policy moved
    assert max_weight_diff(single.final_weights(), two.final_weights()) < 1e-4


def test_an_engine_per_rank_under_zero3_matches_one_process(single, tiny_vllm_model_dir, tmp_path):
    data, one = single
    two = launch(2, "grpo", overrides(tiny_vllm_model_dir, data, tmp_path / "two", 2), accelerate_config="zero3",
                 timeout=600)
    check_equals_one_process(one, two)
    assert not (tmp_path / "two" / "engines").exists()  # in-process engines: no engine process, no engine log


def test_one_engine_per_node_under_zero3_matches_one_process(single, tiny_vllm_model_dir, tmp_path):
    data, one = single
    out = tmp_path / "node"
    two = launch(2, "grpo", [*overrides(tiny_vllm_model_dir, data, out, 2), "generation.vllm.placement=node"],
                 accelerate_config="zero3", timeout=600)
    check_equals_one_process(one, two)
    # one engine for the node's 2 ranks, started by rank 0 in a process of its own, gone after the run
    assert sorted(p.name for p in (out / "engines").iterdir()) == ["vllm-node0.log"]
    announced = re.findall(r"node 0: vLLM engine at (http://127\.0\.0\.1:(\d+)) for its 2 rank", two.output)
    assert len(announced) == 1, two.output[-3000:]
    log = (out / "engines" / "vllm-node0.log").read_text()
    vllm_group = int(re.search(r"process group (\d+)", log).group(1))
    with pytest.raises(ProcessLookupError):
        os.killpg(vllm_group, 0)
    port = announced[0][1]
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if port in (p.info["cmdline"] or [])]
