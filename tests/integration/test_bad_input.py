"""Bad input gets one clear message and exit code 2 before any model is loaded or anything is written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import run_cli


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=8, n_eval=4)


def sft(tiny_model_dir, train, out, *extra):
    return run_cli("sft", f"model.name_or_path={tiny_model_dir}", f"data.train={train}", f"output_dir={out}",
                   "train.max_steps=1", *extra)


def snapshot(root: Path) -> dict:
    """Every entry under root: file bytes, link targets, directories (to compare before and after)."""
    return {str(p.relative_to(root)): ("link:" + os.readlink(p)) if p.is_symlink() else
            (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


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
    (out / ".posttrain-run").write_text("{}")
    (out / "config.yaml").write_text("output_dir: someone-else\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], out), "already holds a run", "overwrite_output_dir")
    assert snapshot(out) == before


def test_overwrite_keeps_user_files(tiny_model_dir, data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".posttrain-run").write_text("{}")
    (out / "config.yaml").write_text("old")
    (out / "notes.txt").write_text("mine")
    assert sft(tiny_model_dir, data["sft_train"], out, "train.overwrite_output_dir=true", "train.report=false",
               "train.per_device_train_batch_size=2") == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "config.yaml").read_text() != "old"
    assert not list(out.glob(".posttrain-replaced-*"))  # the old run's files went once the new config was written


@pytest.mark.parametrize("flags", [[], ["train.resume_from_checkpoint=auto"], ["train.overwrite_output_dir=true"]])
def test_a_directory_no_run_made_is_never_written(tiny_model_dir, data, tmp_path, capsys, flags):
    """The issue's data loss: the user's own final/ and checkpoints/step-2 in a directory that is not a run."""
    out = tmp_path / "mine"
    (out / "final").mkdir(parents=True)
    (out / "final" / "README_MINE.md").write_text("my notes")
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    (out / "checkpoints" / "step-1" / "weights.bin").write_bytes(b"\1\2\3")
    before = snapshot(out)
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], out, *flags), str(out), "no posttrain run made it")
    assert snapshot(out) == before


@pytest.mark.parametrize("where", ["/", "/etc", str(Path.home()), "."])
def test_root_home_and_the_working_directory_are_refused_with_auto(tiny_model_dir, data, capsys, where):
    fragment = "a run needs a directory of its own" if where != "/etc" else "no posttrain run made it"
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], where, "train.resume_from_checkpoint=auto"), fragment)


def test_overwrite_with_a_linked_final_touches_nothing(tiny_model_dir, data, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"precious")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".posttrain-run").write_text("{}")
    (out / "config.yaml").write_text("seed: 1\n")
    (out / "final").symlink_to(elsewhere)
    before = snapshot(tmp_path)
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], out, "train.overwrite_output_dir=true"),
                  f"{out / 'final'} is a symbolic link")
    assert snapshot(tmp_path) == before


def test_truncated_model_weights(tiny_model_dir, data, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted download or copy
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(model, data["sft_train"], out), str(weights), "damaged", "model.name_or_path")
    assert not out.exists()


def test_output_dir_that_cannot_be_written(tiny_model_dir, data, tmp_path, capsys):
    # /sys refuses new files even to root (a chmod-ed folder would not stop root)
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], "/sys/posttrain-test/out"), "output_dir",
                  "cannot write in /sys")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], blocked / "out"), "output_dir", "a-file")
    assert blocked.read_text() == "not a folder"


def test_data_that_is_not_utf8_names_the_line(tiny_model_dir, tmp_path, capsys):
    for suffix in (".jsonl", ".csv"):
        bad = tmp_path / f"latin1{suffix}"
        header = "text\n" if suffix == ".csv" else ""
        line = '{"text": "fine"}\n' if suffix == ".jsonl" else "fine\n"
        bad.write_bytes((header + line).encode() + '{"text": "café"}\n'.encode("latin-1"))
        out = tmp_path / "out"
        expect_exit_2(capsys, sft(tiny_model_dir, bad, out), bad.name, f"line {3 if header else 2}", "UTF-8")
        assert not out.exists()


def test_message_role_the_template_does_not_know(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]},
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assitant", "content": "4"}]}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tiny_model_dir, bad, out), "row 1", "message 1", "'assitant'", "data.train")
    assert not out.exists()


def test_a_run_that_stopped_before_training_does_not_block_the_next(tiny_model_dir, data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".posttrain-run").write_text("{}")
    (out / "config.yaml").write_text("seed: 1\n")  # all a run leaves when its model fails to load
    assert sft(tiny_model_dir, data["sft_train"], out, "train.report=false", "train.tensorboard=false") == 0
    assert (out / "final" / "model.safetensors").exists()


# --- checkpoints given to resume from (issue #25) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, data, tmp_path_factory):
    """A finished 2-step run with checkpoints step-1 and step-2."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert sft(tiny_model_dir, data["sft_train"], out, "train.max_steps=2", "train.save_steps=1",
               "train.save_total_limit=null", "train.report=false", "train.tensorboard=false",
               "train.per_device_train_batch_size=2") == 0
    return out


