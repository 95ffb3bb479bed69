"""SFT end to end on the tiny model (CPU, fp32): training changes every parameter, eval loss falls, resume is exact,
accumulation and packing do not change the update, the export loads and generates, and the run directory holds
what DESIGN.md promises."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import (ONE_PROCESS_SPLITS, final_weights, max_weight_diff, metrics, run_cli,
                                       run_overrides, step_losses)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=64, n_eval=16)


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["sft_train"], out, *extra)


def test_three_steps_change_every_parameter_and_export_loads(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("sft", *base(tiny_model_dir, data, out, "train.max_steps=3", "train.per_device_train_batch_size=4",
                                "train.report=true", "train.tensorboard=true")) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("loss", "learning_rate", "tokens_per_second", "grad_norm", "peak_memory_mb"):
            assert key in r and torch.isfinite(torch.tensor(r[key])), (key, r)
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    unchanged = [k for k in initial if torch.equal(initial[k], trained[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert (out / "config.yaml").exists() and (out / "report.html").exists() and (out / "summary.json").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert not list((out / "checkpoints").glob("step-*"))  # save_steps 0: final/ alone, no last-step checkpoint

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


def test_eval_loss_falls_on_the_task(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("sft", *base(tiny_model_dir, data, out, "train.max_steps=30", "train.per_device_train_batch_size=8",
                                f"data.eval={data['sft_eval']}", "train.eval_steps=30", "train.save_final_model=false")) == 0
    evals = [r["eval/loss"] for r in metrics(out) if "eval/loss" in r]
    assert len(evals) == 2  # before training and at the end
    assert evals[-1] < 0.7 * evals[0], evals


def test_resume_continues_exactly(tiny_model_dir, data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train.max_steps=6", "train.per_device_train_batch_size=4", "train.save_steps=3", "train.lr_scheduler_type=cosine",
              "train.warmup_steps=2", "train.weight_decay=0.1"]
    assert run_cli("sft", *base(tiny_model_dir, data, full, *common)) == 0
    assert run_cli("sft", *base(tiny_model_dir, data, split, *common, "train.max_steps_per_run=3")) == 0
    assert not (split / "final").exists() and (split / "checkpoints" / "step-3").exists()
    assert run_cli("sft", *base(tiny_model_dir, data, split, *common, "train.resume_from_checkpoint=auto")) == 0
    a, b = step_losses(full), step_losses(split)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    assert max_weight_diff(final_weights(full), final_weights(split)) < 1e-6


def test_accumulation_and_packing_give_the_same_update(tiny_model_dir, data, tmp_path):
    runs = {
        **ONE_PROCESS_SPLITS,
        "mb2_acc2_packed": ["train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=2", "data.packing=true"],
    }
    for name, extra in runs.items():
        assert run_cli("sft", *base(tiny_model_dir, data, tmp_path / name, "train.max_steps=3", *extra)) == 0
    ref_losses, ref_weights = step_losses(tmp_path / "mb4"), final_weights(tmp_path / "mb4")
    for name in ("mb1_acc4", "mb2_acc2_packed"):
        losses = step_losses(tmp_path / name)
        for step, value in ref_losses.items():
            assert losses[step] == pytest.approx(value, abs=1e-5), (name, step)
        assert max_weight_diff(ref_weights, final_weights(tmp_path / name)) < 1e-5, name


def test_save_total_limit_keeps_newest(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("sft", *base(tiny_model_dir, data, out, "train.max_steps=4", "train.per_device_train_batch_size=2",
                                "train.save_steps=1", "train.save_total_limit=2", "train.save_final_model=false")) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-4"]
