"""Hostile input to what the last wave added (issue #37), each refused with exit 2 and one message naming it, before
any model loads, with every file the user had left byte-identical. One parametrized test: no case trains."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import run_cli
from tests.integration.test_bad_input import expect_exit_2, snapshot


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=8, n_eval=4)


def common(tiny_model_dir, train, out) -> list[str]:
    return [f"model.name_or_path={tiny_model_dir}", f"data.train={train}", f"output_dir={out}", "train.max_steps=1"]


def an_sft_run(tmp, tiny_model_dir, data):
    """A directory an SFT run wrote (its marker, recipe, metrics): the DPO run must not continue it."""
    out = tmp / "sft-run"
    out.mkdir()
    (out / ".posttrain-run").write_text(json.dumps({"created": "2026-11-26T10:00:00+00:00", "command": "sft",
                                                    "by": "posttrain"}))
    (out / "config.yaml").write_text("output_dir: x\nmodel: {}\ndata: {}\ntrain: {}\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return "dpo", common(tiny_model_dir, data["pref_train"], out) + ["train.resume_from_checkpoint=auto"]


def a_data_dir_without_data(tmp, tiny_model_dir, data):
    folder = tmp / "data-dir"
    folder.mkdir()
    (folder / "README.txt").write_text("my notes about the data\nsecond line\n")
    return "sft", common(tiny_model_dir, folder, tmp / "out")


def a_model_config_that_is_a_list(tmp, tiny_model_dir, data):
    model = tmp / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text("[1, 2, 3]")
    return "sft", common(model, data["sft_train"], tmp / "out")


def a_model_vocab_that_is_text(tmp, tiny_model_dir, data):
    model = tmp / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": "lots"}))
    return "sft", common(model, data["sft_train"], tmp / "out")


def mixed_content(tmp, tiny_model_dir, data):
    rows = [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}] * 3
    rows.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
                              {"role": "assistant", "content": "4"}]})
    chat = tmp / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "sft", common(tiny_model_dir, chat, tmp / "out")


def images(tmp, tiny_model_dir, data):
    parts = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what is it?"}]
    row = {"messages": [{"role": "user", "content": parts},
                        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]}
    chat = tmp / "vision.jsonl"
    chat.write_text(json.dumps(row) + "\n")
    return "sft", common(tiny_model_dir, chat, tmp / "out")


def packing_an_opt_model(tmp, tiny_model_dir, data):
    """OPT's attention reads no position ids: packed sequences would attend to each other (models/packing.py)."""
    import transformers

    model = tmp / "opt"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    opt = transformers.OPTConfig(vocab_size=config["vocab_size"], hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                 num_attention_heads=2, word_embed_proj_dim=64)
    opt.save_pretrained(model)
    return "sft", common(model, data["sft_train"], tmp / "out") + ["data.packing=true"]


def overrides(command, *extra):
    def case(tmp, tiny_model_dir, data):
        train = data["prompts_train" if command == "grpo" else "sft_train"]
        return command, common(tiny_model_dir, train, tmp / "out") + list(extra)
    return case


CASES = {
    "max_grad_norm nan": (overrides("sft", "train.max_grad_norm=.nan"), "train.max_grad_norm is nan; give a finite"),
    "weight_decay inf": (overrides("sft", "train.weight_decay=.inf"), "train.weight_decay is inf"),
    "epsilon nan": (overrides("grpo", "algo.epsilon=.nan"), "algo.epsilon is nan"),
    "temperature nan": (overrides("grpo", "generation.temperature=.nan"), "generation.temperature is nan"),
    "tool_timeout inf": (overrides("grpo", "agent.tool_timeout=.inf"), "agent.tool_timeout is inf"),
    "reward weight nan": (overrides("grpo", "rewards=[{name: format, weight: .nan}]"), "rewards[0].weight is nan"),
    "resume another algorithm's run": (an_sft_run, "holds a `posttrain sft` run, and this is `posttrain dpo`"),
    "a data dir with no data file": (a_data_dir_without_data, "is a directory with no data file"),
    "config.json a list": (a_model_config_that_is_a_list, "config.json is damaged: it holds a JSON list"),
    "config.json vocab text": (a_model_vocab_that_is_text, "vocab_size is 'lots'; it must be a whole number > 0"),
    "mixed content names the row": (mixed_content, "chat.jsonl line 4: a field holds values of different shapes"),
    "packing a model that cannot pack": (packing_an_opt_model, "data.packing=true: OPTConfig"),
    "an image in SFT messages": (images, "data.train row 0: column 'messages' message 0 holds an 'image' part but "
                                 "the dataset has no 'images' column"),
}


@pytest.mark.parametrize("case", CASES)
def test_hostile_input_is_exit_2_naming_it_and_touches_nothing(tiny_model_dir, data, tmp_path, capsys, case):
    make, fragment = CASES[case]
    command, argv = make(tmp_path, tiny_model_dir, data)
    before = snapshot(tmp_path)
    expect_exit_2(capsys, run_cli(command, *argv), fragment)
    assert snapshot(tmp_path) == before


def test_output_dir_with_a_tilde_is_under_home(monkeypatch, tmp_path):
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe

    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = load_recipe(None, ["output_dir=~/runs/x", "data.train=d.jsonl"], ALGORITHMS["sft"][0])
    assert recipe.output_dir == str(Path(tmp_path) / "runs" / "x")


def test_an_input_error_found_once_the_run_has_written_is_exit_1_and_does_not_block_a_rerun(
        tiny_model_dir, data, tmp_path, capsys, monkeypatch):
    """Exit 2 promises nothing was written: an input error found after config.yaml (here: as the model loads) says
    where the run wrote and exits 1, and that directory takes a plain rerun."""
    import posttrain.run
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.errors import UserError
    from posttrain.rundir.claim import check_output_dir

    def refuses(recipe, algorithm):
        raise UserError("model.name_or_path: found wrong as it loaded")

    monkeypatch.setattr(posttrain.run, "load_policy", refuses)
    out = tmp_path / "out"
    argv = common(tiny_model_dir, data["sft_train"], out)
    assert run_cli("sft", *argv) == 1
    err = capsys.readouterr().err
    assert "found wrong as it loaded" in err and f"found once the run had started writing in {out}: exit 1" in err
    assert (out / "config.yaml").is_file()
    assert check_output_dir(load_recipe(None, argv, ALGORITHMS["sft"][0]), "sft") is None  # a plain rerun passes
