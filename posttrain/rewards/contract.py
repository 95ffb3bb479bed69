"""TRL's reward-function contract: what a reward function is called with, and in which shape.

    def accuracy(completions, answer, **kwargs):                 # TRL's GRPOTrainer calls it the same way
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

Every function is called by keyword, as TRL's GRPOTrainer calls it (trl 1.16, `_calculate_rewards`):
  prompts         the dataset's prompts, one per completion (a prompt's G completions repeat it)
  completions     strings for standard data; for conversational data (prompts are message lists) each completion
                  is a message list: [{"role": "assistant", "content": ...}], and in a multi-turn (tools /
                  environment) rollout every message after the prompt, tool turns included
  completion_ids  the generated token ids, one list per completion
  trainer_state   a TrainerState: global_step, max_steps, epoch, ... (the fields of transformers' TrainerState
                  that mean something here)
  log_extra       log_extra(column, values): one value per completion, added to samples.jsonl
  log_metric      log_metric(name, value): a number, averaged over the step and logged as a metric
  <column>        every other dataset column, one value per completion
A function that names its arguments without **kwargs gets only those it names. A function returns one float (or
None: "not applicable to this sample") per completion; an `async def` one is awaited, the async functions of a
batch together on one event loop, as TRL does.

posttrain's earlier contract passed prompts and completions by position and completions as plain strings. A function
whose first two parameters are neither arguments above nor columns (`def f(p, c, **kw)`) is still called with them
by position (said once); for conversational data its completions are message lists now (said once too).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from posttrain.errors import UserError, overflows_float32
from posttrain.usercode import awaited_user, run_user_loop

logger = logging.getLogger(__name__)

CONTRACT_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""What every reward function may take by name, besides the dataset's columns."""
NOT_COLUMNS = ("prompt", "completion", "completion_ids")
"""Dataset columns TRL does not pass on (the prompt and any completion are passed as prompts / completions)."""


@dataclass(frozen=True)
class TrainerState:
    """transformers' TrainerState, the fields with a meaning here (TRL passes the trainer's own as trainer_state)."""

    global_step: int = 0
    """Optimiser steps done before this batch of completions was scored."""
    max_steps: int = 0
    """Steps the run takes in all."""
    epoch: float = 0.0
    """Passes over the training prompts done before this batch (fractional)."""
    num_train_epochs: float = 0.0
    """Passes the run makes (max_steps / steps per epoch when the run is bounded by max_steps)."""
    logging_steps: int = 0
    eval_steps: Optional[int] = None
    save_steps: int = 0
    train_batch_size: int = 0
    """Completions per device per micro-batch (train.per_device_train_batch_size)."""
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


