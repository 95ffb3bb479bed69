"""One source of truth: what an accelerate config or a DeepSpeed JSON says about batch, accumulation, clipping and
precision must agree with the recipe (or be left out / "auto"); otherwise the run stops at start-up naming both.
Pure checks, no processes (the end-to-end exit-2 path is in test_launch_paths.py)."""

from __future__ import annotations

import pytest

from posttrain.config.schema import TrainConfig
from posttrain.distributed.launch_config import check_deepspeed_json, check_launcher_settings
from posttrain.errors import UserError

T = TrainConfig(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_grad_norm=1.0, mixed_precision="no")


def test_deepspeed_json_that_agrees_or_says_auto_passes():
    check_deepspeed_json({"zero_optimization": {"stage": 3}}, "ds.json", T, 2)
    check_deepspeed_json({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                          "bf16": {"enabled": "auto"}}, "ds.json", T, 2)
    check_deepspeed_json({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4, "gradient_accumulation_steps": 2,
                          "gradient_clipping": 1.0, "bf16": {"enabled": False}, "fp16": {"enabled": False}}, "ds.json", T, 2)
    check_deepspeed_json({"bf16": {"enabled": True}, "fp16": {"enabled": False}}, "ds.json",
                         TrainConfig(mixed_precision="bf16"), 1)


@pytest.mark.parametrize("user, names", [
    ({"train_micro_batch_size_per_gpu": 8}, ["train_micro_batch_size_per_gpu=8", "train.per_device_train_batch_size=1"]),
    ({"gradient_accumulation_steps": 1}, ["gradient_accumulation_steps=1", "train.gradient_accumulation_steps=2"]),
    ({"gradient_clipping": 0.5}, ["gradient_clipping=0.5", "train.max_grad_norm=1.0"]),
    ({"train_batch_size": 16}, ["train_batch_size=16", "2 processes", "=4"]),
    ({"bf16": {"enabled": True}}, ["bf16.enabled=True", "train.mixed_precision='no'"]),
])
def test_deepspeed_json_contradicting_the_recipe_names_both(user, names):
    with pytest.raises(UserError) as e:
        check_deepspeed_json(user, "/cfg/ds.json", T, 2)
    for name in names + ["/cfg/ds.json"]:
        assert name in str(e.value)


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_deepspeed_json_may_not_define_the_optimizer(section):
    with pytest.raises(UserError, match=f"'{section}'.*train.learning_rate"):
        check_deepspeed_json({section: {"type": "AdamW"}}, "ds.json", T, 2)


def test_accelerate_config_values_agree_or_stop(monkeypatch):
    for variable in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING"):
        monkeypatch.delenv(variable, raising=False)
    check_launcher_settings(T)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch exports 'no' when the config is silent
    check_launcher_settings(TrainConfig(mixed_precision="bf16"))
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    check_launcher_settings(T)

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(UserError, match=r"mixed_precision='bf16' but the recipe has train.mixed_precision='no'"):
        check_launcher_settings(T)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")  # TRL's older deepspeed_zero2.yaml says 1
    with pytest.raises(UserError, match=r"gradient_accumulation_steps='1' but the recipe has train.gradient_accumulation_steps=2"):
        check_launcher_settings(T)


def test_a_lone_process_from_accelerate_launch_cpu_is_refused(monkeypatch):
    """`accelerate launch --cpu --num_processes 2` starts ONE process (expecting mpirun); it must not train alone."""
    from posttrain.config.schema import Recipe
    from posttrain.distributed.backend import Backend

    for variable in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UserError, match="torchrun --nproc_per_node"):
        Backend(Recipe())
