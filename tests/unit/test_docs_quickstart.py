"""docs/quickstart.md's "same run in TRL's words" is the same run: its TRL flags build the recipe its posttrain
command builds (TRL's defaults for what the flags leave out included)."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from posttrain.algorithms import ALGORITHMS
from posttrain.cli import command_line_overrides
from posttrain.config.load import resolve_recipe
from posttrain.config.trl_flags import split_trl_flags

ROOT = Path(__file__).resolve().parents[2]


def commands(command: str) -> list[str]:
    """Every `posttrain <command> ...` of the quickstart, continuation lines joined."""
    page = (ROOT / "docs" / "quickstart.md").read_text()
    return [" ".join(line.rstrip("\\").strip() for line in block.splitlines())
            for block in re.findall(rf"^(posttrain {command} .*?)(?<!\\)$", page, re.M | re.S)]


def recipe_of(line: str):
    """The recipe the CLI builds for a command line (without running it)."""
    argv = shlex.split(line)[1:]
    rest, flags = split_trl_flags(argv)
    config = str(ROOT / rest[rest.index("--config") + 1]) if "--config" in rest else None
    algo_cls = ALGORITHMS[argv[0]][0]
    overrides = command_line_overrides([a for a in rest[1:] if "=" in a], flags, algo_cls)
    return resolve_recipe(config, overrides, algo_cls, trl_flags=flags)[0]


def what_runs(recipe) -> dict:
    """The recipe less the settings that change nothing in this run, each for a stated reason."""
    out = dataclasses.asdict(recipe)
    del out["output_dir"]  # the two write to different folders on purpose
    if not recipe.model.lora.enabled:
        del out["model"]["lora"]  # LoRA's settings without LoRA
    if recipe.train.max_steps > 0:
        del out["train"]["num_train_epochs"]  # max_steps ends the run
    if not recipe.data.eval:
        del out["train"]["eval_steps"]  # nothing to evaluate
    if not {"wandb", "trackio", "mlflow"} & set(recipe.train.report_to):
        del out["train"]["project"]  # no tracker reads it
    return out


def test_the_trl_words_sft_command_is_the_same_run():
    posttrain_line, trl_line = commands("sft")[:2]
    assert "--config" in posttrain_line and "--model_name_or_path" in trl_line
    assert what_runs(recipe_of(trl_line)) == what_runs(recipe_of(posttrain_line))
