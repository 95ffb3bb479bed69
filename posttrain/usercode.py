"""User code (reward functions now; tools and environments reuse it): one error path for everything it can do.

    module = import_user("my_rewards", "reward 'my_rewards:has_citation'")        # UserError (exit 2) at start-up
    fn = load_callable("my_rewards:has_citation", "reward")                       # rewards, tools, environments, parsers
    scores = call_user(fn, "reward 'has_citation' on a batch of 8", prompts, completions)   # UserCodeError (exit 1)
    raise UserCodeError(f"reward 'f' {what_it_did(error)} on sample 3 (prompt: 'What is')", error)

Whatever user code does ends as one message naming the function, the sample and what it did, with the user's own
traceback under it, and a non-zero exit. `except Exception` is not enough: sys.exit(0) raises SystemExit, which
would end the run with exit 0 and no word, so it is caught here too. KeyboardInterrupt stays the user's Ctrl-C, and
a UserError raised on purpose (a missing column, say) stays the input error it is.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import importlib
import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from posttrain.errors import RunStopped, UserError


class UserCodeError(Exception):
    """User code failed while the run was going: exit 1, the message and the user's traceback, no posttrain one."""

    exit_code = 1

    def __init__(self, message: str, cause: Optional[BaseException] = None):
        super().__init__(message)
        self.user_traceback = user_frames(cause) if cause is not None else ""


class ProcessExitCalled(BaseException):
    """os._exit(code) called by user code inside call_user: it would end the process at once, with no word and no
    cleanup, so inside user code it raises this instead (install_exit_guard). Also sys.exit(code) in a coroutine
    (awaited_user), which would stop the event loop all async user code shares."""

    def __init__(self, code, call: str = "os._exit"):
        super().__init__(code)
        self.code, self.call = code, call


_inside_user = set()  # the threads running user code now (threading.get_ident())
_stop_signal = [0]  # the stop signal (SIGTERM / SIGINT) the run received, 0 for none


def request_stop(signum: int) -> None:
    """The run received `signum` (train/guard.py; 0: a run starts, none yet): a wait on user code
    (call_with_deadline) ends now instead of at its deadline, since the step it is in cannot finish anyway."""
    _stop_signal[0] = signum


def stop_requested() -> int:
    """The stop signal the run received (0: none): a loop that may run long (dynamic sampling's draws) ends between
    two iterations instead of at the step boundary it may not reach for a long time."""
    return _stop_signal[0]


_exit_guard: dict = {}  # the process that installed the guard -> the real os._exit


def install_exit_guard() -> None:
    """Make os._exit raise ProcessExitCalled in a thread that is running user code (in this process only: a forked
    child, a tool's process say, gets the real one)."""
    if _exit_guard:
        return
    real, owner = os._exit, os.getpid()
    _exit_guard[owner] = real

    def guarded_exit(code):
        if os.getpid() == owner and threading.get_ident() in _inside_user:
            raise ProcessExitCalled(code)
        real(code)

    os._exit = guarded_exit


def what_it_did(error: BaseException) -> str:
    """'raised ValueError: bad input' / 'called sys.exit(0)': what the user's code did, in words."""
    if isinstance(error, ProcessExitCalled):
        return f"called {error.call}({error.code!r})"
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})" if error.code is not None else "called sys.exit()"
    return f"raised {type(error).__name__}: {error}"


def user_frames(error: BaseException) -> str:
    """The traceback of `error` without posttrain's own frames or the import machinery's: the user's code."""
    ours = (str(Path(__file__).resolve().parent), str(Path(importlib.__file__).resolve().parent))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith("<frozen") and not str(Path(f.filename).resolve()).startswith(ours)]
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(error), error)
    return "".join(lines).rstrip()


@contextlib.contextmanager
def user_code():
    """Marks this thread as running user code while inside: os._exit there raises ProcessExitCalled (which
    what_it_did names) instead of ending the process with no word."""
    install_exit_guard()
    me = threading.get_ident()
    nested = me in _inside_user
    _inside_user.add(me)
    try:
        yield
    finally:
        if not nested:
            _inside_user.discard(me)


