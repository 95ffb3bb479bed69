"""One SFT recipe under DDP, DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 on 2 CPU processes (gloo).

For each engine: the run really has 2 processes; its per-step losses and final weights equal those of 1 process x
micro-batch 4 and of 1 process x accumulation 4 (1e-5, fp32), as do those of 1 process x accumulation 4 under the
engine itself; replicas stay identical and sharded engines really shard (ZeRO-3 from construction, through
zero.Init); final/ holds exactly the gathered parameters, and a weight sync's buckets (what vLLM engines and servers
are sent) hold exactly final/; and resuming from the step-2 checkpoint under the same
launch gives the same next losses and weights.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import ENGINE_NAMES, ENGINES, SHARDED_PARAMETERS, launch
from tests.distributed.recipes import STEPS, TWO_PROCESS_SPLIT, sft_overrides
from tests.integration.helpers import ONE_PROCESS_SPLITS, max_weight_diff

pytestmark = pytest.mark.distributed


def test_one_process_splits_agree(one_process):
    (losses_a, weights_a), (losses_b, weights_b) = one_process["mb4"], one_process["mb1_acc4"]
    assert sorted(losses_a) == list(range(1, STEPS + 1))
    for step in losses_a:
        assert losses_b[step] == pytest.approx(losses_a[step], abs=1e-5)
    assert max_weight_diff(weights_a, weights_b) < 1e-5


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_processes_match_one(engine, one_process, two_process_run):
    run = two_process_run(engine)
    run.check_world(2)
    assert run.facts["engine"] == ENGINE_NAMES[engine]
    assert run.facts["global_batch"] == "4" and run.facts["accumulation"] == "2" and run.facts["per_device_batch"] == "1"
    losses, weights = run.losses(), run.final_weights()
    for name, (ref_losses, ref_weights) in one_process.items():
        assert sorted(losses) == sorted(ref_losses)
        for step, value in ref_losses.items():
            assert losses[step] == pytest.approx(value, abs=1e-5), (engine, name, step, losses, ref_losses)
        assert max_weight_diff(ref_weights, weights) < 1e-5, (engine, name)
    last = run.metrics()[-1]
    assert {"peak_memory_mb/rank0", "peak_memory_mb/rank1"} <= set(last), last
    assert last["peak_memory_mb"] == max(last["peak_memory_mb/rank0"], last["peak_memory_mb/rank1"])


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ddp"])  # 1 process "ddp" is the plain run above
def test_one_process_under_the_engine_matches(engine, one_process, tiny_model_dir, task_data, tmp_path):
    """1 process x micro-batch 1 x accumulation 4 with the engine on (one GPU with ZeRO-3 offload, say)."""
    run = launch(1, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *ONE_PROCESS_SPLITS["mb1_acc4"]),
                 **ENGINES[engine])
    run.check_world(1)
    assert run.facts["engine"] == ENGINE_NAMES[engine]
    ref_losses, ref_weights = one_process["mb4"]
    for step, value in ref_losses.items():
        assert run.losses()[step] == pytest.approx(value, abs=1e-5), (engine, step)
    assert max_weight_diff(ref_weights, run.final_weights()) < 1e-5


@pytest.mark.parametrize("engine", list(ENGINES))
def test_parameters_are_replicated_or_sharded_and_exported_whole(engine, two_process_run):
    facts = two_process_run(engine).hook_report("engine_facts")
    assert len(facts) == 2, "one report per rank"
    for rank in facts:
        if engine in SHARDED_PARAMETERS:
            assert 0.45 < rank["local_fraction"] < 0.55, rank
        else:
            assert rank["local_fraction"] == 1.0, rank
        assert rank["created_partitioned"] is (engine == "zero3"), rank  # zero.Init at from_pretrained
        assert rank["checksums"][0] == rank["checksums"][1], rank  # every rank sees the same full parameters
        assert rank["exported_missing"] == [] and rank["exported_max_diff"] == 0.0, rank
        assert rank["exported_bytes"] == rank["parameter_bytes"] > 100_000, rank  # real tensors, not placeholders
        # a weight sync gathers the same tensors bucket by bucket (ZeRO-3: GatheredParameters, FSDP2: full_tensor)
        assert rank["sync_missing"] == rank["sync_extra"] == [] and rank["sync_max_diff"] == 0.0, rank
        assert rank["sync_buckets"] > 1, rank


@pytest.mark.parametrize("engine", list(ENGINES))
def test_resume_continues_exactly(engine, two_process_run, tiny_model_dir, task_data, tmp_path):
    full = two_process_run(engine)
    assert full.ok, full.output[-4000:]
    split = full.copy_at(2, tmp_path / "split")
    resumed = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, split, *TWO_PROCESS_SPLIT,
                                             "train.resume_from_checkpoint=auto"), **ENGINES[engine])
    resumed.check_world(2)
    assert resumed.facts["resumed_from"].endswith("step-2")
    a, b = full.losses(), resumed.losses()
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):
        assert b[step] == pytest.approx(a[step], abs=1e-6), (engine, step, a, b)
    assert max_weight_diff(full.final_weights(), resumed.final_weights()) < 1e-6
