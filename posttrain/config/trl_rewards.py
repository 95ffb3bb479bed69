"""TRL's reward keys -> the recipe's `rewards:` list (as flags or in a flat TRL config file).

    posttrain grpo --config trl.yaml --reward_funcs my_rewards.py:accuracy my_lib.rewards.fmt runs/rm/final \
        --reward_weights 1.0 0.2 0.5
    -> rewards: [{name: my_rewards.py:accuracy, weight: 1.0}, {name: my_lib.rewards.fmt, weight: 0.2},
                 {name: reward_model, kwargs: {path: runs/rm/final}, weight: 0.5}]

- reward_funcs (TRL's GRPOScriptArguments, a list): each a posttrain built-in, an import path ('module.function' as
  TRL writes it, 'module:function', 'file.py:function'), or a reward model (a directory, or a hub id 'org/name'),
  which TRL loads as a sequence-classification model. Several values follow one flag (TRL's nargs='+'); a repeated
  flag or comma-separated values add to the list (TRL's parser would keep only the last flag).
- reward_model_name_or_path (GRPOScriptArguments): one more reward model, put first as TRL's script does.
- reward_weights (GRPOConfig): one number per reward, in order; given with the rewards they weigh (TRL's rule: the
  counts must match).
Given, these keys replace the recipe's `rewards:` list.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

REWARD_KEYS = ("reward_model_name_or_path", "reward_funcs", "reward_weights")
"""TRL keys that together make the recipe's rewards (translated together, never one by one)."""
LIST_KEYS = ("reward_funcs", "reward_weights")
"""Keys a repeated flag adds to instead of replacing."""
TRL_BUILTINS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
"""Names TRL's `trl grpo` script knows as built-ins (importable as trl.rewards.<name> where trl is installed)."""


def is_model_path(name: str) -> bool:
    """A reward that only a model can be: a local directory, or a path / hub id with '/' that names no Python file."""
    return Path(name).expanduser().is_dir() or ("/" in name and ":" not in name and not name.endswith(".py"))


def _names(value: Any) -> list[Any]:
    """A flag's value(s) as a list, comma-separated strings split."""
    values = value if isinstance(value, (list, tuple)) else [value]
    out: list[Any] = []
    for v in values:
        out += [part.strip() for part in v.split(",")] if isinstance(v, str) else [v]
    return out


def rewards_from_trl(flat: dict[str, Any], shown: str = "") -> tuple[list[dict] | None, list[str]]:
    """Pop REWARD_KEYS from `flat` -> (the rewards list, or None when none is given; problems, one line each, each
    naming `shown` + key)."""
    given = {key: flat.pop(key) for key in REWARD_KEYS if key in flat}
    if all(value is None for value in given.values()):  # TRL's default (None): the recipe's rewards stay
        return None, []
    problems: list[str] = []
    names = _names(given["reward_model_name_or_path"]) if given.get("reward_model_name_or_path") else []
    names += _names(given["reward_funcs"]) if given.get("reward_funcs") is not None else []
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        problems.append(f"{shown}reward_funcs: {bad[0]!r} is not a reward; give built-in names, import paths "
                        "('module.function', 'file.py:function') or reward model directories")
    weights = _names(given["reward_weights"]) if given.get("reward_weights") is not None else None
    if weights is not None:
        odd = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real)]
        if odd:
            problems.append(f"{shown}reward_weights: {odd[0]!r} is not a number; give one number per reward")
        elif not names:
            problems.append(f"{shown}reward_weights: weights with no {shown}reward_funcs beside them; give the "
                            f"rewards they weigh there too (or set rewards[].weight in the recipe)")
        elif len(weights) != len(names):
            problems.append(f"{shown}reward_weights: {len(weights)} weights for {len(names)} rewards "
                            f"({', '.join(map(str, names))}); give one weight per reward, in order")
    if problems:
        return None, problems
    entries = []
    for i, name in enumerate(names):
        entry: dict[str, Any] = ({"name": "reward_model", "kwargs": {"path": name}} if is_model_path(name)
                                 else {"name": name})
        if weights is not None:
            entry["weight"] = float(weights[i])
        entries.append(entry)
    return entries, []
