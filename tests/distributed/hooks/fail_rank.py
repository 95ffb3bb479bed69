"""Test hook: rank POSTTRAIN_TEST_FAIL_RANK (default 1) raises inside its SFT loss from micro-batch
POSTTRAIN_TEST_FAIL_CALL (default 3, i.e. during step 2 with accumulation 2), while its peers wait in a collective."""

import os

from posttrain.algorithms.sft import SFT

_RANK = int(os.environ["RANK"])
_FAIL_RANK = int(os.environ.get("POSTTRAIN_TEST_FAIL_RANK", "1"))
_FAIL_CALL = int(os.environ.get("POSTTRAIN_TEST_FAIL_CALL", "3"))
_calls = 0
_loss = SFT.loss


def _failing_loss(self, model, batch, normaliser):
    global _calls
    _calls += 1
    if _RANK == _FAIL_RANK and _calls >= _FAIL_CALL:
        raise RuntimeError(f"injected failure on rank {_RANK} (test hook fail_rank)")
    return _loss(self, model, batch, normaliser)


SFT.loss = _failing_loss
