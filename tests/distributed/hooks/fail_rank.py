"""Test hook: rank POSTTRAIN_TEST_FAIL_RANK (default 1) fails inside its SFT loss from micro-batch
POSTTRAIN_TEST_FAIL_CALL (default 3, i.e. during step 2 with accumulation 2), while its peers wait in a collective.

POSTTRAIN_TEST_FAIL_HOW=raise (default) raises an exception; =kill kill -9s the process (no Python cleanup, no
message, as when the OOM killer or a node failure takes it), first writing the time to POSTTRAIN_TEST_KILLED_AT;
=nan_grad keeps the loss finite and makes its gradient NaN (as an overflow inside backward does)."""

import os
import signal
import time
from pathlib import Path

import torch

from posttrain.algorithms.sft import SFT

_RANK = int(os.environ["RANK"])
_FAIL_RANK = int(os.environ.get("POSTTRAIN_TEST_FAIL_RANK", "1"))
_FAIL_CALL = int(os.environ.get("POSTTRAIN_TEST_FAIL_CALL", "3"))
_HOW = os.environ.get("POSTTRAIN_TEST_FAIL_HOW", "raise")
_calls = 0
_loss = SFT.loss


class _NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _failing_loss(self, model, batch, normaliser):
    global _calls
    _calls += 1
    if _RANK == _FAIL_RANK and _calls >= _FAIL_CALL:
        if _HOW == "nan_grad":
            loss, metrics = _loss(self, model, batch, normaliser)
            return _NanGradient.apply(loss), metrics
        if _HOW == "kill":
            Path(os.environ["POSTTRAIN_TEST_KILLED_AT"]).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure on rank {_RANK} (test hook fail_rank)")
    return _loss(self, model, batch, normaliser)


SFT.loss = _failing_loss
