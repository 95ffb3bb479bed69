"""Test hook: rank POSTTRAIN_TEST_KILL_RANK (default 1) kill -9s itself inside its SFT loss at micro-batch
POSTTRAIN_TEST_KILL_CALL (default 5, i.e. during step 3 with accumulation 2): no Python cleanup, no message, as when
the kernel's OOM killer or a node failure takes a process; its peers are then in or near a collective."""

import os
import signal
import time
from pathlib import Path

from posttrain.algorithms.sft import SFT

_RANK = int(os.environ["RANK"])
_KILL_RANK = int(os.environ.get("POSTTRAIN_TEST_KILL_RANK", "1"))
_KILL_CALL = int(os.environ.get("POSTTRAIN_TEST_KILL_CALL", "5"))
_calls = 0
_loss = SFT.loss


def _loss_then_die(self, model, batch, normaliser):
    global _calls
    _calls += 1
    if _RANK == _KILL_RANK and _calls >= _KILL_CALL:
        Path(os.environ["POSTTRAIN_TEST_KILLED_AT"]).write_text(str(time.time()))  # when, for the test to time
        os.kill(os.getpid(), signal.SIGKILL)
    return _loss(self, model, batch, normaliser)


SFT.loss = _loss_then_die
