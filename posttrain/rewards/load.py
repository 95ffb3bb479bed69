"""The recipe's `rewards:` entries -> callables, checked at start-up before any compute is spent.

    reward = load_reward(RewardConfig(name="my_rewards:has_citation", kwargs={"min_count": 2}, weight=0.5))
    rewards = load_rewards(recipe.rewards)                  # a RewardSet, names made unique

`name` is a built-in (see posttrain.rewards.builtin.BUILTIN_REWARDS) or an import path:
- 'package.module:function' (the module is looked up on sys.path and in the current directory), or
- 'path/to/file.py:function'.
A function gets the kwargs bound with functools.partial. A class is instantiated once with the kwargs and its
instances are called (for rewards that load something, like a verifier or a model).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Sequence

from posttrain.config.schema import RewardConfig
from posttrain.errors import UserError
from posttrain.rewards.builtin import BUILTIN_REWARDS, check_builtin_kwargs
from posttrain.rewards.combine import ON_ERROR, Reward, RewardSet
from posttrain.usercode import UserCodeError, call_user, import_user


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
        return Reward(cfg.name, fn, cfg.weight, cfg.timeout, cfg.on_error)
    if ":" not in cfg.name:
        close = difflib.get_close_matches(cfg.name, list(BUILTIN_REWARDS), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise UserError(f"reward '{cfg.name}' is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an "
                        f"import path 'module:function'; {hint}write your own as 'my_module:my_reward' taking "
                        "(prompts, completions, **columns)")
    target = load_callable(cfg.name, "reward")
    name = cfg.name.rpartition(":")[2].rsplit(".", 1)[-1]
    return Reward(name, _bind(cfg.name, target, kwargs), cfg.weight, cfg.timeout, cfg.on_error)


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


def load_callable(spec: str, what: str) -> Callable:
    """'package.module:attribute' or 'path/to/file.py:attribute' -> the callable it names; a UserError starting
    "{what} '{spec}'" when it does not import or is not callable (rewards, tools, environments, parsers)."""
    if ":" not in spec:
        raise UserError(f"{what} '{spec}' is not an import path; write it as 'package.module:name' or "
                        "'path/to/file.py:name'")
    module_name, _, attribute = spec.rpartition(":")
    target = import_user(module_name, f"{what} '{spec}'")
    for part in attribute.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"{what} '{spec}': {getattr(target, '__name__', target)!s} has no attribute '{part}'{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"{what} '{spec}': '{attribute}' is a {type(target).__name__}, not a function or class")
    return target


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
        inspect.signature(target).bind_partial(None, None, **kwargs)
    except TypeError as e:
        raise UserError(f"reward '{spec}' cannot be called as fn(prompts, completions, **kwargs) with kwargs "
                        f"{sorted(kwargs)}: {e}") from None
    except ValueError:  # no signature to check (some C callables)
        pass
    return functools.partial(target, **kwargs)