def is_conversational(prompt: Any) -> bool:
    """A prompt given as messages (TRL's conversational format) rather than text."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def as_completions(prompts: list, texts: list[str]) -> list:
    """Generated texts in the dataset's shape: strings for text prompts, [{"role": "assistant", "content": text}]
    for conversational ones (TRL's decoding without a response parser)."""
    return [[{"role": "assistant", "content": t}] if is_conversational(p) else t for p, t in zip(prompts, texts)]


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or the content of its last assistant message (the final answer of a multi-turn
    one). For rules that read text (the built-ins)."""
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    content = replies[-1].get("content") if replies else ""
    return content if isinstance(content, str) else str(content or "")


def column_values(kwargs: dict, column: str, reward: str) -> list:
    """The dataset column a reward compares with, or a UserError listing the columns there are."""
    if column not in kwargs:
        columns = sorted(k for k in kwargs if k not in CONTRACT_ARGS)
        raise UserError(f"reward {reward} reads the dataset column '{column}', which the data does not have "
                        f"(columns: {', '.join(columns) or 'none'}); set kwargs.answer_column")
    return kwargs[column]



def require_source_columns(kwargs: dict, columns: tuple[str, ...], reward: str, source: str) -> None:
    """A UserError when the batch lacks the columns a data source writes for its own reward (reasoning_gym:,
    verifiers:), saying which source makes them."""
    missing = [c for c in columns if c not in kwargs]
    if missing:
        raise UserError(f"reward {reward} scores rows made by a '{source}' data source (their columns "
                        f"{', '.join(columns)}); the data has no {', '.join(missing)}: set data.train to {source} "
                        "(docs/environments.md)")


def is_async(fn: Callable) -> bool:
    """Calling fn returns a coroutine: an async def, a partial of one, or an instance with an async __call__."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@dataclass(frozen=True)
class Calling:
    """How one function is called, read once from its signature."""

    positional: bool
    """posttrain's earlier contract: prompts and completions by position (its parameters are named otherwise)."""
    takes: Optional[frozenset]
    """Keyword names it accepts (None: any, it takes **kwargs)."""
    old_contract: bool = False
    """Written for posttrain's earlier contract (by position, or `**columns` as its docs spelled it): told once that
    conversational completions are message lists now."""

    def arguments(self, kwargs: dict) -> tuple[tuple, dict]:
        """(args, kwargs) of one call from every keyword argument of the contract."""
        kwargs = {k: v for k, v in kwargs.items() if self.takes is None or k in self.takes}
        if self.positional:
            return (kwargs.pop("prompts", None), kwargs.pop("completions", None)), kwargs
        return (), kwargs


def calling(fn: Callable, name: str, columns: Sequence[str]) -> Calling:
    """Read fn's signature once (on the first batch, whose `columns` are the data's): keyword (TRL's contract) unless
    its first two parameters are neither arguments of the contract nor columns (posttrain's earlier
    `fn(p, c, **columns)`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some C callables): TRL's keyword call
        return Calling(False, None)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = set(CONTRACT_ARGS) | set(columns)
    legacy = len(positional) >= 2 and not {p.name for p in positional[:2]} & known
    if legacy:
        logger.info("reward '%s' takes (%s, %s) by position: posttrain's earlier contract, still served. TRL calls "
                    "reward functions by keyword (prompts=, completions=, ...); rename its parameters to run it "
                    "unchanged under TRL too", name, positional[0].name, positional[1].name)
    old = legacy or any(p.kind is p.VAR_KEYWORD and p.name == "columns" for p in params)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return Calling(legacy, None, old)
    kept = positional[2:] if legacy else params
    return Calling(legacy, frozenset(p.name for p in kept if p.kind is not p.VAR_POSITIONAL), old)


def contract_misfit(fn: Callable) -> Optional[str]:
    """Why fn cannot be a reward function (None when it can), read from its signature at start-up: it must take one
    of the contract's arguments by name, or **kwargs, or be a Python function of posttrain's earlier contract (prompts
    and completions by position). Anything else (`def f(*args)`, called with nothing; `os.system`, `eval`) would be
    handed a data column or nothing at all, so it is refused before any model loads."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some C callables): TRL's keyword call, as at run time
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if named & set(CONTRACT_ARGS):
        return None
    by_position = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if len(by_position) >= 2 and written_in_python(fn):
        return None
    shown = ", ".join(str(p) for p in params) or "no arguments"
    return (f"it takes ({shown}): none of the reward contract's arguments ({', '.join(CONTRACT_ARGS)}) and no "
            "**kwargs, so it would be called without the completions to score; write it as "
            "`def my_reward(completions, **kwargs)` (docs/rewards.md)")


def written_in_python(fn: Callable) -> bool:
    """fn is Python code (a function, a partial of one, an instance whose __call__ is one), not a built-in."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        fn = getattr(type(fn), "__call__", None) if not isinstance(fn, type) else fn.__init__
    return inspect.isfunction(fn) or inspect.ismethod(fn)


def tell_message_lists(name: str) -> None:
    """Said once per function of the earlier contract, on its first conversational batch: what changed."""
    logger.warning("reward '%s' is written for posttrain's earlier contract (completions as strings, **columns); "
                   "for conversational data each completion is now a list of messages, as TRL passes it: "
                   "[{'role': 'assistant', 'content': ...}]. Read completion[0]['content'] (docs/rewards.md); once "
                   "it does, name its parameters as TRL does (prompts, completions, **kwargs) and this is not said",
                   name)


class UserLog:
    """What one function logs through log_extra / log_metric during one batch (thread-safe: functions run together)."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def log_extra(self, column: str, values: list) -> None:
        """One value per completion of the batch, shown with each completion in samples.jsonl."""
        values = list(values)
        if len(values) != self.size:
            raise UserError(f"reward '{self.name}' called log_extra({column!r}, ...) with {len(values)} values for "
                            f"{self.size} completions; give one value per completion")
        with self._lock:
            self.extra[str(column)] = values

    def log_metric(self, name: str, value: float) -> None:
        """A number, averaged over the step (and the ranks) and logged under `name`."""
        if is_trainer_metric(str(name)):
            raise UserError(f"reward '{self.name}' called log_metric({name!r}, ...): the trainer logs {name!r} itself "
                            f"and yours would replace it; give it a name of its own, e.g. '{self.name}/{name}'")
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or overflows_float32(value)):
            raise UserError(f"reward '{self.name}' called log_metric({name!r}, {value!r}); the value must be a "
                            "finite number that float32 holds (metrics are averaged in float32)")
        with self._lock:
            self.metrics.setdefault(str(name), []).append(float(value))


TRAINER_METRICS = ("step", "loss", "grad_norm", "learning_rate", "tokens_per_second", "num_tokens", "epoch",
                   "peak_memory_mb", "estimated_peak_memory_mb")
