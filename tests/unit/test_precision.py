"""distributed/precision.py: which dtype a run trains in and which autocast it uses, the CPU bf16 check, the notes, and
the checkpoint / export switches (config.schema.saves_final_checkpoint, checkpoint.set_config_dtype)."""

from __future__ import annotations

import json

import pytest

from posttrain.rundir.checkpoint import set_config_dtype
from posttrain.config.schema import ModelConfig, TrainConfig, saves_final_checkpoint
from posttrain.errors import UserError
from posttrain.distributed.precision import (Precision, check_precision, checkpoint_dtype, cpu_has_native_bf16,
                                        export_dtype, precision_notes, resolve_precision, trained_model_config)


def saved_in(tmp_path, dtype):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
    return ModelConfig(name_or_path=str(tmp_path), dtype="auto")


@pytest.mark.parametrize("model_dtype, train, expected", [
    ("float32", TrainConfig(), ("float32", "float32", "no")),
    ("float32", TrainConfig(mixed_precision="bf16"), ("float32", "float32", "bf16")),
    ("bfloat16", TrainConfig(), ("bfloat16", "float32", "bf16")),        # master weights under bf16 autocast
    ("float16", TrainConfig(), ("float16", "float32", "fp16")),
    ("float16", TrainConfig(mixed_precision="bf16"), ("float16", "float32", "bf16")),
    ("bfloat16", TrainConfig(master_weights=False), ("bfloat16", "bfloat16", "no")),  # pure bf16, asked for
])
def test_a_16_bit_checkpoint_trains_float32_master_weights_unless_told(model_dtype, train, expected):
    precision = resolve_precision(ModelConfig(dtype=model_dtype), train)
    assert (precision.loaded, precision.trained, precision.autocast) == expected
    assert precision.pure == (expected[1] != "float32")
    assert trained_model_config(ModelConfig(dtype=model_dtype), train).dtype == expected[1]


def test_auto_reads_the_checkpoint_and_never_trains_pure_bf16(tmp_path):
    cfg = saved_in(tmp_path, "bfloat16")
    assert checkpoint_dtype(cfg) == "bfloat16"
    precision = resolve_precision(cfg, TrainConfig())
    assert (precision.trained, precision.autocast) == ("float32", "bf16")
    assert checkpoint_dtype(saved_in(tmp_path, None)) == "float32"  # a config naming no dtype


def test_export_dtype_auto_is_the_dtype_loaded():
    precision = Precision(loaded="bfloat16", trained="float32", autocast="bf16")
    assert export_dtype(TrainConfig(), precision) == "bfloat16"
    assert export_dtype(TrainConfig(export_dtype="float32"), precision) == "float32"


@pytest.mark.parametrize("cpuinfo, native", [
    ("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n", False),  # AVX2: bf16 emulated
    ("flags\t\t: fpu avx512f avx512_bf16 amx_tile\n", True),
    ("flags\t\t: fpu amx_bf16\n", True),
    ("Features\t: fp asimd bf16 i8mm\n", True),                # Arm
    ("", None),                                                 # nothing to read: say nothing
])
def test_cpu_bf16_from_cpuinfo_flags(cpuinfo, native):
    assert cpu_has_native_bf16(cpuinfo) is native


def test_notes_say_pure_bf16_costs_and_slow_cpus_once_each():
    pure = Precision(loaded="bfloat16", trained="bfloat16", autocast="no")
    mixed = Precision(loaded="bfloat16", trained="float32", autocast="bf16")
    fp32 = Precision(loaded="float32", trained="float32", autocast="no")
    assert any("1/256" in n for n in precision_notes(pure, on_cpu=False, native_bf16=None))
    assert precision_notes(mixed, on_cpu=True, native_bf16=True) == []
    [slow] = precision_notes(mixed, on_cpu=True, native_bf16=False)
    assert "no native bf16" in slow and "model.dtype=float32" in slow
    assert precision_notes(mixed, on_cpu=False, native_bf16=False) == []  # a GPU
    assert precision_notes(fp32, on_cpu=True, native_bf16=False) == []


def test_precisions_a_launch_cannot_run_stop_before_loading():
    with pytest.raises(UserError, match="model.dtype=float16 trains with float32 master weights"):
        check_precision(Precision(loaded="float16", trained="float32", autocast="fp16"), on_cpu=True, engine=None)
    with pytest.raises(UserError, match="train.mixed_precision=fp16 needs a CUDA GPU"):
        check_precision(Precision(loaded="float32", trained="float32", autocast="fp16"), on_cpu=True, engine=None)
    with pytest.raises(UserError, match="not available under DeepSpeed"):
        check_precision(Precision(loaded="bfloat16", trained="bfloat16", autocast="no"), on_cpu=False,
                        engine="deepspeed")
    check_precision(Precision(loaded="bfloat16", trained="float32", autocast="bf16"), on_cpu=False, engine="deepspeed")


@pytest.mark.parametrize("save_steps, switch, saved", [(0, None, False), (5, None, True), (0, True, True),
                                                       (5, False, False)])
def test_the_last_step_is_checkpointed_only_when_asked(save_steps, switch, saved):
    assert saves_final_checkpoint(TrainConfig(save_steps=save_steps, save_final_checkpoint=switch)) is saved


def test_set_config_dtype_names_the_written_dtype(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"dtype": "float32", "torch_dtype": "float32", "hidden_size": 8}))
    set_config_dtype(config, "bfloat16")
    assert json.loads(config.read_text()) == {"dtype": "bfloat16", "torch_dtype": "bfloat16", "hidden_size": 8}


def test_lora_keeps_the_16_bit_base_and_trains_float32_adapters():
    import torch

    from posttrain.config.schema import LoraConfig
    from posttrain.distributed.precision import upcast_trainable

    cfg = ModelConfig(dtype="bfloat16", lora=LoraConfig(enabled=True))
    assert trained_model_config(cfg, TrainConfig()).dtype == "bfloat16"  # the frozen base, as loaded
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).to(torch.bfloat16)
    model[0].requires_grad_(False)
    upcast_trainable(model, cfg, TrainConfig())
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    upcast_trainable(model.to(torch.bfloat16), cfg, TrainConfig(master_weights=False))
    assert model[1].weight.dtype == torch.bfloat16
