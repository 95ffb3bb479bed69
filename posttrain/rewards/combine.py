"""Several reward functions -> one weighted reward per completion, with timeouts and error policy.

    rewards = RewardSet([Reward("exact_match", exact_match), Reward("format", fmt, 0.2, timeout=5, on_error="skip")])
    scores = rewards.score(prompts, completions, {"answer": answers}, completion_ids, trainer_state)
    scores.total_B, scores.scored_B, scores.per_function, scores.skipped, scores.logged
    metrics = reward_metrics(scores.per_function)          # rewards/<name>/mean, rewards/<name>/std

Functions are called as TRL calls them (posttrain/rewards/contract.py). Each runs in its own daemon thread (all at
once, so slow verifiers overlap), an `async def` one on the shared event loop, with `timeout` seconds; a stuck one
runs on in the background but never keeps the process from exiting. On an exception or a timeout, on_error "raise"
stops with a RewardError naming the function and the failing sample, "skip" makes its batch NaN. NaN (skipped, or
None for a sample) is left out of the weighted sum (TRL's nansum: it counts as 0), counted in `skipped` and left out
of the metrics; a completion no function scores is unscored (`scored_B` False: TRL's NaN reward, left out of the
group baselines and reward metrics, advantage 0) and warned about, as TRL does. A UserError from a function (a missing
column) always propagates; wrong-length or non-numeric output, NaN and inf are RewardErrors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import math
import numbers
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from posttrain.errors import UserError
from posttrain.rewards.contract import (NOT_COLUMNS, Calling, LoopWatch, UserLog, call_blocking, calling, event_loop,
                                        is_async, running_for, tell_message_lists)
from posttrain.usercode import ProcessExitCalled, UserCodeError, awaited_user, user_code, what_it_did

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")
REWARD_DTYPE = torch.float32
"""The dtype of every reward tensor (and so of the advantages built from them)."""


class RewardError(UserCodeError):
    """A reward function failed, timed out or returned something unusable (exit 1, one message)."""


class Reward(NamedTuple):
    name: str
    """Key in metrics (rewards/<name>/mean) and in `per_function`."""
    fn: Callable[..., Sequence]
    """fn(prompts=, completions=, completion_ids=, trainer_state=, **columns) -> one float or None per completion."""
    weight: float = 1.0
    """Weight in the total."""
    timeout: float = 60.0
    """Seconds the function may take per batch."""
    on_error: str = "raise"
    """raise or skip (see the module docstring)."""
    columns: tuple = ()
    """Dataset columns the function reads by name (a judge's template variables), checked against the data at
    start-up (RewardSet.check_columns)."""


def excerpt(value: Any, limit: int = 80) -> str:
    """A short one-line view of a prompt (the last message's content for chat prompts) or completion."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict):
        value = value[-1].get("content", value[-1])
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _in_thread(fn: Callable, *args, abandon: Optional[threading.Event] = None, **kwargs) -> concurrent.futures.Future:
    """Run fn in a daemon thread; its outcome arrives in the returned Future. `abandon` is set once its caller stops
    waiting (contract.abandoned)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if not future.set_running_or_notify_cancel():
            return
        running_for(abandon or threading.Event())
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


class Logged(NamedTuple):
    """What the functions logged through log_metric / log_extra during one batch."""

    metrics: dict[str, list[float]]
    """name -> every value logged (averaged when the step's metrics are written)."""
    extra: dict[str, list]
    """column -> one value per completion (shown in samples.jsonl)."""


class Scores(NamedTuple):
    total_B: torch.Tensor
    """Weighted sum over the functions, NaN left out (0 when no function scores a completion: see scored_B)."""
    per_function: dict[str, torch.Tensor]
    """name -> rewards_B, NaN where the function gave none."""
    skipped: int
    """Missing (function, sample) values."""
    logged: Logged

    @property
    def scored_B(self) -> torch.Tensor:
        """bool: some function gave the completion a value (no functions: all). An unscored one is TRL's unscorable
        completion (NaN reward): the GRPO family leaves it out of its group's mean and std with advantage 0
        (ops/advantages.py), the reward metrics leave it out."""
        if not self.per_function:
            return torch.ones(len(self.total_B), dtype=torch.bool)
        return ~torch.stack(list(self.per_function.values())).isnan().all(dim=0)


class RewardSet:
    """The recipe's rewards, scored together: `score(prompts, completions, columns, completion_ids, trainer_state)`."""

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
            if not torch.tensor(float(r.weight), dtype=REWARD_DTYPE).isfinite():
                raise ValueError(f"reward '{r.name}': weight {r.weight:.3g} is not a finite {REWARD_DTYPE} (the dtype "
                                 "rewards are summed in, largest 3.4e+38); give a smaller weight")
        self._calling: list[Calling] = []  # how each function is called: read once, on the first batch
        self._told: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def check_columns(self, columns: Sequence[str], where: str) -> None:
        """Every column a function reads by name is in the data (`where`: data.train, data.eval), before any model
        loads: a judge template's typo used to fail at the first batch."""
        for r in self.rewards:
            missing = sorted(set(r.columns) - set(columns))
            if missing:
                raise UserError(f"reward '{r.name}' reads {', '.join(missing)}, which is neither prompt, completion "
                                f"nor a column of {where} (columns: {', '.join(sorted(columns)) or 'none'}); fix the "
                                "name in the reward (a judge: its kwargs.prompt_template) or add the column")

    def score(self, prompts: list, completions: list, columns: Optional[dict[str, list]] = None,
              completion_ids: Optional[list[list[int]]] = None, trainer_state: Any = None) -> Scores:
        """Every function on the batch, called as TRL calls it (see contract.py); float32 CPU tensors out."""
        columns = {k: v for k, v in (columns or {}).items() if k not in NOT_COLUMNS}
        size = len(completions)
        if len(prompts) != size:
            raise ValueError(f"{len(prompts)} prompts for {size} completions; pass one prompt per completion")
        for key, values in {**columns, "completion_ids": completion_ids or [None] * size}.items():
            if len(values) != size:
                raise ValueError(f"column '{key}' has {len(values)} values for {size} completions")
        if not self._calling:
            self._calling = [calling(r.fn, r.name, list(columns)) for r in self.rewards]
        if completions and not isinstance(completions[0], str):
            for r, how in zip(self.rewards, self._calling):
                if how.old_contract and r.name not in self._told:
                    self._told.add(r.name)
                    tell_message_lists(r.name)
        logs = [UserLog(r.name, size) for r in self.rewards]
        batch = dict(columns, prompts=prompts, completions=completions, completion_ids=completion_ids,
                     trainer_state=trainer_state)
        started = time.monotonic()
        abandon = threading.Event()  # set when this batch's scoring ends, however it ends
        watch = LoopWatch()  # which async function held the shared event loop
        futures = [self._start(r, *how.arguments({**own_copy(batch), "log_extra": log.log_extra,
                                                   "log_metric": log.log_metric}), abandon, watch)
                   for r, how, log in zip(self.rewards, self._calling, logs)]
        try:
            per_function = self._results(futures, batch, prompts, started, watch)
        finally:
            abandon.set()  # a function still running (timed out, or its batch failed) takes no new work
        total_B = sum((r.weight * torch.nan_to_num(per_function[r.name], nan=0.0) for r in self.rewards),
                      torch.zeros(size, dtype=REWARD_DTYPE))
        _check_total(total_B, self.rewards, per_function, prompts)
        logged = Logged({}, {})
        for log in logs:
            for name, values in log.metrics.items():
                logged.metrics.setdefault(name, []).extend(values)
            logged.extra.update(log.extra)
        scores = Scores(total_B, per_function, sum(int(v.isnan().sum()) for v in per_function.values()), logged)
        _warn_unscored(scores.scored_B, batch, list(columns))
        return scores

    def _results(self, futures: list, batch: dict, prompts: list, started: float,
                 watch: LoopWatch) -> dict[str, torch.Tensor]:
        """Each function's rewards, waited for within its timeout; a failure goes by its on_error."""
        per_function: dict[str, torch.Tensor] = {}
        for r, how, future in zip(self.rewards, self._calling, futures):
            remaining = max(0.0, started + r.timeout - time.monotonic())
            concurrent.futures.wait([future], timeout=remaining)
            blocker = watch.holder(r.name, min(1.0, r.timeout / 2)) if is_async(r.fn) else None
            if not future.done() and blocker is not None:
                raise RewardError(f"reward '{r.name}' did not return within {r.timeout:g}s because reward "
                                  f"'{blocker[0]}' held the shared event loop for {blocker[1]:.1f}s without awaiting "
                                  "(a blocking call, time.sleep or CPU work, inside `async def`), so no other async "
                                  f"reward could run. Make '{blocker[0]}' await (asyncio.sleep, an async client), move "
                                  "its blocking work to asyncio.to_thread, or make it a plain def")
            if not future.done():
                future.cancel()  # an async function's task stops; a thread runs on, unheard
                values = self._failed(r, f"did not return within {r.timeout:g}s", batch, None, how)
            elif future.exception() is not None:
                error = future.exception()
                if isinstance(error, UserError):
                    raise error
                values = self._failed(r, "raised", batch, error, how)
            else:
                values = self._check(r, future.result(), prompts)
            per_function[r.name] = values
        return per_function

    @staticmethod
    def _start(reward: Reward, args: tuple, kwargs: dict, abandon: threading.Event,
               watch: LoopWatch) -> concurrent.futures.Future:
        """An async function's coroutine on the shared event loop (the batch's async functions run together there,
        each step timed by `watch`); any other function in a thread of its own."""
        if is_async(reward.fn):
            return asyncio.run_coroutine_threadsafe(_call_async(reward.fn, args, kwargs, watch, reward.name),
                                                    event_loop())
        return _in_thread(call_blocking, reward.fn, args, kwargs, abandon=abandon)

    def _failed(self, reward: Reward, what: str, batch: dict, error, how) -> torch.Tensor:
        prompts, completions = batch["prompts"], batch["completions"]
        size = len(completions)
        if reward.on_error == "skip":
            logger.warning("reward '%s' %s on a batch of %d; its rewards for the batch count as missing "
                           "(on_error: skip): %r", reward.name, what, size, error)
            return torch.full((size,), float("nan"))
        if error is None:
            raise RewardError(f"reward '{reward.name}' {what} on a batch of {size} completions (first prompt: "
                              f"{excerpt(prompts[0] if prompts else '')!r}); raise its timeout in the recipe's "
                              "rewards, or set on_error: skip")
        culprit = self._find_failing_sample(reward, batch, how)
        if culprit is not None:
            index, error = culprit
            where = f"on sample {index} (prompt: {excerpt(prompts[index])!r}; completion: {excerpt(completions[index])!r})"
        else:
            where = f"on a batch of {size} completions (first prompt: {excerpt(prompts[0] if prompts else '')!r})"
        hint = ""
        if isinstance(error, (TypeError, AttributeError)) and completions and not isinstance(completions[0], str):
            hint = ("; for conversational data each completion is a list of messages, as TRL passes it: its text is "
                    "completion[0]['content'] (docs/rewards.md)")
        raise RewardError(f"reward '{reward.name}' {what_it_did(error)} {where}{hint}; fix the function, or set "
                          "on_error: skip to count such batches as missing", error) from error

    @staticmethod
    def _find_failing_sample(reward: Reward, batch: dict, how) -> Optional[tuple[int, BaseException]]:
        """Re-run the function one sample at a time (within its timeout) to name the sample that fails."""
        per_sample = [k for k, v in batch.items() if k != "trainer_state" and v is not None]

        def first_failure():
            for i in range(len(batch["completions"])):
                log = UserLog(reward.name, 1)
                one = {**own_copy({**batch, **{k: batch[k][i:i + 1] for k in per_sample}}),
                       "log_extra": log.log_extra, "log_metric": log.log_metric}
                try:
                    call_blocking(reward.fn, *how.arguments(one))
                except (Exception, SystemExit, ProcessExitCalled) as e:  # noqa: BLE001 - reported to the user
                    return i, e
            return None

        abandon = threading.Event()
        future = _in_thread(first_failure, abandon=abandon)
        concurrent.futures.wait([future], timeout=reward.timeout)
        abandon.set()
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
            elif isinstance(value, numbers.Real) and math.isfinite(_as_float(value)):
                out.append(_as_float(value))
            else:  # NaN too: None says "no reward for this sample" on purpose; NaN is a bug that would count as 0
                raise RewardError(f"reward '{reward.name}' returned {value!r} for sample {i} (prompt: "
                                  f"{excerpt(prompts[i])!r}); rewards must be finite numbers, or None for a sample it "
                                  "does not score")
        rewards_B = torch.tensor(out, dtype=REWARD_DTYPE)
        overflow = rewards_B.isinf().nonzero()  # every value was finite as a Python float: these overflowed
        if len(overflow):
            i = int(overflow[0])
            raise RewardError(f"reward '{reward.name}' returned {values[i]!r} for sample {i} (prompt: "
                              f"{excerpt(prompts[i])!r}), which is inf in {REWARD_DTYPE} (the dtype rewards are "
                              "computed in, largest 3.4e+38); return a smaller number")
        return rewards_B


def own_copy(batch: dict) -> dict:
    """A function's own copy of the batch it is handed: the ids it is given are not the ids that are trained, the
    completions and columns not those another function (or samples.jsonl) reads, so a function that edits what it is
    given (`ids[:] = ...`, `completions.clear()`) changes nothing but its own copy. trainer_state is frozen already."""
    return {k: v if k == "trainer_state" else _copied(v) for k, v in batch.items()}


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except (TypeError, copy.Error):  # a column of objects that cannot be copied (a handle): a new list of them
        return list(value) if isinstance(value, (list, tuple)) else value


def _as_float(value: numbers.Real) -> float:
    """float(value); an int too large for a Python float (10**400) is an inf, caught as the overflow it is."""
    try:
        return float(value)
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_total(total_B: torch.Tensor, rewards: list[Reward], per_function: dict, prompts: list) -> None:
    """The weighted sum is finite in its dtype (each reward and weight is, but 1e20 x weight 1e20 is not), and small
    enough that its square is too: a group's variance squares it, and an inf std made every advantage 0 silently."""
    largest = torch.finfo(REWARD_DTYPE).max ** 0.5  # 1.8e19
    bad = (~(total_B.abs() <= largest)).nonzero()
    if len(bad):
        i = int(bad[0])
        terms = ", ".join(f"'{r.name}' {float(per_function[r.name][i]):.3g} x weight {r.weight:.3g}" for r in rewards)
        raise RewardError(f"the weighted reward of sample {i} (prompt: {excerpt(prompts[i])!r}) is "
                          f"{float(total_B[i]):.3g} ({terms}), beyond {largest:.2g}, whose square (the group's "
                          f"variance) is inf in {REWARD_DTYPE}; scale the rewards or their weights down")


async def _call_async(fn: Callable, args: tuple, kwargs: dict, watch: LoopWatch, name: str) -> Any:
    return await awaited_user(watch.timed(name, fn(*args, **kwargs)))


def _warn_unscored(scored_B: torch.Tensor, batch: dict, columns: list[str]) -> None:
    """TRL's warning when every function returned None for a completion: nothing scores it."""
    if scored_B.all():
        return
    i = int((~scored_B).nonzero()[0])
    row = {k: batch[k][i] for k in columns}
    logger.warning("every reward function returned None for %d of %d completions: they are left out of their "
                   "group's reward mean and std and get advantage 0 (as in TRL; PPO gives them reward 0); the "
                   "first: prompt %r, completion %r, columns %s. Make sure at least one function scores each "
                   "completion", int((~scored_B).sum()), len(scored_B), excerpt(batch["prompts"][i]),
                   excerpt(batch["completions"][i]), {k: excerpt(v) for k, v in row.items()})


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
