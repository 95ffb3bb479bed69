"""Bad input gets one clear message and exit code 2 before any model is loaded or anything is written."""

from __future__ import annotations

import json

import pytest

from posttrain.tasks import write_example_data
from tests.integration.helpers import run_cli


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=8, n_eval=4)


def sft(tiny_model_dir, train, out, *extra):
    return run_cli("sft", f"model.name_or_path={tiny_model_dir}", f"data.train={train}", f"output_dir={out}",
                   "train.max_steps=1", *extra)


def expect_exit_2(capsys, code, *fragments):
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("posttrain: error:") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_missing_data_file(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tiny_model_dir, tmp_path / "nope.jsonl", out), "nope.jsonl", "data.train")
    assert not out.exists()


def test_malformed_json_line_names_the_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tiny_model_dir, bad, out), "bad.jsonl", "line 3")
    assert not out.exists()


def test_missing_column_names_the_row(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c"}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expect_exit_2(capsys, sft(tiny_model_dir, bad, tmp_path / "out"), "completion", "row 1")


def test_wrong_type(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": 5}) + "\n")
    expect_exit_2(capsys, sft(tiny_model_dir, bad, tmp_path / "out"), "completion")


def test_empty_dataset(tiny_model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    expect_exit_2(capsys, sft(tiny_model_dir, empty, tmp_path / "out"), "empty.jsonl")


def test_unknown_key_and_invalid_value(tiny_model_dir, data, tmp_path, capsys):
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], tmp_path / "o", "train.lerning_rate=1"), "did you mean")
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], tmp_path / "o", "train.learning_rate=0"), "learning_rate")
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], tmp_path / "o", "train.per_device_train_batch_size=0"),
                  "per_device_train_batch_size")
    assert not (tmp_path / "o").exists()


def test_missing_model_directory(data, tmp_path, capsys):
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tmp_path / "no-model/", data["sft_train"], out), "no-model")
    assert not out.exists()


def test_missing_recipe_file(capsys, tmp_path):
    expect_exit_2(capsys, run_cli("sft", config=str(tmp_path / "missing.yaml")), "missing.yaml")


def test_output_dir_with_a_different_run_is_refused_and_kept(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("output_dir: someone-else\n")
    (out / "notes.txt").write_text("mine")
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], out), "already holds a run", "overwrite_output_dir")
    assert (out / "config.yaml").read_text() == "output_dir: someone-else\n"
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_keeps_user_files(tiny_model_dir, data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("old")
    (out / "notes.txt").write_text("mine")
    assert sft(tiny_model_dir, data["sft_train"], out, "train.overwrite_output_dir=true", "train.report=false",
               "train.per_device_train_batch_size=2") == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "config.yaml").read_text() != "old"