def copy_run(saved_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out, symlinks=True)
    return out


@pytest.mark.parametrize("manifest, fragment", [
    ([], "manifest.json is malformed"),
    ({"files": {}}, "it lists no file"),
    ({"files": {"trainer_state.json": {"size": 1, "sha256": "0"}, "../../../../etc/hostname": {"size": 1,
                                                                                             "sha256": "0"}}},
     "names '../../../../etc/hostname', outside the checkpoint"),
])
def test_an_explicit_checkpoint_with_a_bad_manifest_is_refused(tiny_model_dir, data, saved_run, tmp_path, capsys,
                                                               manifest, fragment):
    out = copy_run(saved_run, tmp_path)
    step = out / "checkpoints" / "step-2"
    (step / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], out, f"train.resume_from_checkpoint={step}"),
                  f"train.resume_from_checkpoint={step}", fragment)
    assert snapshot(out) == before


def test_unreadable_rng_state_stops_the_resume_unless_resume_strict_is_off(tiny_model_dir, data, saved_run, tmp_path,
                                                                           capsys):
    from posttrain.rundir.files import write_manifest

    out = copy_run(saved_run, tmp_path)
    for step in (out / "checkpoints").iterdir():
        (step / "random_states_0.pkl").write_bytes(b"written by something else")
        write_manifest(step)  # not damage the manifest could see
    before = snapshot(out)
    code = sft(tiny_model_dir, data["sft_train"], out, "train.max_steps=3", "train.resume_from_checkpoint=auto")
    expect_exit_2(capsys, code, "random_states_0.pkl cannot be read", "train.resume_strict=false",
                  "no checkpoint in")
    assert snapshot(out) == before
    assert sft(tiny_model_dir, data["sft_train"], out, "train.max_steps=3", "train.resume_from_checkpoint=auto",
               "train.resume_strict=false", "train.report=false", "train.tensorboard=false",
               "train.per_device_train_batch_size=2") == 0
    captured = capsys.readouterr()
    assert "resuming without the random number generators' state" in captured.err, captured.err
    assert f"resumed_from={out / 'checkpoints' / 'step-2'}" in captured.out


def test_auto_passes_over_a_malformed_manifest(tiny_model_dir, data, saved_run, tmp_path, capsys):
    out = copy_run(saved_run, tmp_path)
    (out / "checkpoints" / "step-2" / "manifest.json").write_text("[]")
    assert sft(tiny_model_dir, data["sft_train"], out, "train.max_steps=2", "train.resume_from_checkpoint=auto",
               "train.report=false", "train.tensorboard=false", "train.per_device_train_batch_size=2") == 0
    captured = capsys.readouterr()
    assert "step-2 is damaged (manifest.json is malformed" in captured.err, captured.err
    assert "Traceback" not in captured.err
    assert f"resumed_from={out / 'checkpoints' / 'step-1'}" in captured.out


# --- recipes safe_load would take silently (issue #25) ----------------------------------------------------------------


def test_a_recipe_key_given_twice_names_the_key_and_lines(tiny_model_dir, data, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: {tiny_model_dir}}}\ndata: {{train: {data['sft_train']}}}\n"
                      f"output_dir: {tmp_path / 'out'}\ntrain:\n  max_steps: 2\n  max_steps: 1\n")
    before = recipe.read_bytes()
    expect_exit_2(capsys, run_cli("sft", config=str(recipe)), "line 6: key 'train.max_steps' is given twice",
                  "line 5")
    assert recipe.read_bytes() == before and not (tmp_path / "out").exists()


def test_an_alias_bomb_in_reward_kwargs_is_refused_before_it_hangs(tiny_model_dir, data, tmp_path, capsys):
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rewards:\n  - name: format\n    kwargs:\n" + "".join(f"      {x}\n" for x in lines))
    code = run_cli("grpo", f"model.name_or_path={tiny_model_dir}", f"data.train={data['prompts_train']}",
                   f"output_dir={tmp_path / 'out'}", config=str(recipe))
    expect_exit_2(capsys, code, "aliases (*name) expand 'rewards[0].kwargs.")
    assert not (tmp_path / "out").exists()


