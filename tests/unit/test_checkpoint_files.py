"""Checkpoint manifests, disk-full detection, the start-up free-space warning, safetensors framing checks and
metrics.jsonl rows that stay JSON (issue #15)."""

from __future__ import annotations

import errno
import json
import math
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from posttrain.rundir.checkpoint import resumable_problem
from posttrain.rundir.files import (MANIFEST, fsync_tree, is_disk_full, verify, warn_low_disk,
                                       write_manifest)
from posttrain.rundir.metrics import MetricsLogger, read_metrics
from posttrain.models.load import safetensors_problem


def checkpoint(tmp_path):
    root = tmp_path / "step-2"
    (root / "pytorch_model").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(b"w" * 100)
    (root / "pytorch_model" / "optim_states.pt").write_bytes(b"o" * 50)
    (root / "trainer_state.json").write_text("{}")
    write_manifest(root)
    fsync_tree(root)
    return root


def test_manifest_finds_every_kind_of_damage(tmp_path):
    root = checkpoint(tmp_path)
    assert verify(root) is None
    assert set(json.loads((root / MANIFEST).read_text())["files"]) == {
        "model.safetensors", "pytorch_model/optim_states.pt", "trainer_state.json"}
    (root / "model.safetensors").write_bytes(b"w" * 60)
    assert verify(root) == "model.safetensors holds 60 bytes, 100 expected"
    (root / "model.safetensors").write_bytes(b"w" * 99 + b"x")  # same size, other bytes
    assert verify(root) == "model.safetensors does not match its checksum"
    (root / "model.safetensors").write_bytes(b"w" * 100)
    (root / "pytorch_model" / "optim_states.pt").unlink()
    assert verify(root) == "pytorch_model/optim_states.pt is missing"
    (root / MANIFEST).write_text('{"files": ')
    assert verify(root).startswith(f"{MANIFEST} is unreadable")
    (root / MANIFEST).unlink()
    assert verify(root) == f"it has no {MANIFEST} (every checkpoint posttrain writes has one)"


@pytest.mark.parametrize("manifest, problem", [
    ([], "malformed (expected"),
    ({"files": []}, "malformed (expected"),
    ({"files": {}}, "malformed (it lists no file)"),
    ({"files": {"model.safetensors": {"size": 100, "sha256": "0"}}}, "does not list trainer_state.json"),
    ({"files": {"trainer_state.json": [2, "x"]}}, "the entry for 'trainer_state.json' is not"),
])
def test_a_malformed_manifest_is_a_problem_not_a_traceback(tmp_path, manifest, problem):
    root = checkpoint(tmp_path)
    (root / MANIFEST).write_text(json.dumps(manifest))
    assert problem in verify(root)


@pytest.mark.parametrize("name", ["../../etc/hostname", "/etc/hostname", "link/hostname"])
def test_manifest_paths_stay_inside_the_checkpoint(tmp_path, name):
    root = checkpoint(tmp_path)
    (root / "link").symlink_to("/etc")
    entries = json.loads((root / MANIFEST).read_text())
    entries["files"][name] = {"size": 1, "sha256": "0"}
    (root / MANIFEST).write_text(json.dumps(entries))
    assert verify(root) == f"{MANIFEST} names {name!r}, outside the checkpoint"


def rng_checkpoint(tmp_path, world_size=1):
    root = tmp_path / "step-2"
    root.mkdir()
    (root / "trainer_state.json").write_text(json.dumps({"run": {"world_size": world_size}, "state": {"step": 2}}))
    for rank in range(world_size):  # what Accelerate's save_state writes per process
        torch.save({"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                    "torch_manual_seed": torch.get_rng_state()}, root / f"random_states_{rank}.pkl")
    write_manifest(root)
    return root


def test_rng_state_that_cannot_be_read_stops_a_strict_resume(tmp_path, capsys):
    root = rng_checkpoint(tmp_path, world_size=2)
    assert resumable_problem(root) is None
    (root / "random_states_1.pkl").write_bytes(b"not a torch file")
    write_manifest(root)  # the manifest matches: the file was written this way, it is not damage afterwards
    problem = resumable_problem(root)
    assert "random number generators' state cannot be restored (random_states_1.pkl cannot be read" in problem
    assert "train.resume_strict=false" in problem
    assert resumable_problem(root, strict=False) is None
    assert "random_states_1.pkl cannot be read" in capsys.readouterr().err
    (root / "random_states_1.pkl").unlink()
    write_manifest(root)
    assert "random_states_1.pkl is missing" in resumable_problem(root)


@pytest.mark.parametrize("state, problem", [
    ({"step": -5}, "records step=-5; each must be a whole number >= 0"),
    ({"step": 2, "tokens_seen": 1.5}, "tokens_seen=1.5"),
    ({"step": True}, "step=True"),
    ({"step": 3}, "records step 3, but the checkpoint is step-2"),
    ({"step": 2, "epoch": 1}, "has no readable state (TypeError"),
    (None, "has no readable state (TypeError"),
])
def test_a_trainer_state_that_says_where_no_run_was_is_refused(tmp_path, state, problem):
    """Edited with the manifest recomputed (so the checksums pass): a step of -5 used to be resumed, and the
    resume dropped every metrics row after step -5."""
    root = rng_checkpoint(tmp_path)
    (root / "trainer_state.json").write_text(json.dumps({"run": {"world_size": 1}, "state": state}))
    write_manifest(root)
    assert problem in resumable_problem(root)


def test_resume_strict_false_accepts_a_checkpoint_without_manifest_but_never_damage(tmp_path, capsys):
    root = rng_checkpoint(tmp_path)
    (root / MANIFEST).unlink()
    assert "has no manifest.json" in resumable_problem(root)
    assert resumable_problem(root, strict=False) is None
    assert "is not verified" in capsys.readouterr().err
    write_manifest(root)
    (root / "random_states_0.pkl").write_bytes(b"cut")
    assert "does not match" in resumable_problem(root, strict=False) or "bytes" in resumable_problem(root, strict=False)


def test_disk_full_is_recognised_through_wrapping_errors(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer, tmp_path)
    assert not is_disk_full(ValueError("a bug, not a full disk"), tmp_path)


def test_low_disk_warning(tmp_path, capsys):
    warn_low_disk(tmp_path / "not-yet" / "out", 1 << 60)
    err = capsys.readouterr().err
    assert "posttrain: warning:" in err and str(tmp_path) in err and "MiB free" in err
    warn_low_disk(tmp_path, 1)
    assert capsys.readouterr().err == ""


def test_safetensors_framing(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64)}, str(path))
    assert safetensors_problem(path) is None
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    assert "bytes where its header describes" in safetensors_problem(path)
    path.write_bytes(data[:20])
    assert "header is cut short" in safetensors_problem(path)
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    assert "unreadable header" in safetensors_problem(path)


def test_metrics_stay_json_and_a_cut_last_line_is_dropped_on_resume(tmp_path):
    logger = MetricsLogger(str(tmp_path), 4, 0, True)
    logger.log(1, {"loss": 1.5})
    logger.log(2, {"loss": math.nan, "grad_norm": math.inf})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 1.5}, {"step": 2, "loss": None, "grad_norm": None}]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    MetricsLogger(str(tmp_path), 4, 1, True).close()  # resuming from step 1
    assert (tmp_path / "metrics.jsonl").read_text() == lines[0] + "\n"
