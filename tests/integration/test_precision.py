"""A bf16 checkpoint trains as float32 does (float32 master weights under bf16 autocast), and pure bf16 (asked for
with train.master_weights=false) visibly does not; the last-step checkpoint and final/'s dtype follow the recipe.

The learning rate (3e-5, constant) is small enough that pure bf16 rounds most AdamW updates of the tiny model's
weights away (bf16 keeps 8 bits of mantissa): its eval loss falls by a third of float32's, so the comparison can
fail. Measured: float32 6.4195 -> 6.3850, mixed 6.4196 -> 6.3873, pure 6.4196 -> 6.4083."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import final_weights, max_weight_diff, metrics, run_cli, run_overrides, step_losses


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model saved in bf16 (config.json says bfloat16), as SmolLM2 and most hub checkpoints are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16") / "model"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=64, n_eval=8)


def sft(model_dir, data, out, *extra) -> int:
    return run_cli("sft", *run_overrides(model_dir, data["sft_train"], out, "train.max_steps=4",
                                         "train.per_device_train_batch_size=4", "train.lr_scheduler_type=constant",
                                         f"data.eval={data['sft_eval']}", "model.dtype=auto", *extra,
                                         learning_rate="3e-5"))


def eval_losses(out) -> tuple[float, float]:
    evals = [r["eval/loss"] for r in metrics(out) if "eval/loss" in r]
    return evals[0], evals[-1]


def test_bf16_checkpoint_learns_as_float32_and_pure_bf16_does_not(bf16_model_dir, data, tmp_path, capsys):
    runs = {"fp32": ["model.dtype=float32", "train.save_final_model=false"],
            "mixed": ["train.save_final_checkpoint=true"],  # auto on a bf16 checkpoint: master weights, bf16 autocast
            "pure": ["train.master_weights=false", "train.save_final_model=false"]}
    for name, extra in runs.items():
        assert sft(bf16_model_dir, data, tmp_path / name, *extra) == 0, name
    assert "train.master_weights=false" in capsys.readouterr().err  # pure bf16 says what it costs
    start, fp32 = eval_losses(tmp_path / "fp32")
    drop = start - fp32
    assert drop > 0.02, drop  # float32 learns at this learning rate
    mixed_start, mixed = eval_losses(tmp_path / "mixed")
    assert abs((mixed_start - mixed) - drop) < 0.15 * drop, (mixed_start, mixed, start, fp32)
    pure_start, pure = eval_losses(tmp_path / "pure")
    assert pure_start - pure < 0.5 * drop, (pure_start, pure, start, fp32)  # the updates pure bf16 lost

    # the checkpoint holds the float32 master weights; final/ is exported in the dtype the model was loaded in
    saved = load_file(str(tmp_path / "mixed" / "checkpoints" / "step-4" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    exported = final_weights(tmp_path / "mixed")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "mixed" / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    assert max_weight_diff(exported, {k: v.to(torch.bfloat16) for k, v in saved.items() if k in exported}) == 0
    assert not (tmp_path / "fp32" / "checkpoints").exists() or not list((tmp_path / "fp32" / "checkpoints").iterdir())


def test_mixed_precision_resumes_exactly_and_exports_as_asked(bf16_model_dir, data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train.save_steps=2", "train.export_dtype=float32", "data.eval=null"]
    assert sft(bf16_model_dir, data, full, *common) == 0
    assert sft(bf16_model_dir, data, split, *common, "train.max_steps_per_run=2") == 0
    assert sft(bf16_model_dir, data, split, *common, "train.resume_from_checkpoint=auto") == 0
    assert step_losses(full) == step_losses(split)
    a, b = final_weights(full), final_weights(split)
    assert {t.dtype for t in a.values()} == {torch.float32} and max_weight_diff(a, b) == 0
