"""Errors and warnings meant for people. A `UserError` means the input is wrong: the CLI prints it and exits with
code 2; `warn` prints one line on stderr from rank 0."""

import os
import sys


FLOAT32_MAX = 3.4028234663852886e38
"""torch.finfo(torch.float32).max. Rewards, weights, advantages and losses are float32 tensors: a number finite as a
Python float (float64) but larger than this is inf there, and an inf reward silently zeroes its group's advantages."""


def overflows_float32(value) -> bool:
    """A real number (finite as a Python float) that float32 would hold as inf (the pure-Python check, for config
    and user-code values checked before any tensor is built)."""
    return abs(value) > FLOAT32_MAX


class UserError(Exception):
    """Wrong config, data, paths or options. The message names what and where, and says what to do."""


class RunStopped(Exception):
    """The run stopped on purpose, with its work saved where possible: a signal (exit 128 + signal number), a
    non-finite loss or gradient norm, a full disk (exit 1). The CLI prints the message as one line, no traceback."""

    def __init__(self, message: str, exit_code: int = 1, shared: bool = True, resumable: bool = False):
        super().__init__(message)
        self.reason = message
        self.exit_code = exit_code
        self.shared = shared  # every rank stops for the same reason: only rank 0 prints it
        self.resumable = resumable  # a checkpoint holds every step so far: the message says how to continue
        # how to continue, as the message says it: the CLI puts the whole command here, the demo its own
        self.continue_with = "train.resume_from_checkpoint=auto"

    def __str__(self) -> str:
        return self.reason + (f"; continue with {self.continue_with}" if self.resumable else "")


def warn(message: str) -> None:
    """One warning line on stderr, from rank 0 only (every rank checks the same files)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"posttrain: warning: {message}", file=sys.stderr, flush=True)


def require_package(module: str, what: str, package: str, extra: str = "envs"):
    """Import an optional dependency, or stop with exit 2 naming the package and the extra that installs it (called
    at start-up, so a recipe that needs a missing one fails before any model loads)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"{what} needs the '{package}' package, which is not installed here ({e}); install it with "
                        f"pip install 'posttrain[{extra}]' (or pip install {package})") from None