def run_user_loop(loop) -> None:
    """Run an event loop that runs only user coroutines (async reward functions), in this thread, as user code:
    os._exit in any of them raises ProcessExitCalled in that coroutine instead of ending the process."""
    with user_code():
        loop.run_forever()


async def awaited_user(awaitable) -> Any:
    """await user code on such a loop. sys.exit there would not stay in the coroutine: asyncio re-raises SystemExit
    out of run_forever, which stops the loop (every later coroutine then waits forever) and ends its thread without
    a word; it comes back as ProcessExitCalled, which what_it_did names, with the user's traceback."""
    try:
        return await awaitable
    except SystemExit as e:
        raise ProcessExitCalled(e.code, "sys.exit").with_traceback(e.__traceback__) from None


def call_user(fn: Callable, what: str, *args, **kwargs) -> Any:
    """fn(*args, **kwargs); anything it raises but a UserError or Ctrl-C becomes a UserCodeError naming `what`."""
    try:
        with user_code():
            return fn(*args, **kwargs)
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit included: see the module docstring
        raise UserCodeError(f"{what} {what_it_did(e)}", e) from e


def call_with_deadline(fn: Callable, what: str, seconds: float, *args, **kwargs) -> Any:
    """call_user in a daemon thread, waited on for `seconds`: user code that never returns stops the run with a
    UserCodeError naming `what` and the deadline instead of hanging it (the thread runs on, but never keeps the
    process from exiting)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        future.set_running_or_notify_cancel()
        try:
            future.set_result(call_user(fn, what, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, name=f"user-code: {what}"[:60], daemon=True).start()
    started = time.monotonic()
    while True:
        left = started + seconds - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(0.2, left)))
        except concurrent.futures.TimeoutError:
            if _stop_signal[0]:
                name = signal.Signals(_stop_signal[0]).name
                raise RunStopped(f"{name} while {what} was running ({time.monotonic() - started:.0f}s without "
                                 "returning): stopped without saving, the last checkpoint is intact; continue with "
                                 "train.resume_from_checkpoint=auto", 128 + _stop_signal[0], shared=False) from None
            if left <= 0:
                raise UserCodeError(f"{what} did not return within {seconds:g}s (agent.user_code_timeout); it is "
                                    "stopped here instead of hanging the run") from None


def import_user(module_name: str, what: str):
    """Import 'package.module' (on sys.path or in the working directory) or 'path/to/file.py'; anything the module
    does on import that fails it (sys.exit included) is a UserError naming `what`."""
    from_file = module_name.endswith(".py")
    path = Path(module_name).expanduser()
    if from_file and not path.is_file():
        raise UserError(f"{what}: file {module_name} does not exist")
    if not from_file and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `posttrain grpo` run next to my_rewards.py finds it, as `python -m` would
    try:
        if not from_file:
            return importlib.import_module(module_name)
        spec = importlib.util.spec_from_file_location(f"posttrain_user_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit included: see the module docstring
        raise UserError(f"{what}: cannot import module '{module_name}': it {what_it_did(e)}\n{user_frames(e)}") from None


def load_callable(spec: str, what: str, shown: str = "") -> Callable:
    """'package.module:attribute' or 'path/to/file.py:attribute' -> the callable it names; a UserError starting
    "{what} '{shown or spec}'" when it does not import or is not callable (rewards, tools, environments, parsers)."""
    shown = shown or spec
    if ":" not in spec:
        raise UserError(f"{what} '{spec}' is not an import path; write it as 'package.module:name' or "
                        "'path/to/file.py:name'")
    module_name, _, attribute = spec.rpartition(":")
    target = import_user(module_name, f"{what} '{shown}'")
    for depth, part in enumerate(attribute.split(".")):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            owner = module_name if depth == 0 else getattr(target, "__name__", target)  # a file: its path, as given
            raise UserError(f"{what} '{shown}': {owner!s} has no attribute '{part}'{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"{what} '{shown}': '{attribute}' is a {type(target).__name__}, not a function or class")
    return target
