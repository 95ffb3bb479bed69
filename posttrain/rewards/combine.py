"""Several reward functions -> one weighted reward per completion, with timeouts and error policy.

    rewards = RewardSet([Reward("exact_match", exact_match), Reward("format", fmt, 0.2, timeout=5, on_error="skip")])
    total_B, per_function, skipped = rewards.score(prompts, completions, {"answer": answers})
    metrics = reward_metrics(per_function)          # rewards/<name>/mean, rewards/<name>/std

Each function runs in its own daemon thread (all at once, so slow verifiers overlap) with `timeout` seconds; a stuck
one runs on in the background but never keeps the process from exiting. On an exception or a timeout, on_error
"raise" stops with a RewardError naming the function and the failing sample, "skip" makes its batch NaN. NaN (skipped,
or None for a sample) counts as 0 in the total and in `skipped`, and is left out of the metrics. A UserError from a
function (a missing column) always propagates; wrong-length or non-numeric output, NaN and inf are RewardErrors.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import math
import numbers
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from posttrain.errors import UserError
from posttrain.usercode import UserCodeError, user_code, what_it_did

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")


class RewardError(UserCodeError):
    """A reward function failed, timed out or returned something unusable (exit 1, one message)."""


class Reward(NamedTuple):
    name: str
    """Key in metrics (rewards/<name>/mean) and in `per_function`."""
    fn: Callable[..., Sequence]
    """fn(prompts, completions, **columns) -> one float or None per completion."""
    weight: float = 1.0
    """Weight in the total."""
    timeout: float = 60.0
    """Seconds the function may take per batch."""
    on_error: str = "raise"
    """raise or skip (see the module docstring)."""


def excerpt(value: Any, limit: int = 80) -> str:
    """A short one-line view of a prompt (the last message's content for chat prompts) or completion."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict):
        value = value[-1].get("content", value[-1])
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _in_thread(fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
    """Run fn in a daemon thread; its outcome arrives in the returned Future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if not future.set_running_or_notify_cancel():
            return
        try:
            with user_code():  # os._exit in the function is named, not the end of the process
                result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who decides
            future.set_exception(e)
        else:
            future.set_result(result)

    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "reward")
    threading.Thread(target=run, name=f"reward-{name}", daemon=True).start()
    return future


def _column_filter(fn: Callable) -> Callable[[dict], dict]:
    """Which columns to pass: all when fn takes **kwargs, else those it names; never ones its kwargs already bind."""
    bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()
    bound |= {"prompts", "completions"}
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        params = None
    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        accepted = None
    else:
        accepted = {p.name for p in params[2:] if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    return lambda columns: {k: v for k, v in columns.items() if k not in bound and (accepted is None or k in accepted)}


class RewardSet:
    """The recipe's rewards, scored together: `score(prompts, completions, columns)`."""

    def __init__(self, rewards: Sequence[Reward | tuple]):
        self.rewards = [Reward(*r) for r in rewards]
        names = [r.name for r in self.rewards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique, {', '.join(duplicates)} repeats")
        for r in self.rewards:
            if r.on_error not in ON_ERROR:
                raise ValueError(f"reward '{r.name}': on_error must be raise or skip, got {r.on_error!r}")
            if not r.timeout > 0:
                raise ValueError(f"reward '{r.name}': timeout must be > 0 seconds, got {r.timeout}")
        self._filters = [_column_filter(r.fn) for r in self.rewards]

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def score(self, prompts: list, completions: list[str],
              columns: Optional[dict[str, list]] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """-> (total_B: weighted sum, NaN as 0; per_function: name -> rewards_B with NaN where missing;
        skipped: number of missing (function, sample) values). float32 CPU tensors."""
        columns = dict(columns or {})
        size = len(completions)
        if len(prompts) != size:
            raise ValueError(f"{len(prompts)} prompts for {size} completions; pass one prompt per completion")
        for key, values in columns.items():
            if len(values) != size:
                raise ValueError(f"column '{key}' has {len(values)} values for {size} completions")
        started = time.monotonic()
        futures = [_in_thread(r.fn, prompts, completions, **keep(columns))
                   for r, keep in zip(self.rewards, self._filters)]
        per_function: dict[str, torch.Tensor] = {}
        for r, keep, future in zip(self.rewards, self._filters, futures):
            remaining = max(0.0, started + r.timeout - time.monotonic())
            concurrent.futures.wait([future], timeout=remaining)
            if not future.done():
                values = self._failed(r, f"did not return within {r.timeout:g}s", prompts, completions, None, None)
            elif future.exception() is not None:
                error = future.exception()
                if isinstance(error, UserError):
                    raise error
                values = self._failed(r, "raised", prompts, completions, error, keep(columns))
            else:
                values = self._check(r, future.result(), prompts)
            per_function[r.name] = values
        total_B = sum((r.weight * torch.nan_to_num(per_function[r.name], nan=0.0) for r in self.rewards),
                      torch.zeros(size, dtype=torch.float32))
        return total_B, per_function, sum(int(v.isnan().sum()) for v in per_function.values())

    def _failed(self, reward: Reward, what: str, prompts, completions, error, columns) -> torch.Tensor:
        size = len(completions)
        if reward.on_error == "skip":
            logger.warning("reward '%s' %s on a batch of %d; its rewards for the batch count as missing "
                           "(on_error: skip): %r", reward.name, what, size, error)
            return torch.full((size,), float("nan"))
        if error is None:
            raise RewardError(f"reward '{reward.name}' {what} on a batch of {size} completions (first prompt: "
                              f"{excerpt(prompts[0] if prompts else '')!r}); raise its timeout in the recipe's "
                              "rewards, or set on_error: skip")
        culprit = self._find_failing_sample(reward, prompts, completions, columns)
        if culprit is not None:
            index, error = culprit
            where = f"on sample {index} (prompt: {excerpt(prompts[index])!r}; completion: {excerpt(completions[index])!r})"
        else:
            where = f"on a batch of {size} completions (first prompt: {excerpt(prompts[0] if prompts else '')!r})"
        raise RewardError(f"reward '{reward.name}' {what_it_did(error)} {where}; fix the function, or set on_error: "
                          "skip to count such batches as missing", error) from error

    @staticmethod
    def _find_failing_sample(reward: Reward, prompts, completions, columns) -> Optional[tuple[int, BaseException]]:
        """Re-run the function one sample at a time (within its timeout) to name the sample that fails."""
        def first_failure():
            for i in range(len(completions)):
                try:
                    reward.fn(prompts[i:i + 1], completions[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
                except (Exception, SystemExit) as e:  # noqa: BLE001 - reported to the user
                    return i, e
            return None

        future = _in_thread(first_failure)
        concurrent.futures.wait([future], timeout=reward.timeout)
        return future.result() if future.done() and future.exception() is None else None

    @staticmethod
    def _check(reward: Reward, values: Any, prompts: list) -> torch.Tensor:
        size = len(prompts)
        first = f"first prompt: {excerpt(prompts[0] if prompts else '')!r}"
        if isinstance(values, torch.Tensor) or hasattr(values, "tolist"):
            values = values.tolist()
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise RewardError(f"reward '{reward.name}' returned a {type(values).__name__} for a batch of {size} "
                              f"({first}); it must return a list with one float (or None) per completion")
        if len(values) != size:
            raise RewardError(f"reward '{reward.name}' returned {len(values)} values for {size} completions ({first}); "
                              "it must return one float (or None) per completion")
        out = []
        for i, value in enumerate(values):
            if value is None:
                out.append(float("nan"))
            elif isinstance(value, numbers.Real) and math.isfinite(value):
                out.append(float(value))
            else:  # NaN too: None says "no reward for this sample" on purpose; NaN is a bug that would count as 0
                raise RewardError(f"reward '{reward.name}' returned {value!r} for sample {i} (prompt: "
                                  f"{excerpt(prompts[i])!r}); rewards must be finite numbers, or None for a sample it "
                                  "does not score")
        return torch.tensor(out, dtype=torch.float32)


def reward_metrics(per_function: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """rewards/<name>/mean and /std (population) of each function over its non-NaN values (NaN when it has none)."""
    metrics = {}
    for name, values_B in per_function.items():
        values_B = values_B.detach().float()
        valid_B = ~values_B.isnan()
        count = valid_B.sum()
        mean = torch.where(valid_B, values_B, 0.0).sum() / count
        var = torch.where(valid_B, (values_B - mean) ** 2, 0.0).sum() / count
        metrics[f"rewards/{name}/mean"] = mean
        metrics[f"rewards/{name}/std"] = var.sqrt()
    return metrics
