"""TRL-style flags out of a command line, each value read as TRL's own argument parser reads it.

    rest, flags = split_trl_flags(["grpo", "--eval_strategy", "no", "--no_remove_unused_columns", "train.max_steps=3"])
    # rest == ["grpo", "train.max_steps=3"]; flags == {"eval_strategy": "no", "remove_unused_columns": False}

Why not YAML: a TRL user's `--eval_strategy no` means the word `no` (TRL's field is a string), where YAML reads a
boolean. How TRL parses each field (config/trl_defaults.py, generated from TRL's parser) decides: strings stay the
words given, booleans take TRL's words (true/false, yes/no, ...), numbers must be numbers, lists take several words,
and booleans whose TRL default is true also take `--no_<name>`. Keys TRL 1.16 has no field for (PPOConfig's, older
TRL names) are read as YAML, as `key=value` overrides are. Pure and quick: no torch, so a wrong flag is refused at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from posttrain.config.keys import recipe_key
from posttrain.config.schema import Recipe
from posttrain.config.trl_defaults import FLAG_KINDS, FLAG_KINDS_BY_COMMAND, NO_FLAGS
from posttrain.config.trl_rewards import LIST_KEYS
from posttrain.errors import UserError

RECIPE_TOP_LEVEL = tuple(recipe_key(f) for f in dataclasses.fields(Recipe))  # the recipe's sections
KIND_OF = {name: kind for kind, names in FLAG_KINDS.items() for name in names.split()}
NEGATABLE = frozenset(NO_FLAGS.split())
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")  # TRL's string_to_bool
NONE_WORDS = ("none", "null")  # TRL's parser reads these as None for an optional number or list


def flag_kind(name: str, command: str) -> str | None:
    """bool | int | float | str | list:<kind> as TRL parses `--name` for `command`; None for a key TRL 1.16 lacks."""
    return FLAG_KINDS_BY_COMMAND.get(command, {}).get(name) or KIND_OF.get(name)


def read_flag(name: str, texts: list[str], command: str) -> Any:
    """The value of `--name texts...` as TRL reads it (a bare `--name`: true). Raises UserError naming the flag."""
    kind = flag_kind(name, command)
    if kind is None:
        values = [parse_value(text) for text in texts or ["true"]]
        return values[0] if len(values) == 1 else values
    if not texts:
        if kind == "bool":
            return True
        raise UserError(f"command line: --{name} needs a value (TRL's {kind.removeprefix('list:')} field)")
    item_kind = kind.removeprefix("list:")
    if kind != item_kind and len(texts) == 1 and texts[0].startswith("[") and texts[0].endswith("]"):
        listed = parse_value(texts[0])  # a YAML list, as in `key=[a, b]` (and earlier continue commands)
        texts = [str(v) for v in listed] if isinstance(listed, list) else texts
    if kind == item_kind and item_kind != "str" and len(texts) > 1:
        raise UserError(f"command line: --{name} takes one value, got {len(texts)}: {' '.join(texts)}")
    values = [read_one(name, text, item_kind) for text in texts]
    if kind.startswith("list:"):
        return None if values == [None] else values
    return values[0] if len(values) == 1 else values  # several words for a string: report_to wandb tensorboard


def read_one(name: str, text: str, kind: str) -> Any:
    if kind == "str":
        return text
    if kind != "bool" and text.lower() in NONE_WORDS:
        return None
    try:
        if kind == "bool":
            if text.lower() not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError
            return text.lower() in TRUE_WORDS
        if kind == "int":
            return int(text)
        return int(text) if text.lstrip("+-").isdigit() else float(text)  # TRL's float fields: 10 is 10 steps
    except ValueError:
        expected = {"bool": "true or false (yes/no, 1/0)", "int": "a whole number", "float": "a number"}[kind]
        raise UserError(f"command line: --{name} {text}: expected {expected}, as TRL reads it") from None


TRAINING_OPTIONS = {"config": True, "ray": False, "help": False}
"""A training command's own options (name -> takes a value), left for argparse; every other --flag is TRL's."""


def split_trl_flags(argv: list[str], own: dict[str, bool] | None = None) -> tuple[list[str], dict[str, Any]]:
    """TRL-style `--key value`, `--key=value`, `--key v1 v2 ...` (a list), bare `--flag` (true) and `--no_flag`
    (false, for TRL's booleans that default to true) out of a command's arguments; the rest back. A flag given twice
    is refused naming both values, except the reward lists, where a repeated flag adds to the list. `own`: the
    command's own options (TRAINING_OPTIONS unless given: `posttrain plan` has its own)."""
    rest, flags, _ = split_trl_flag_texts(argv, own)
    return rest, flags


def split_trl_flag_texts(argv: list[str], own: dict[str, bool] | None = None
                         ) -> tuple[list[str], dict[str, Any], dict[str, list[str]]]:
    """split_trl_flags, and each flag's words as typed (to write the flag back unchanged)."""
    own = TRAINING_OPTIONS if own is None else own
    command = next((a for a in argv if not a.startswith("-")), "")
    rest, flags, typed, i = [], {}, {}, 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if not arg.startswith("--") or name in own or arg == "--":
            rest.append(arg)
            if (own.get(name) or arg == "-c") and "=" not in arg and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
            i += 1
            continue
        words = [arg.split("=", 1)[1]] if "=" in arg else []
        while "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--") \
                and not looks_like_override(argv[i + 1]):  # every value up to the next flag (TRL's nargs='+')
            words.append(argv[i + 1])
            i += 1
        if name.startswith("no_") and name[3:] in NEGATABLE and not words:  # TRL's --no_remove_unused_columns
            name, value = name[3:], False
        else:
            value = read_flag(name, words, command)
        if name in LIST_KEYS and name in flags:  # --reward_funcs a --reward_funcs b: both
            value = _as_list(flags[name]) + _as_list(value)
            typed[name] = typed[name] + words
        elif name in typed:
            raise UserError(f"command line: --{name} is given twice ({' '.join(typed[name]) or 'true'} and "
                            f"{' '.join(words) or 'true'}); keep one")
        else:
            typed[name] = words if value is not False or words else ["false"]
        flags[name] = value
        i += 1
    return rest, flags, typed


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


def looks_like_override(arg: str) -> bool:
    """train.max_steps=20 (a recipe override), as opposed to a flag's value."""
    key = arg.split("=", 1)[0]
    return "=" in arg and (key.split(".")[0] in RECIPE_TOP_LEVEL)


def parse_value(text: str) -> Any:
    """A flag's text as YAML reads it, except that 1e-6 is a number (YAML 1.1 wants 1.0e-6)."""
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value
