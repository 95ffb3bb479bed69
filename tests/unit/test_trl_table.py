"""Every field of TRL 1.16's configs (read from TRL's own dataclasses) is translated, accepted with a line saying why it
has no effect, or refused with what to do instead; never dropped and never answered with a guess. A whole TRL config
of defaults translates; two keys for one recipe key are refused naming both."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from posttrain.algorithms import ALGORITHMS
from posttrain.cli import main
from posttrain.config.load import load_recipe
from posttrain.config.trl_compat import TRL_KEYS, translate
from posttrain.config.trl_rewards import REWARD_KEYS
from posttrain.config.trl_table import IGNORED, REFUSED, changes_nothing
from posttrain.data import rename_text_field
from posttrain.errors import UserError

trl = pytest.importorskip("trl")
from trl.scripts.grpo import GRPOScriptArguments  # noqa: E402
from trl.scripts.utils import DatasetMixtureConfig  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.gkd import GKDConfig  # noqa: E402

TRAINER_CONFIGS = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig, "rm": trl.RewardConfig}
SCRIPT_CONFIGS = (trl.ModelConfig, trl.ScriptArguments, GRPOScriptArguments, DatasetMixtureConfig)
DISTILL_CONFIGS = (trl.DistillationConfig, GKDConfig)  # TRL's distillation trainer, and GKD's (trl.experimental)
ALL_FIELDS = sorted({f.name for cls in (*TRAINER_CONFIGS.values(), *SCRIPT_CONFIGS, *DISTILL_CONFIGS)
                     for f in dataclasses.fields(cls)})


def default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def defaults(*classes) -> dict:
    return {f.name: default(f) for cls in classes for f in dataclasses.fields(cls)
            if not (f.name == "output_dir" and default(f) is None)}


def test_trl_is_the_version_the_table_was_read_from():
    assert trl.__version__.startswith("1.16"), "re-read TRL's config fields into config/trl_table.py"


@pytest.mark.parametrize("key", ALL_FIELDS)
def test_every_trl_field_has_exactly_one_answer(key):
    answers = [key in TRL_KEYS, key in IGNORED, key in REFUSED, key in REWARD_KEYS]  # rewards: one list
    assert sum(answers) == 1, (key, answers)


def test_docs_trl_md_lists_every_trl_field():
    page = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text()
    assert [key for key in ALL_FIELDS if f"`{key}`" not in page] == []


@pytest.mark.parametrize("command, cls", [*TRAINER_CONFIGS.items(), *(("distill", c) for c in DISTILL_CONFIGS)])
def test_a_whole_trl_config_of_defaults_translates(command, cls, tmp_path, capsys):
    """TRL's defaults change nothing they should not: every ignored or refused field's default is harmless, and the
    file (trainer config + the CLI's script arguments) loads as a recipe."""
    flat = defaults(cls, *SCRIPT_CONFIGS)
    for f in dataclasses.fields(cls):
        if (f.name in IGNORED or f.name in REFUSED) and f.name != "disable_dropout":  # said: TRL's differs
            harmless = (IGNORED.get(f.name) or REFUSED[f.name])[0]
            assert changes_nothing(default(f), harmless), (cls.__name__, f.name, default(f))
    config = tmp_path / "trl.yaml"
    extra = {"data": {"train": "x.jsonl"}} | ({"rewards": [{"name": "exact_match"}]} if command == "grpo" else {}) \
        | ({"algo": {"teacher_model_name_or_path": "t/"}} if command == "distill" else {})
    config.write_text(yaml.safe_dump({**flat, "output_dir": str(tmp_path / "run"), **extra}))
    recipe = load_recipe(str(config), [], ALGORITHMS[command][0])
    trl_config = {f.name: default(f) for f in dataclasses.fields(cls)}
    assert recipe.train.learning_rate == trl_config["learning_rate"]
    assert recipe.train.num_train_epochs == trl_config["num_train_epochs"]
    assert recipe.train.gradient_checkpointing is trl_config["gradient_checkpointing"]
    assert recipe.train.fused_optimizer is True  # optim: adamw_torch_fused
    assert recipe.train.save_total_limit is None  # TRL keeps every checkpoint
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain: note:")]
    said = {line.split(": ")[3].split()[0] for line in notes}
    assert said <= {"eval_strategy", "disable_dropout"}, notes  # TRL's "no eval" default, DPO/RM's dropout
    if cls is GKDConfig:  # GKD's own keys mean what they mean there
        assert (recipe.algo.lmbda, recipe.algo.beta) == (trl_config["lmbda"], trl_config["beta"])
        assert recipe.generation.max_completion_length == trl_config["max_new_tokens"]
        assert recipe.generation.temperature == recipe.algo.loss_temperature(recipe) == trl_config["temperature"]


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_refused_field_says_what_to_do_never_a_guess(key):
    with pytest.raises(UserError) as e:
        translate({key: "some value"}, "command line", ALGORITHMS["grpo"][0], "--")
    assert f"--{key}: {REFUSED[key][1]}" in str(e.value) and "did you mean" not in str(e.value)


@pytest.mark.parametrize("key", sorted(IGNORED))
def test_an_ignored_field_is_accepted_with_one_line_saying_why(key, capsys):
    assert translate({key: "some value"}, "command line", ALGORITHMS["grpo"][0], "--") == []
    err = capsys.readouterr().err
    assert err == f"posttrain: note: command line: --{key} has no effect here: {IGNORED[key][1]}\n"


def test_the_issue_flags(capsys):
    grpo = ALGORITHMS["grpo"][0]
    assert translate({"eval_strategy": "steps", "eval_steps": 50}, "cli", grpo, "--") == [
        ("eval_steps", "train.eval_steps", 50)]
    with pytest.raises(UserError, match="--eval_strategy: 'epoch' is not available: evaluate every train.eval_steps"):
        translate({"eval_strategy": "epoch"}, "cli", grpo, "--")
    assert translate({"dataset_text_field": "content"}, "cli", ALGORITHMS["sft"][0], "--") == [
        ("dataset_text_field", "data.text_field", "content")]
    assert translate({"push_to_hub": True, "use_liger_kernel": True}, "cli", grpo, "--") == []
    err = capsys.readouterr().err
    assert "huggingface-cli upload <your-name/model> <output_dir>/final" in err and "fused output layer" in err
    assert translate({"optim": "adamw_torch"}, "cli", grpo) == [("optim", "train.fused_optimizer", False)]
    with pytest.raises(UserError, match="'adamw_8bit' is not available: the optimiser is AdamW"):
        translate({"optim": "adamw_8bit"}, "cli", grpo)
    assert translate({"loss_type": ["ipo"]}, "cli", ALGORITHMS["dpo"][0]) == [("loss_type", "algo.loss_type", "ipo")]
    assert translate({"max_tool_calling_iterations": 3}, "cli", grpo) == [
        ("max_tool_calling_iterations", "agent.max_turns", 4)]


@pytest.mark.parametrize("argv, both", [
    (["--max_length", "512", "--max_seq_length", "1024"], ("--max_length (512)", "--max_seq_length (1024)")),
    (["--learning_rate", "1e-4", "train.learning_rate=2e-4"], ("--learning_rate 0.0001", "train.learning_rate=2e-4")),
    (["--learning_rate", "1e-4", "--learning_rate=2e-4"], ("--learning_rate is given twice", "1e-4 and 2e-4")),
])
def test_two_settings_of_one_key_are_refused_naming_both(argv, both, capsys):
    assert main(["sft", "data.train=x.jsonl", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("posttrain: error:") == 1 and all(part in err for part in both), err


def test_a_flat_key_and_its_section_key_in_one_file_are_refused_naming_both(tmp_path):
    config = tmp_path / "mixed.yaml"
    config.write_text("learning_rate: 1.0e-4\ntrain:\n  learning_rate: 2.0e-4\ndata:\n  train: x.jsonl\n")
    with pytest.raises(UserError, match=r"learning_rate \(0.0001\) and train.learning_rate \(0.0002\) both set"):
        load_recipe(str(config), [], ALGORITHMS["sft"][0])


def test_text_field_names_the_column_read_as_text():
    import datasets

    rows = datasets.Dataset.from_list([{"content": "hello", "id": 1}])
    assert rename_text_field(rows, "content", "data.train").column_names == ["text", "id"]
    with pytest.raises(UserError, match="data.text_field='body' names no column"):
        rename_text_field(rows, "body", "data.train")
    both = datasets.Dataset.from_list([{"content": "a", "text": "b"}])
    with pytest.raises(UserError, match="also hold a 'text' column"):
        rename_text_field(both, "content", "data.train")


def test_distillation_keys_of_trl_and_gkd_map_or_are_refused_saying_what_to_use():
    """GKDConfig (trl.experimental.gkd) and DistillationConfig keys, as flags of `posttrain distill`: lmbda, beta,
    temperature (the sampling and the loss's), max_new_tokens and the teacher mean the same here; seq_kd and the
    teacher's model_init_kwargs are refused with what to do instead; under another command, a distillation key is
    refused as one that command does not take."""
    from posttrain.cli import command_line_overrides
    from posttrain.config.load import resolve_recipe
    from posttrain.config.trl_flags import split_trl_flags

    algo_cls = ALGORITHMS["distill"][0]
    rest, flags = split_trl_flags(["distill", "--model_name_or_path", "m/", "--dataset_name", "d.jsonl",
                                   "--teacher_model_name_or_path", "t/", "--teacher_model_revision", "v2",
                                   "--lmbda", "0.25", "--beta", "0.2", "--temperature", "0.7",
                                   "--max_new_tokens", "32"])
    recipe, _ = resolve_recipe(None, command_line_overrides(rest[1:], flags, algo_cls), algo_cls, trl_flags=flags)
    assert (recipe.algo.teacher_model_name_or_path, recipe.algo.teacher_model_revision) == ("t/", "v2")
    assert (recipe.algo.lmbda, recipe.algo.beta, recipe.generation.max_completion_length) == (0.25, 0.2, 32)
    assert recipe.algo.loss_temperature(recipe) == recipe.generation.temperature == 0.7
    with pytest.raises(UserError, match="--seq_kd: sequence-level KD .* posttrain sft"):
        translate({"seq_kd": True}, "command line", algo_cls, "--")
    with pytest.raises(UserError, match="--teacher_model_init_kwargs: the teacher loads as the student does"):
        translate({"teacher_model_init_kwargs": {"dtype": "float16"}}, "command line", algo_cls, "--")
    assert translate({"seq_kd": False, "teacher_model_init_kwargs": None}, "command line", algo_cls, "--") == []
    with pytest.raises(UserError, match="--lmbda: posttrain's algo.lmbda, which `posttrain sft` does not take"):
        translate({"lmbda": 0.5}, "command line", ALGORITHMS["sft"][0], "--")


def test_a_distill_run_in_trls_words_samples_every_completion_as_trls_trainer():
    """TRL 1.16's DistillationTrainer has no lmbda field and samples every completion from the student: a distill
    run given in TRL's words without --lmbda is on-policy (lmbda 1), not posttrain's 0.5; --lmbda still wins."""
    from posttrain.cli import command_line_overrides
    from posttrain.config.load import resolve_recipe
    from posttrain.config.trl_flags import split_trl_flags

    algo_cls = ALGORITHMS["distill"][0]
    lmbdas = []
    for extra in ([], ["--lmbda", "0.25"]):
        rest, flags = split_trl_flags(["distill", "--model_name_or_path", "m/", "--dataset_name", "d.jsonl",
                                       "--teacher_model_name_or_path", "t/", *extra])
        recipe, _ = resolve_recipe(None, command_line_overrides(rest[1:], flags, algo_cls), algo_cls, trl_flags=flags)
        lmbdas.append(recipe.algo.lmbda)
    import trl

    assert "lmbda" not in {f.name for f in dataclasses.fields(trl.DistillationConfig)}
    assert lmbdas == [1.0, 0.25]
