"""Runs that are killed, preempted, diverge or hit a full disk keep their work (issue #15), on the tiny model (CPU).

Faults are injected at the point they happen in real runs: a signal sent to this process from inside a step, a loss
that turns NaN, an OSError(ENOSPC) from the engine's save, a checkpoint file cut short after it was written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.algorithms.sft import SFT
from posttrain.rundir.files import verify
from posttrain.cli import main
from posttrain.distributed.backend import Backend
from posttrain.demo.tasks import write_example_data
from posttrain.train.guard import Guard
from tests.integration.helpers import final_weights, max_weight_diff, metrics, run_cli, run_overrides, step_losses

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=48, n_eval=8)


def sft(tiny_model_dir, data, out, *extra) -> int:
    return run_cli("sft", *run_overrides(tiny_model_dir, data["sft_train"], out, f"train.max_steps={STEPS}",
                                         "train.per_device_train_batch_size=4", "train.save_steps=2", *extra))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data, tmp_path_factory):
    """The uninterrupted run: per-step losses and final weights."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert sft(tiny_model_dir, data, out) == 0
    return step_losses(out), final_weights(out)


def assert_same_as_reference(out: Path, reference) -> None:
    losses, weights = reference
    assert step_losses(out) == pytest.approx(losses, abs=1e-6)
    assert max_weight_diff(final_weights(out), weights) < 1e-6


def at_step(monkeypatch, step: int, action) -> None:
    """Run `action()` inside the first loss computation of optimiser step `step` (1-based; 1 micro-batch per step)."""
    calls = {"n": 0}
    loss = SFT.loss

    def patched(self, model, batch, normaliser):
        calls["n"] += 1
        out = loss(self, model, batch, normaliser)
        if calls["n"] == step:
            return action(out)
        return out

    monkeypatch.setattr(SFT, "loss", patched)


def send(sig):
    def action(out):
        os.kill(os.getpid(), sig)  # the handler only records it; the step finishes
        return out
    return action


def nan_loss(out):
    loss, metrics_ = out
    return loss * float("nan"), metrics_


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("model*.safetensors"))))


# --- 1. auto with no checkpoint yet ---------------------------------------------------------------------------------


def test_auto_starts_a_run_killed_before_its_first_checkpoint(tiny_model_dir, data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".posttrain-run").write_text("{}")  # what a run killed during model loading or step 1 leaves
    (out / "config.yaml").write_text("seed: 3\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert sft(tiny_model_dir, data, out) == 2  # without auto the run is still refused
    assert "resume_from_checkpoint=auto" in capsys.readouterr().err
    assert sft(tiny_model_dir, data, out, "train.resume_from_checkpoint=auto") == 0
    assert_same_as_reference(out, reference)
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))


def test_a_run_that_failed_at_step_0_is_rerun_in_place_and_a_trained_one_is_not(tiny_model_dir, data, tmp_path,
                                                                                monkeypatch, capsys):
    """The fix-and-retry loop: the same command again, no flag; once it has a checkpoint, the flag is needed."""
    def bug(*args):
        raise ValueError("a bug in the user's code")

    monkeypatch.setattr(SFT, "loss", bug)
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out, "train.max_steps=2") == 1
    monkeypatch.undo()
    capsys.readouterr()
    assert sft(tiny_model_dir, data, out, "train.max_steps=2") == 0
    err = capsys.readouterr().err
    assert "the previous run there ended in an error (ValueError: a bug in the user's code)" in err, err
    assert (out / "final").is_dir() and list((out / "failed-attempts").glob("*/config.yaml"))
    assert sft(tiny_model_dir, data, out, "train.max_steps=2") == 2
    assert "already holds a run" in capsys.readouterr().err


def test_the_hint_after_ctrl_c_works_as_printed(tiny_model_dir, data, reference, tmp_path, monkeypatch, capsys):
    """Even for a command that asked to overwrite, which the printed command must not repeat."""
    at_step(monkeypatch, 2, send(signal.SIGINT))
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out, "train.overwrite_output_dir=true") == 130
    monkeypatch.undo()
    err = capsys.readouterr().err
    printed = re.search(r"continue with `posttrain ([^`]+)`", err)
    assert printed, err
    assert main(shlex.split(printed.group(1))) == 0
    assert_same_as_reference(out, reference)


# --- 2. non-finite loss / gradient norm ------------------------------------------------------------------------------


def test_divergence_stops_naming_the_step_and_saves_nothing_non_finite(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    # 1e20: the tiny model saturates at 1e6 (its loss goes flat); here step 1 leaves huge weights, step 2 overflows
    code = sft(tiny_model_dir, data, out, "train.learning_rate=1e20", "train.save_steps=1", "train.save_total_limit=1")
    err = capsys.readouterr().err
    assert code == 1 and err.count("posttrain: error: step ") == 1, err
    assert "Traceback" not in err
    assert not (out / "final").exists()
    for row in metrics(out):  # every line is JSON (metrics() parses them) and holds no NaN
        assert all(v is None or not isinstance(v, float) or v == v for v in row.values())
    kept = list((out / "checkpoints").glob("step-*"))
    assert len(kept) == 1, kept  # rotation kept the newest finite checkpoint
    assert all(torch.isfinite(t).all() for t in checkpoint_weights(kept[0]).values())
    stopped_at = int(err.split("posttrain: error: step ")[1].split(":")[0])
    assert int(kept[0].name[5:]) < stopped_at


def test_a_nan_step_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_model_dir, data, tmp_path, monkeypatch,
                                                                      capsys):
    at_step(monkeypatch, 4, nan_loss)
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out, "train.save_total_limit=1") == 1
    err = capsys.readouterr().err
    assert "posttrain: error: step 4: the loss is not finite and the gradient norm is nan" in err, err
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-2"]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert not (out / "final").exists()


