"""Regenerate posttrain/config/trl_defaults.py and docs/trl.md's table of TRL defaults from TRL's own dataclasses.

    python scripts/trl_defaults.py            # rewrite both (needs trl installed: the version the table is read from)
    python scripts/trl_defaults.py --check    # exit 1 when either is out of date (tests/unit/test_trl_defaults.py)

Why a generated table: a run given in TRL's words (TRL flags, a flat TRL config) must take TRL's default for every
setting it leaves out, and how TRL's parser reads each flag, without importing trl (optional, and slow) at run time.
Read from: the fields of each trainer's config, TRL's `ModelConfig` and the script arguments `trl <command>` parses
(the same dataclass tuples as trl/scripts/*.py), through TRL's own argument parser for the flag kinds.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import pprint
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.algorithms import ALGORITHMS  # noqa: E402
from posttrain.config.keys import recipe_keys  # noqa: E402
from posttrain.config.trl_compat import NONE_IS_A_VALUE, NONE_MEANS, TRL_KEYS, NoEffect  # noqa: E402

MODULE = ROOT / "posttrain" / "config" / "trl_defaults.py"
DOC = ROOT / "docs" / "trl.md"
BEGIN, END = "<!-- trl-defaults: begin (scripts/trl_defaults.py) -->", "<!-- trl-defaults: end -->"
TRAINERS = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig", "rm": "RewardConfig",
            "distill": "DistillationConfig"}  # posttrain ppo: TRL 1.16 has no PPO trainer
# Fields TRL's __post_init__ resolves to a constant (bf16: None means "true unless fp16"): the instance's value
RESOLVED_AFTER_INIT = ("bf16",)
# Fields TRL's __post_init__ derives from others (generation_batch_size = batch x steps_per_generation): no constant
DERIVED = ("generation_batch_size",)
# TRL's value (None: unset) and posttrain's default say the same thing
SAME_MEANING = {"model.revision": ("main", None), "data.completion_only_loss": (None,),
                "model.attn_implementation": (None,), "algo.center_rewards_coefficient": (None,)}
# TRL keys left unset that the table of unset keys does not list: what the run is about (the user gives them), or a
# second name whose value another TRL key sets (vllm_importance_sampling_clip_max sets the cap)
NOT_LISTED = ("dataset_name", "model_name_or_path", "vllm_importance_sampling_cap")
NOTES = {"bf16": "TRL's field is None, made true unless fp16 (its `__post_init__`)",
         "lora_target_modules": "None: PEFT's modules for the architecture (`q_proj v_proj` for Llama and Qwen); "
                                "`[]` in a recipe",
         "max_tool_calling_iterations": "None: no turn limit (`agent.max_turns: null`); a trajectory ends when a turn "
                                        "calls no tool or its completion budget is used up",
         "lmbda": "DistillationConfig has no such field: DistillationTrainer samples every completion (on-policy)",
         "vllm_importance_sampling_correction": "with `use_vllm` only", "vllm_importance_sampling_clip_max":
         "with `use_vllm` only", "report_to": "no trackers: `--report_to tensorboard` for TensorBoard's events"}
# What a TRL trainer does that no field of its config says: DistillationConfig has no lmbda, and DistillationTrainer
# samples every completion from the student (on-policy), which is lmbda 1 here (GKD's own lmbda is 0.5)
TRAINER_BEHAVIOUR = {"distill": {"lmbda": 1.0}}
UNSET_MEANS = {"eval_steps": "with `eval_strategy steps`, evaluate every `logging_steps` steps (here too: "
                             "`train.eval_steps` takes `train.logging_steps`); else posttrain's 0: at step 0 and the "
                             "end, when `data.eval` is given"}


def script_classes(command: str) -> tuple[type, ...]:
    """The dataclasses `trl <command>` parses (trl/scripts/<command>.py), the trainer's config second."""
    import trl
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    script = GRPOScriptArguments if command == "grpo" else trl.ScriptArguments
    return script, getattr(trl, TRAINERS[command]), trl.ModelConfig, DatasetMixtureConfig