"""Names in metrics.jsonl that the loop writes itself; a `<name>/...` beneath one (loss/critic) is the loop's too."""
TRAINER_FAMILIES = ("reward", "rewards", "time", "completion_length", "rollout")
"""Names beneath which only the rollout source logs (reward/mean, rewards/<function>/mean, time/generate, ...)."""


def is_trainer_metric(name: str) -> bool:
    """A metric name the trainer writes (or may write), which log_metric must not replace. Names the algorithm or the
    rollout source log at run time (entropy, frac_reward_zero_std, ...) are checked where they meet the user's
    (posttrain/online/rollout_source.py, posttrain/train/loop.py)."""
    top = name.split("/", 1)[0]
    return top in TRAINER_METRICS or top in TRAINER_FAMILIES


_CALL = threading.local()  # the reward call the current thread runs for (RewardSet sets it)
_NEVER = threading.Event()


def abandoned() -> threading.Event:
    """Set once nobody waits any more for the reward call this thread runs (its timeout passed, or the batch ended
    otherwise): a reward doing its work in threads of its own (the judge) takes no new work once it is set, so a
    timed-out batch does not go on sending requests for minutes. Never set outside a RewardSet call."""
    return getattr(_CALL, "abandoned", _NEVER)


def running_for(event: threading.Event) -> None:
    """This thread now runs a reward call that `event` abandons (RewardSet)."""
    _CALL.abandoned = event


class LoopWatch:
    """Who held the shared event loop during one batch. Each async function's coroutine is driven one step at a time
    (from one await to the next) and each step timed: a step that runs long without awaiting (time.sleep, CPU work
    inside `async def`) blocks every other async function of the batch, which then times out and used to take the
    blame."""

    def __init__(self):
        self.longest: dict[str, float] = {}
        self.holding: Optional[tuple[str, float]] = None

    def timed(self, name: str, awaitable) -> "_Timed":
        return _Timed(self, name, awaitable)

    def holder(self, besides: str, at_least: float) -> Optional[tuple[str, float]]:
        """(name, seconds) of the function other than `besides` that held the loop longest in one step (or holds it
        now), if that is at least `at_least` seconds."""
        held = dict(self.longest)
        holding = self.holding
        if holding is not None:
            held[holding[0]] = max(held.get(holding[0], 0.0), time.monotonic() - holding[1])
        found = sorted((seconds, name) for name, seconds in held.items() if name != besides and seconds >= at_least)
        return (found[-1][1], found[-1][0]) if found else None


class _Timed:
    """An awaitable that runs `awaitable` step by step, timing each step for its LoopWatch."""

    def __init__(self, watch: LoopWatch, name: str, awaitable):
        self.watch, self.name, self.awaitable = watch, name, awaitable

    def __await__(self):
        steps = self.awaitable.__await__()
        if not hasattr(steps, "send"):  # an awaitable whose __await__ is a plain iterator: driven whole, untimed
            return (yield from steps)
        sent, thrown = None, None
        while True:
            started = time.monotonic()
            self.watch.holding = (self.name, started)
            try:
                yielded = steps.throw(thrown) if thrown is not None else steps.send(sent)
            except StopIteration as done:
                return done.value
            finally:
                self.watch.holding = None
                held = time.monotonic() - started
                self.watch.longest[self.name] = max(self.watch.longest.get(self.name, 0.0), held)
            try:
                sent, thrown = (yield yielded), None
            except BaseException as e:  # noqa: BLE001 - a cancellation (or any error) goes on into the coroutine
                sent, thrown = None, e


_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for the process's async reward functions, running in a daemon thread (TRL keeps one too, so a
    client an async function creates on its first call stays bound to a live loop)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=run_user_loop, args=(_LOOP,), name="posttrain-async-rewards", daemon=True).start()
        return _LOOP


def call_blocking(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """fn(*args, **kwargs), awaited on the shared loop when it returns a coroutine (for one-sample re-runs)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        return asyncio.run_coroutine_threadsafe(awaited_user(result), event_loop()).result()
    return result


def trainer_state(recipe, global_step: int, max_steps: int, steps_per_epoch: float, is_main: bool) -> TrainerState:
    """The TrainerState a reward sees while the completions for step `global_step` + 1 are scored; epochs count
    optimiser steps over `steps_per_epoch`, as transformers' Trainer counts them."""
    t, per_epoch = recipe.train, max(steps_per_epoch, 1e-9)
    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=global_step / per_epoch,
                        num_train_epochs=max_steps / per_epoch, logging_steps=t.logging_steps,
                        eval_steps=t.eval_steps or None, save_steps=t.save_steps,
                        train_batch_size=t.per_device_train_batch_size, is_world_process_zero=is_main,
                        is_local_process_zero=is_main)
