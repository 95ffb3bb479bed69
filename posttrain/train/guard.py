"""Keeping a run's work: stop requests (SIGTERM, SIGINT) and steps whose loss or gradient norm is not finite.

    with Guard(recipe.train, backend) as guard:              # run.py: handlers installed for the loop only
        ...                                                   # phase 4: backend.step(..., skip_nonfinite=guard.skip)
        local = torch.cat([local, guard.local_flags(step_loss)])   # phase 5: two more numbers in the one all-reduce
        guard.check_step(state, reduced[-2:], grad_norm)      # non-finite: raises RunStopped, or counts a skipped step
        if guard.stop_signal (at a generation-batch end): save, then guard.stopped(step, path)  # RunStopped(143 / 130)

Clusters (SLURM, Kubernetes) send SIGTERM a grace period before SIGKILL, and torchrun / accelerate launch forward it
to every worker. The handler only records the signal; the loop acts at the next step boundary on a decision every
rank shares (the flags travel in the step's metrics all-reduce, so no collective is added and none is left
half-entered): each rank saves the same checkpoint, says so, and the process exits 128 + the signal number. Where an
online algorithm reuses one generation batch for several steps (PPO's ppo_epochs, GRPO's num_iterations), the stop
waits for the end of that batch, the only place a checkpoint resumes exactly. A second signal gets the handler that
was there before, whichever of the two it is (by default: exit at once).

A non-finite step is agreed the same way (the summed loss flag, and the gradient norm, which is global). With
train.nonfinite=stop (the default) the run stops before that step is logged or saved, so every checkpoint and final/
hold finite weights; with skip, the backend drops the step's update (its gradients are zeroed, the optimiser does not
step) and the run goes on until train.max_nonfinite_skips steps were skipped. DeepSpeed applies the update inside
backward, so there a non-finite step always stops the run.
"""

from __future__ import annotations

import math
import signal
import threading

import torch

from posttrain.errors import RunStopped
from posttrain.usercode import request_stop

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Guard:
    def __init__(self, t, backend):
        self.policy = t.nonfinite
        self.max_skips = t.max_nonfinite_skips
        self.skip = t.nonfinite == "skip" and backend.can_skip_steps
        self.signal = 0  # the signal this process received, 0 for none
        self.stop_signal = 0  # the signal every rank agreed to stop for, at the last step boundary
        self._previous: dict[int, object] = {}

    # --- signals ---------------------------------------------------------------------------------------------
    def __enter__(self) -> "Guard":
        request_stop(0)
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.signal = signum
        request_stop(signum)  # a wait on user code that hangs ends now (usercode.call_with_deadline)
        for sig in STOP_SIGNALS:  # a second one, of either kind (TERM then Ctrl-C), acts at once
            signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))

    def __exit__(self, kind, error, tb) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        request_stop(0)
        if kind is None and self.signal and not self.stop_signal:  # after the last step: its checkpoint holds all
            raise RunStopped(f"{signal.Signals(self.signal).name} after the last step, before exporting final/ (the "
                             "last checkpoint holds every step, and continuing exports it)", 128 + self.signal,
                             resumable=True)

    def stopped(self, step: int, checkpoint) -> None:
        name = signal.Signals(self.stop_signal).name
        raise RunStopped(f"{name} at step {step}: checkpoint saved to {checkpoint}",
                         128 + (self.signal or self.stop_signal), resumable=True)

    # --- the step's flags ------------------------------------------------------------------------------------
    def local_flags(self, step_loss: torch.Tensor) -> torch.Tensor:
        """[this rank's loss is not finite, the signal this rank received]: summed over ranks with the metrics."""
        return torch.stack([(~torch.isfinite(step_loss)).float(),
                            torch.tensor(float(self.signal), device=step_loss.device)])

    def check_step(self, state, reduced_flags: torch.Tensor, grad_norm) -> None:
        """Act on the step's agreed flags: raise RunStopped for a non-finite step under `stop` (or past the skip
        limit), count a skipped one, and note a stop request for the step boundary."""
        loss_bad, signals = (float(x) for x in reduced_flags)
        if signals > 0:
            self.stop_signal = self.signal or int(signal.SIGTERM)  # a peer got it (launchers send SIGTERM)
        norm = float(grad_norm)
        if not loss_bad and math.isfinite(norm):
            return
        loss = "not finite" if loss_bad else "finite"
        what = f"step {state.step}: the loss is {loss} and the gradient norm is {norm}"
        if self.skip and not math.isfinite(norm):
            state.nonfinite_skips += 1
            if state.nonfinite_skips <= self.max_skips:
                return  # the backend dropped this step's update; the step is logged with null loss
            raise RunStopped(f"{what}: {state.nonfinite_skips} steps skipped, more than train.max_nonfinite_skips="
                             f"{self.max_skips}; nothing of these steps is saved. Lower train.learning_rate or check "
                             "the data, then continue with train.resume_from_checkpoint=auto")
        raise RunStopped(f"{what}: stopped before saving it, so every checkpoint holds finite weights. Lower "
                         "train.learning_rate (or raise train.warmup_steps) and continue from the newest checkpoint "
                         "with train.resume_from_checkpoint=auto, or set train.nonfinite=skip to drop such steps")


def require_finite(backend, bad: float, where: str) -> None:
    """Refuse to save a model holding NaN/inf: `bad` is this rank's count of non-finite parameter tensors (every rank
    calls it: the check is agreed with one all-reduce)."""
    if float(backend.all_reduce_sum(torch.tensor(float(bad), device=backend.device))) > 0:
        raise RunStopped(f"{where}: the model's weights hold NaN/inf; not saving them (the newest checkpoint "
                         "keeps finite weights). Lower train.learning_rate and continue with "
                         "train.resume_from_checkpoint=auto")