def test_max_length_beyond_the_models_positions(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tiny_model_dir, data["sft_train"], out, "data.max_length=1000000000000"),
                  "data.max_length = 1,000,000,000,000", "1,024 positions (max_position_embeddings")
    assert not out.exists()
    code = run_cli("grpo", f"model.name_or_path={tiny_model_dir}", f"data.train={data['prompts_train']}",
                   f"output_dir={out}", "data.max_prompt_length=1000", "generation.max_completion_length=100",
                   "rewards=[{name: length_penalty, kwargs: {max_length: 40}}]")
    expect_exit_2(capsys, code, "data.max_prompt_length + generation.max_completion_length = 1,100")
    assert not out.exists()


# --- user code: one error path (issue #25) ----------------------------------------------------------------------------


def grpo_with_reward(tiny_model_dir, data, out, reward_file, *extra):
    return run_cli("grpo", f"model.name_or_path={tiny_model_dir}", f"data.train={data['prompts_train']}",
                   f"output_dir={out}", "train.max_steps=1", "train.per_device_train_batch_size=4",
                   "algo.num_generations=2", "generation.max_completion_length=4", "train.report=false",
                   "train.tensorboard=false", f"rewards=[{{name: '{reward_file}:score'}}]", *extra)


def test_a_reward_module_that_calls_sys_exit_on_import_is_exit_2(tiny_model_dir, data, tmp_path, capsys):
    module = tmp_path / "quitter.py"
    module.write_text("import sys\nsys.exit(0)\n\ndef score(prompts, completions, **kw):\n    return [1.0]\n")
    out = tmp_path / "out"
    expect_exit_2(capsys, grpo_with_reward(tiny_model_dir, data, out, module),
                  f"reward '{module}:score': cannot import module", "it called sys.exit(0)", "quitter.py\", line 2")
    assert not out.exists()


@pytest.mark.parametrize("body, did", [
    ("    if len(prompts) > 0:\n        sys.exit(0)\n    return [1.0] * len(completions)", "called sys.exit(0) on sample 0"),
    ("    return [float('nan')] * len(completions)", "returned nan for sample 0"),
    ("    return [1.0]", "returned 1 values for 4 completions"),
])
def test_a_reward_that_exits_or_returns_nan_stops_the_run_non_zero(tiny_model_dir, data, tmp_path, capsys, body, did):
    module = tmp_path / "my_reward.py"
    module.write_text(f"import sys\n\ndef score(prompts, completions, **kw):\n{body}\n")
    out = tmp_path / "out"
    assert grpo_with_reward(tiny_model_dir, data, out, module) == 1
    err = capsys.readouterr().err
    assert err.count("posttrain: error: reward 'score'") == 1 and did in err and "prompt" in err, err
    assert "Traceback" not in err  # the user's frames only, no posttrain traceback
    assert not (out / "final").exists()


# --- data that would train on nothing (issue #25) ---------------------------------------------------------------------


def test_json_nested_100000_deep_is_exit_2_naming_the_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "deep.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tiny_model_dir, bad, out), "deep.jsonl line 2", "nested deeper than")
    assert not out.exists()


def test_rows_that_train_on_nothing_are_dropped_and_counted_or_refused(tiny_model_dir, tmp_path, capsys):
    good = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    empty = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": ""}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": empty}) + "\n")
    out = tmp_path / "out"
    expect_exit_2(capsys, sft(tiny_model_dir, chat, out), "1 with an empty text, completion or assistant turn")
    assert not out.exists()
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (good, empty, good, empty)))
    assert sft(tiny_model_dir, chat, out, "train.report=false", "train.tensorboard=false",
               "train.per_device_train_batch_size=2") == 0
    assert "dropped={'dropped_empty': 2}" in capsys.readouterr().out


def test_a_sys_exit_0_anywhere_inside_a_run_never_exits_0(monkeypatch, capsys):
    import posttrain.run

    def quits(command, recipe, **kwargs):
        raise SystemExit(0)  # what a library or user code called in the main thread would do

    monkeypatch.setattr(posttrain.run, "run", quits)
    assert run_cli("sft", "data.train=x.jsonl") == 1
    assert "posttrain sft was ended by sys.exit(0) before it finished" in capsys.readouterr().err
