"""The recipe's `rewards:` entries -> callables, checked at start-up before any compute is spent.

    reward = load_reward(RewardConfig(name="my_rewards:has_citation", kwargs={"min_count": 2}, weight=0.5))
    rewards = load_rewards(recipe.rewards)                  # a RewardSet, names made unique

`name` is what TRL's `reward_funcs` takes, and posttrain's spellings:
- a built-in (see posttrain.rewards.builtin.BUILTIN_REWARDS);
- 'package.module.function' (TRL's dotted import path) or 'package.module:function' (the module is looked up on
  sys.path and in the current directory), or 'path/to/file.py:function';
- reward_model with kwargs.path: a sequence-classification model (`--reward_funcs runs/rm/final`, TRL's way of
  naming a reward model, becomes this entry: posttrain/config/trl_rewards.py).
A function gets the kwargs bound with functools.partial. A class is instantiated once with the kwargs and its
instances are called (for rewards that load something, like a verifier or a model).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Sequence

from posttrain.config.schema import RewardConfig
from posttrain.config.trl_rewards import TRL_BUILTINS, is_model_path
from posttrain.errors import UserError
from posttrain.rewards.builtin import BUILTIN_REWARDS, check_builtin_kwargs
from posttrain.rewards.combine import ON_ERROR, Reward, RewardSet
from posttrain.rewards.contract import contract_misfit
from posttrain.usercode import UserCodeError, call_user, load_callable


def load_reward(cfg: RewardConfig) -> Reward:
    """One recipe entry -> Reward(name, fn, weight, timeout, on_error); UserError naming the entry if unusable."""
    if cfg.on_error not in ON_ERROR:
        raise UserError(f"reward '{cfg.name}': on_error must be raise or skip, got {cfg.on_error!r}")
    if not cfg.timeout > 0:
        raise UserError(f"reward '{cfg.name}': timeout must be > 0 seconds, got {cfg.timeout}")
    kwargs = dict(cfg.kwargs)
    if cfg.name in BUILTIN_REWARDS:
        check_builtin_kwargs(cfg.name, kwargs)
        target = BUILTIN_REWARDS[cfg.name]
        fn = target(**kwargs) if isinstance(target, type) else functools.partial(target, **kwargs)
        columns = tuple(getattr(fn, "columns", ()))  # a built-in class may read columns by name (the judge)
        return Reward(cfg.name, fn, cfg.weight, cfg.timeout, cfg.on_error, columns)
    if ":" in cfg.name:
        target = load_callable(cfg.name, "reward")
    elif "." in cfg.name and not cfg.name.endswith(".py") and not is_model_path(cfg.name):  # TRL's 'module.function'
        module, _, function = cfg.name.rpartition(".")
        target = load_callable(f"{module}:{function}", "reward", shown=cfg.name)
    else:
        raise UserError(_unknown(cfg.name))
    name = cfg.name.rpartition(":")[2].rsplit(".", 1)[-1]
    fn = _bind(cfg.name, target, kwargs)
    misfit = contract_misfit(fn)
    if misfit:
        raise UserError(f"reward '{cfg.name}' cannot be a reward function: {misfit}")
    return Reward(name, fn, cfg.weight, cfg.timeout, cfg.on_error)


def _unknown(name: str) -> str:
    if name.endswith(".py"):
        return f"reward '{name}' names a file; say which function in it: '{name}:my_reward'"
    if is_model_path(name):
        return (f"reward '{name}' looks like a model; in a recipe a reward model is {{name: reward_model, kwargs: "
                f"{{path: {name}}}}} (on the command line, --reward_funcs {name} says the same)")
    if name in TRL_BUILTINS:
        return (f"reward '{name}' is a TRL built-in; with trl installed pass it as 'trl.rewards.{name}' (TRL's "
                f"{name} may need more packages, e.g. math_verify), or use posttrain's built-ins "
                f"({', '.join(BUILTIN_REWARDS)})")
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"reward '{name}' is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an import path "
            f"('module.function', 'module:function' or 'file.py:function'); {hint}docs/rewards.md shows how to "
            "write one")


def load_rewards(cfgs: Sequence[RewardConfig]) -> RewardSet:
    """All of the recipe's rewards as a RewardSet; a repeated name gets a suffix (format, format_2, ...)."""
    rewards = []
    seen: dict[str, int] = {}
    for cfg in cfgs:
        reward = load_reward(cfg)
        seen[reward.name] = seen.get(reward.name, 0) + 1
        if seen[reward.name] > 1:
            reward = reward._replace(name=f"{reward.name}_{seen[reward.name]}")
        rewards.append(reward)
    return RewardSet(rewards)


def _bind(spec: str, target: Any, kwargs: dict) -> Callable:
    if isinstance(target, type):
        try:
            instance = call_user(target, f"reward '{spec}': {target.__name__}(**kwargs)", **kwargs)
        except UserCodeError as e:
            raise UserError(f"{e}\n{e.user_traceback}") from None
        if not callable(instance):
            raise UserError(f"reward '{spec}': {target.__name__} instances are not callable; give it a __call__")
        return instance
    try:
        inspect.signature(target).bind_partial(**kwargs)
    except TypeError as e:
        raise UserError(f"reward '{spec}' does not take the kwargs {sorted(kwargs)} the recipe gives it: {e}") from None
    except ValueError:  # no signature to check (some C callables)
        pass
    return functools.partial(target, **kwargs)
