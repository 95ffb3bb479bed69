"""posttrain distill end to end on CPU: the session's tiny model as the student, a differently seeded tiny model of
the same vocabulary as the teacher. On-policy (lmbda 1, the hf engine) and supervised (lmbda 0) runs train every
parameter; a mixed run resumes exactly (the on-policy coins and the samples are seeded by step); a teacher equal to
the student gives a zero loss; another vocabulary is exit 2 before any weights load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import final_weights, metrics, run_cli, run_overrides, step_losses


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=8)


def args(student, teacher, data, out, *extra):
    return run_overrides(student, data["sft_train"], out, f"algo.teacher_model_name_or_path={teacher}",
                         "train.per_device_train_batch_size=4", "generation.max_completion_length=8", *extra)


@pytest.mark.parametrize("lmbda", [1.0, 0.0])
def test_three_steps_train_every_parameter(tiny_model_dir, teacher_dir, data, tmp_path, lmbda):
    out = tmp_path / "run"
    offload = "algo.teacher_offload=true" if lmbda == 0 else "algo.teacher_offload=false"  # the placement path too
    assert run_cli("distill", *args(tiny_model_dir, teacher_dir, data, out, "train.max_steps=3",
                                    f"algo.lmbda={lmbda}", "algo.beta=0.0", offload)) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("loss", "grad_norm", "forward_kl", "reverse_kl", "top1_agreement", "teacher_logprob",
                    "student_logprob"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
        assert r["loss"] > 0
        # beta 0 is the forward KL, one micro-batch per step: the loss is the logged per-token forward KL
        assert r["loss"] == pytest.approx(r["forward_kl"], rel=1e-5)
    if lmbda == 1.0:  # the student's own completions: up to max_completion_length tokens, not the data's answers
        assert [r["on_policy"] for r in rows] == [1.0, 1.0, 1.0]
        assert all(r["time/generate"] > 0 for r in rows)
    else:
        assert "on_policy" not in rows[0]  # the dataset source: nothing sampled
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    assert not [k for k in initial if torch.equal(initial[k], trained[k])]
    teacher = load_file(str(next(teacher_dir.glob("*.safetensors"))))
    assert not (out / "final-teacher").exists() and any(not torch.equal(teacher[k], trained[k]) for k in teacher)


def test_resume_reproduces_the_mixed_run(tiny_model_dir, teacher_dir, data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train.max_steps=4", "train.save_steps=2", "algo.lmbda=0.5", "algo.beta=0.5", "algo.temperature=0.9"]
    assert run_cli("distill", *args(tiny_model_dir, teacher_dir, data, full, *common)) == 0
    assert run_cli("distill", *args(tiny_model_dir, teacher_dir, data, split, *common,
                                    "train.max_steps_per_run=2")) == 0
    assert run_cli("distill", *args(tiny_model_dir, teacher_dir, data, split, *common,
                                    "train.resume_from_checkpoint=auto")) == 0
    a, b = step_losses(full), step_losses(split)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    coins = [r["on_policy"] for r in metrics(full)]
    assert 0.0 in coins and 1.0 in coins, coins  # the seed flips both ways in 4 steps: both paths resume
    assert coins == [r["on_policy"] for r in metrics(split)]


def test_a_teacher_equal_to_the_student_gives_zero_loss(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("distill", *args(tiny_model_dir, tiny_model_dir, data, out, "train.max_steps=1", "algo.lmbda=1",
                                    "train.save_final_model=false")) == 0
    (row,) = metrics(out)
    assert row["loss"] == pytest.approx(0.0, abs=1e-7) and row["grad_norm"] == pytest.approx(0.0, abs=1e-6)
    assert row["top1_agreement"] == 1.0 and row["teacher_logprob"] == pytest.approx(row["student_logprob"], abs=1e-6)


def test_another_vocabulary_is_exit_2_naming_both_models(tiny_model_dir, data, tmp_path, capsys):
    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    assert run_cli("distill", *args(tiny_model_dir, other, data, out, "train.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert str(other) in err and str(tiny_model_dir) in err and "vocab" in err, err
    assert not out.exists()  # nothing written, nothing loaded

    tokenizer = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, two tokens swapped
    shutil.copy(tiny_model_dir / "config.json", other / "config.json")
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert run_cli("distill", *args(tiny_model_dir, other, data, out, "train.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert "different tokenizers" in err and str(other) in err, err
    assert run_cli("distill", *args(tiny_model_dir, tmp_path / "missing", data, out, "train.max_steps=1")) == 2
    assert "algo.teacher_model_name_or_path" in capsys.readouterr().err


def test_an_unreachable_teacher_server_is_exit_2(tiny_model_dir, data, tmp_path, capsys):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "run"
    assert run_cli("distill", *run_overrides(tiny_model_dir, data["sft_train"], out, "train.max_steps=1",
                                             f"algo.teacher_server=http://127.0.0.1:{port}")) == 2
    err = capsys.readouterr().err
    assert f"algo.teacher_server = http://127.0.0.1:{port}: no answer" in err and not out.exists(), err
    assert run_cli("distill", *run_overrides(tiny_model_dir, data["sft_train"], out, "train.max_steps=1",
                                             f"algo.teacher_server=http://127.0.0.1:{port}",
                                             f"algo.teacher_model_name_or_path={tiny_model_dir}")) == 2
    assert "name the teacher once" in capsys.readouterr().err