def test_skip_drops_the_update_of_a_nan_step_and_logs_null(tiny_model_dir, data, reference, tmp_path, monkeypatch,
                                                            capsys):
    at_step(monkeypatch, 4, nan_loss)
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out, "train.nonfinite=skip") == 0
    rows = {r["step"]: r for r in metrics(out)}
    assert rows[4]["loss"] is None and rows[4]["grad_norm"] is None
    assert rows[3]["loss"] == pytest.approx(reference[0][3], abs=1e-6)  # steps before are untouched
    state = json.loads((out / "checkpoints" / f"step-{STEPS}" / "trainer_state.json").read_text())
    assert state["state"]["nonfinite_skips"] == 1
    assert all(torch.isfinite(t).all() for t in final_weights(out).values())
    # the limit: a second run allowed no skipped step stops at it
    at_step(monkeypatch, 4, nan_loss)
    assert sft(tiny_model_dir, data, tmp_path / "limit", "train.nonfinite=skip", "train.max_nonfinite_skips=0") == 1
    assert "step 4:" in capsys.readouterr().err


# --- 3. preemption ---------------------------------------------------------------------------------------------------


def test_sigterm_saves_at_the_step_boundary_exits_143_and_resume_is_exact(tiny_model_dir, data, reference, tmp_path,
                                                                          monkeypatch, capsys):
    at_step(monkeypatch, 3, send(signal.SIGTERM))
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)  # the default, or a handler someone else installed (ray.init does)
    assert sft(tiny_model_dir, data, out) == 143
    err = capsys.readouterr().err
    assert "posttrain: stopped: SIGTERM at step 3: checkpoint saved to" in err, err
    assert verify(out / "checkpoints" / "step-3") is None and not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) == before  # the run's handler is gone once the loop is
    monkeypatch.undo()
    assert sft(tiny_model_dir, data, out, "train.resume_from_checkpoint=auto") == 0
    assert_same_as_reference(out, reference)


def test_ppo_stopped_by_sigterm_resumes_both_trained_roles_exactly(tiny_model_dir, data, tmp_path, monkeypatch,
                                                                    capsys):
    """Two trained roles (policy + critic): the stop checkpoint holds both, and the resumed run ends with the same
    policy (final/) and critic (final-critic/) as the uninterrupted one, bit for bit. With ppo_epochs=2 a signal in
    step 3 stops after step 4, the end of the generation batch (a checkpoint inside it would not resume exactly)."""
    def ppo(out, *extra):
        return run_cli("ppo", *run_overrides(
            tiny_model_dir, data["prompts_train"], out, "train.max_steps=6", "train.save_steps=6",
            "train.per_device_train_batch_size=4", "generation.max_completion_length=8", "algo.ppo_epochs=2",
            "rewards=[{name: length_penalty, kwargs: {max_length: 40}}]", "algo.critic_learning_rate=3e-3", *extra,
            learning_rate="1e-3"))

    assert ppo(tmp_path / "full") == 0
    calls = {"n": 0}
    local_flags = Guard.local_flags

    def signal_in_step_3(self, step_loss):  # once per step, after the updates: the signal arrives during step 3
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return local_flags(self, step_loss)

    monkeypatch.setattr(Guard, "local_flags", signal_in_step_3)
    out = tmp_path / "run"
    assert ppo(out) == 143
    assert "SIGTERM at step 4: checkpoint saved to" in capsys.readouterr().err
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-4"]
    assert verify(out / "checkpoints" / "step-4") is None and not (out / "final").exists()
    monkeypatch.undo()
    assert ppo(out, "train.resume_from_checkpoint=auto") == 0
    assert step_losses(out) == step_losses(tmp_path / "full")
    for name in ("final", "final-critic"):
        a, b = (load_file(str(next((run / name).glob("*.safetensors")))) for run in (tmp_path / "full", out))
        assert max_weight_diff(a, b) == 0.0, name


def test_sigint_does_the_same_with_exit_130(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    at_step(monkeypatch, 1, send(signal.SIGINT))
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out) == 130
    assert "SIGINT at step 1" in capsys.readouterr().err
    assert (out / "checkpoints" / "step-1" / "trainer_state.json").exists()


# --- 5. faults mid-run -----------------------------------------------------------------------------------------------


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    save_state = Backend.save_state
    calls = {"n": 0}

    def full_disk(self, path):
        calls["n"] += 1
        if calls["n"] < 2:
            return save_state(self, path)
        (Path(path) / "model.safetensors").write_bytes(b"\0" * 1000)  # the part that fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(path) / "model.safetensors"))

    monkeypatch.setattr(Backend, "save_state", full_disk)
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out) == 1
    err = capsys.readouterr().err
    assert err.count("posttrain: error: no space left while writing the checkpoint") == 1, err
    assert ".tmp-step-4" in err and "MiB" in err and "step-2 is intact" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert verify(out / "checkpoints" / "step-2") is None


def test_auto_passes_over_a_damaged_newest_checkpoint(tiny_model_dir, data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    assert sft(tiny_model_dir, data, out, "train.max_steps_per_run=4", "train.save_total_limit=null") == 0
    weights = next((out / "checkpoints" / "step-4").glob("model*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])  # cut short by something else (a full disk, a bad copy)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 1.')  # a kill in the middle of a metrics line
    assert sft(tiny_model_dir, data, out, "train.resume_from_checkpoint=auto") == 0
    captured = capsys.readouterr()
    assert "step-4 is damaged" in captured.err and "bytes, " in captured.err, captured.err
    assert f"resumed_from={out / 'checkpoints' / 'step-2'}" in captured.out, captured.out
    assert_same_as_reference(out, reference)
