"""Everything about launching besides the four engines' equivalence (test_engines.py): the other shipped configs
(ZeRO-1, CPU offload), TRL-style accelerate configs used unchanged, contradictions stopping at start-up, a failing
rank ending the whole run, two nodes, and resuming with a different number of processes."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.distributed.launch import ENGINE_NAMES, ENGINES, launch
from tests.distributed.recipes import STEPS, TWO_PROCESS_SPLIT, sft_overrides
from tests.integration.helpers import ONE_PROCESS_SPLITS, max_weight_diff, run_cli, step_losses

pytestmark = pytest.mark.distributed


def assert_matches_one_process(run, one_process, tolerance=1e-5):
    ref_losses, ref_weights = one_process["mb4"]
    losses = run.losses()
    assert sorted(losses) == sorted(ref_losses)
    for step, value in ref_losses.items():
        assert losses[step] == pytest.approx(value, abs=tolerance), (step, losses, ref_losses)
    assert max_weight_diff(ref_weights, run.final_weights()) < tolerance


@pytest.mark.parametrize("config, engine, offload", [
    ("zero1", "deepspeed-zero1", "none"),
    ("zero2_offload", "deepspeed-zero2", "optimizer"),
    ("zero3_offload", "deepspeed-zero3", "optimizer,param"),
])
def test_zero1_and_offload_configs(config, engine, offload, tiny_model_dir, task_data, one_process, tmp_path):
    run = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *TWO_PROCESS_SPLIT),
                 accelerate_config=config)
    run.check_world(2)
    assert (run.facts["engine"], run.facts["offload"]) == (engine, offload)
    assert_matches_one_process(run, one_process)  # DeepSpeed's CPU Adam included


def trl_style_config(kind: str) -> dict:
    """An accelerate config as `accelerate config` writes it and TRL ships it (bf16, 8 processes, use_cpu false)."""
    common = {"compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "machine_rank": 0,
              "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1, "num_processes": 8,
              "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
              "tpu_use_sudo": False, "use_cpu": False}
    if kind == "zero3":
        return {**common, "distributed_type": "DEEPSPEED", "deepspeed_config": {
            "deepspeed_multinode_launcher": "standard", "offload_optimizer_device": "none", "offload_param_device": "none",
            "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}}
    return {**common, "distributed_type": "FSDP", "enable_cpu_affinity": False, "fsdp_config": {
        "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": False, "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_version": 2}}


@pytest.mark.parametrize("kind, engine", [("zero3", "deepspeed-zero3"), ("fsdp2", "fsdp2")])
def test_trl_style_configs_work_unchanged(kind, engine, tiny_model_dir, task_data, one_process, tmp_path):
    config = tmp_path / f"{kind}.yaml"
    config.write_text(yaml.safe_dump(trl_style_config(kind)))
    run = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *TWO_PROCESS_SPLIT,
                                         "train.mixed_precision=bf16"), accelerate_config=str(config))
    run.check_world(2)
    assert (run.facts["engine"], run.facts["precision"]) == (engine, "bf16")
    ref_losses = one_process["mb4"][0]
    for step, value in run.losses().items():  # bf16 follows the fp32 run closely
        assert value == pytest.approx(ref_losses[step], rel=2e-2), step
    assert run.final_weights()


def test_contradicting_deepspeed_json_stops_before_any_model(tiny_model_dir, task_data, tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}))
    config = tmp_path / "ds.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                      "deepspeed_config": {"deepspeed_config_file": str(ds_json)},
                                      "num_machines": 1, "num_processes": 2, "use_cpu": False}))
    run = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *TWO_PROCESS_SPLIT),
                 accelerate_config=str(config))
    assert not run.ok
    assert "exitcode  : 2" in run.output, run.output[-3000:]  # the workers' code; torchrun itself exits 1
    assert f"the DeepSpeed config {ds_json} sets train_micro_batch_size_per_gpu=8" in run.output
    assert "train.per_device_train_batch_size=1" in run.output
    assert "Loading weights" not in run.output


def test_a_failing_rank_ends_the_run_with_its_error(tiny_model_dir, task_data, tmp_path):
    run = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *TWO_PROCESS_SPLIT,
                                         "train.ddp_timeout=900"), hooks=["fail_rank"],
                 env={"POSTTRAIN_TEST_FAIL_RANK": "1"}, timeout=300)
    assert not run.ok and "killed after" not in run.output
    assert "posttrain: failed on rank 1" in run.output and "injected failure on rank 1" in run.output
    assert run.seconds < 120, f"{run.seconds:.0f} s: the peers waited for the collective timeout"
    assert not (tmp_path / "run" / "final").exists()


def test_two_nodes_one_process_each(tiny_model_dir, task_data, one_process, tmp_path):
    run = launch(2, "sft", sft_overrides(tiny_model_dir, task_data, tmp_path / "run", *TWO_PROCESS_SPLIT), nnodes=2)
    run.check_world(2, nodes=2)
    assert run.trainer_state()["run"]["nodes"] == 2
    assert_matches_one_process(run, one_process)


def test_resume_with_another_process_count(two_process_run, tiny_model_dir, task_data, tmp_path, capsys):
    ddp = two_process_run("ddp")
    assert ddp.ok, ddp.output[-3000:]
    # DDP checkpoints hold whole weights: 1 process x accumulation 4 continues the 2 x 2 run exactly
    one = ddp.copy_at(2, tmp_path / "ddp-to-one")
    assert run_cli("sft", *sft_overrides(tiny_model_dir, task_data, one, *ONE_PROCESS_SPLITS["mb1_acc4"],
                                         "train.resume_from_checkpoint=auto")) == 0
    losses, full = step_losses(one), ddp.losses()
    for step in range(3, STEPS + 1):
        assert losses[step] == pytest.approx(full[step], abs=1e-5), (step, losses, full)
    # ... but not with another global batch
    other = ddp.copy_at(2, tmp_path / "other-batch")
    assert run_cli("sft", *sft_overrides(tiny_model_dir, task_data, other, "train.per_device_train_batch_size=2",
                                         "train.resume_from_checkpoint=auto")) == 2
    assert "global batch of 4" in capsys.readouterr().err

    # a ZeRO checkpoint cannot be continued by another engine (one plain process): it stops before training, saying why
    zero2 = two_process_run("zero2")
    assert zero2.ok, zero2.output[-3000:]
    sharded = zero2.copy_at(2, tmp_path / "zero2-to-one")
    assert run_cli("sft", *sft_overrides(tiny_model_dir, task_data, sharded, *ONE_PROCESS_SPLITS["mb1_acc4"],
                                         "train.resume_from_checkpoint=auto")) == 2
    err = capsys.readouterr().err
    assert "deepspeed-zero2 state sharded over 2 processes" in err and "single on 1" in err, err
    assert [p.name for p in (sharded / "checkpoints").iterdir()] == ["step-2"] and not (sharded / "final").exists()


@pytest.mark.parametrize("engine", ["fsdp2", "zero2", "zero3"])
def test_sharded_checkpoints_resume_on_another_process_count(engine, two_process_run, tiny_model_dir, task_data,
                                                             tmp_path):
    """A 2-process run stopped at step 2 continues on 1 process of the same engine (micro-batch 1 x accumulation 4)
    with the same losses and final weights: FSDP2's torch.distributed.checkpoint shards load into another sharding;
    a DeepSpeed checkpoint is converted to DeepSpeed's universal format first (the original is left as it was)."""
    run = two_process_run(engine)
    assert run.ok, run.output[-3000:]
    one = run.copy_at(2, tmp_path / f"{engine}-to-one")
    files = lambda: sorted(p.relative_to(one) for p in (one / "checkpoints" / "step-2").rglob("*"))  # noqa: E731
    saved = files()
    result = launch(1, "sft", sft_overrides(tiny_model_dir, task_data, one, *ONE_PROCESS_SPLITS["mb1_acc4"],
                                            "train.resume_from_checkpoint=auto"), **ENGINES[engine])
    assert result.ok, result.output[-4000:]
    assert result.facts["engine"] == ENGINE_NAMES[engine] and result.facts["world_size"] == "1"
    losses, full = step_losses(one), run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):
        assert losses[step] == pytest.approx(full[step], abs=1e-5), (step, losses, full)
    assert max_weight_diff(result.final_weights(), run.final_weights()) < 1e-5
    assert files() == saved  # the checkpoint read is left as it was
    assert not (one / ".universal").exists()  # the converted copy is gone once read
