"""How a training process ends with a process group: gloo's worker threads given time to finish at exit (a clean run
must not abort in Python's finalisation), and `abort` for a rank that cannot go on (its peers see the connection drop
instead of waiting for the timeout)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from posttrain.distributed import peers


@functools.cache
def settle_at_exit() -> None:
    atexit.register(_let_gloo_workers_finish)


def _gloo_workers_running() -> bool:
    """Whether a gloo worker thread of this process is running or runnable (Linux /proc; False elsewhere)."""
    task = Path("/proc/self/task")
    try:
        tids = os.listdir(task)
    except OSError:
        return False
    for tid in tids:
        with contextlib.suppress(OSError):
            if ((task / tid / "comm").read_text().startswith("pt_gloo_runloop")
                    and peers.process_state(task / tid / "stat") == "R"):
                return True
    return False


def _let_gloo_workers_finish(limit_s: float = 2.0) -> None:
    """At exit, let gloo's worker threads finish releasing their last work: one that drops a tensor (taking the GIL)
    while Python finalizes aborts a run that succeeded ("terminate called without an active exception")."""
    gc.collect()
    deadline = time.monotonic() + limit_s
    idle_checks = 0
    while idle_checks < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
        idle_checks = 0 if _gloo_workers_running() else idle_checks + 1


def abort() -> None:
    """After an unrecoverable error on this rank: exit now, so peers waiting in a collective see the connection
    drop (and torchrun / accelerate launch stop the group) instead of hanging until the timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        os._exit(1)