def trl_defaults(command: str) -> dict[str, Any]:
    """TRL key -> TRL 1.16's default, for every field of the command's TRL classes that maps onto a recipe key."""
    classes = script_classes(command)
    instance = classes[1](output_dir="x", use_cpu=True)  # use_cpu: bf16's default is refused without a GPU
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name not in TRL_KEYS or f.name in DERIVED or f.name == "output_dir":
                continue
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name in RESOLVED_AFTER_INIT and cls is classes[1]:
                value = getattr(instance, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return {**out, **TRAINER_BEHAVIOUR.get(command, {})}


def same(a: Any, b: Any) -> bool:
    norm = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
    return norm(a) == norm(b) and isinstance(a, bool) == isinstance(b, bool)


@functools.lru_cache(maxsize=None)  # the module and the page read the same tables
def differing(command: str) -> tuple[dict[str, Any], list[tuple[str, str, Any, Any]], list[tuple[str, str, Any]]]:
    """(TRL key -> TRL default, for those that set a recipe key to another value than posttrain's default; the rows
    of that table (TRL key, recipe key, TRL's, posttrain's); the TRL keys TRL leaves unset (None) where posttrain
    has a value, which keep posttrain's)."""
    algo_cls = ALGORITHMS[command][0]
    posttrain = {k.path: k.default for k in recipe_keys(algo_cls)}
    table, rows, unset = {}, [], []
    for key, value in trl_defaults(command).items():
        path, convert = TRL_KEYS[key]
        if path not in posttrain:
            continue
        if value is None and path not in NONE_IS_A_VALUE and key not in NONE_MEANS:
            if posttrain[path] is not None and path not in SAME_MEANING and key not in NOT_LISTED:
                unset.append((key, path, posttrain[path]))
            continue
        try:
            converted = NONE_MEANS[key] if value is None and key in NONE_MEANS else convert(value) if convert else value
        except NoEffect:
            continue
        if (converted is None and path not in NONE_IS_A_VALUE) or same(converted, posttrain[path]) or (
                path in SAME_MEANING and converted in SAME_MEANING[path]):
            continue
        table[key] = value
        rows.append((key, path, value, posttrain[path]))
    return table, rows, unset


@functools.lru_cache(maxsize=None)
def flag_kinds(command: str) -> tuple[dict[str, str], list[str]]:
    """How `trl <command>` parses each flag (TRL's own parser): field -> bool | int | float | str | list:<kind>, and
    the boolean fields with a `--no_<field>` form (those whose default is True)."""
    from trl.scripts._hf_argparser import string_to_bool
    from trl.scripts.utils import TrlParser

    parser = TrlParser(script_classes(command))
    kinds, no_flags = {}, []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        if any(o.startswith("--no_") for o in action.option_strings) and isinstance(action, argparse._StoreFalseAction):
            no_flags.append(action.dest)
            continue
        kind = kind_of(action.type, getattr(action, "choices", None), string_to_bool)
        kinds[action.dest] = f"list:{kind}" if action.nargs == "+" else kind
    return kinds, sorted(no_flags)


def kind_of(parse: Any, choices: Any, string_to_bool: Any) -> str:
    if parse is string_to_bool:
        return "bool"
    if choices:
        return "str"
    inner = parse
    while getattr(inner, "__closure__", None):  # TRL's _accept_none(int) wraps the field's type
        inner = next(c.cell_contents for c in inner.__closure__ if callable(c.cell_contents))
    return {int: "int", float: "float"}.get(inner, "str")


def module_text() -> str:
    import trl

    defaults = {command: differing(command)[0] for command in TRAINERS}
    shared = {key: value for key, value in defaults["sft"].items()
              if all(key in d and same(d[key], value) for d in defaults.values())}
    defaults = {command: {k: v for k, v in d.items() if k not in shared} for command, d in defaults.items()}
    kinds_by_command = {command: flag_kinds(command) for command in TRAINERS}
    every = sorted({name for kinds, _ in kinds_by_command.values() for name in kinds})
    common, special = {}, {}
    for name in every:
        seen = {kinds.get(name) for kinds, _ in kinds_by_command.values()} - {None}
        if len(seen) == 1:
            common[name] = seen.pop()
        else:
            for command, (kinds, _) in kinds_by_command.items():
                if name in kinds:
                    special.setdefault(command, {})[name] = kinds[name]
    by_kind: dict[str, list[str]] = {}
    for name, kind in common.items():
        by_kind.setdefault(kind, []).append(name)
    no_flags = sorted({name for _, names in kinds_by_command.values() for name in names})
    fmt = (lambda value: pprint.pformat(value, width=116, sort_dicts=False))
    return f'''"""TRL {trl.__version__}'s defaults and flag kinds, GENERATED by `python scripts/trl_defaults.py` from
TRL's own dataclasses and argument parser: do not edit by hand (tests/unit/test_trl_defaults.py fails when stale).

TRL_DEFAULTS: per command, the TRL keys whose TRL default sets a recipe key to something other than posttrain's
default (with COMMON_DEFAULTS, those every trainer shares); a run given in TRL's words (docs/trl.md) takes these for
whatever it leaves out.
FLAG_KINDS: how TRL's parser reads each flag's text (kind -> field names); FLAG_KINDS_BY_COMMAND where trainers
differ (DPO's loss_type is a list). NO_FLAGS: the booleans that also take TRL's `--no_<field>` form.
"""

TRL_VERSION = {trl.__version__!r}
TRAINER_CONFIGS = {fmt(TRAINERS)}
COMMON_DEFAULTS = {fmt(shared)}
TRL_DEFAULTS = {fmt(defaults)}
FLAG_KINDS = {fmt({kind: " ".join(names) for kind, names in sorted(by_kind.items())})}
FLAG_KINDS_BY_COMMAND = {fmt(special)}
NO_FLAGS = {fmt(" ".join(no_flags))}
'''


def doc_table() -> str:
    import trl

    lines = [BEGIN, "", f"| command (TRL {trl.__version__} config) | TRL key | recipe key | TRL's default "
             "| posttrain's default | note |", "|---|---|---|---|---|---|"]
    unset_rows = []
    for command, config in TRAINERS.items():
        _, rows, unset = differing(command)
        lines += [f"| `{command}` ({config}) | `{key}` | `{path}` | `{value!r}` | `{here!r}` | {NOTES.get(key, '')} |"
                  for key, path, value, here in rows]
        unset_rows += [(command, key, path, here) for key, path, here in unset]
    lines += ["", "TRL leaves these unset (None) and decides later; a run in TRL's words decides as TRL does (give "
              "the TRL key to choose):", "",
              "| command | TRL key | recipe key | posttrain's default | TRL's None means |", "|---|---|---|---|---|"]
    lines += [f"| `{command}` | `{key}` | `{path}` | `{here!r}` | {UNSET_MEANS[key]} |"
              for command, key, path, here in unset_rows]
    return "\n".join(lines + ["", END])


def doc_text() -> str:
    page = DOC.read_text()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + doc_table() + page[end:]


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = [path for path, text in ((MODULE, module_text()), (DOC, doc_text()))
             if not path.exists() or path.read_text() != text]
    if check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python scripts/trl_defaults.py", file=sys.stderr)
        return 1 if stale else 0
    MODULE.write_text(module_text())
    DOC.write_text(doc_text())
    print(f"wrote {MODULE.relative_to(ROOT)} and the table in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
