"""train.report_to: each tracker fed a fake metrics stream through MetricsLogger, offline, and read back with its
own library (TensorBoard's event reader, W&B's offline run file, MLflow's client, trackio's storage); the names and
install checks at config validation. No model, no training run."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.load import load_recipe
from posttrain.config.schema import SFTAlgoConfig, TrainConfig, trackers
from posttrain.errors import RunStopped, UserError
from posttrain.rundir.metrics import MetricsLogger, read_metrics
from posttrain.report.trackers import Tracker, TrackedRun, closing_status, open_trackers

STREAM = [  # (step, row) as the loop logs them: eval at step 0, train rows, an eval row at a step already logged
    (0, {"eval/accuracy": 0.25}),
    (1, {"loss": 2.0, "learning_rate": 1e-4, "reward/mean": 0.5}),
    (2, {"loss": 1.5, "learning_rate": 1e-4, "reward/mean": 0.75}),
    (2, {"eval/accuracy": 0.5}),
    (3, {"loss": float("nan"), "learning_rate": 1e-4, "reward/mean": 1.0}),  # a skipped step: not a number
]
LOGGED = {"loss": [(1, 2.0), (2, 1.5)], "eval/accuracy": [(0, 0.25), (2, 0.5)],
          "reward/mean": [(1, 0.5), (2, 0.75), (3, 1.0)]}


def tracked(tmp_path, name="run-a") -> TrackedRun:
    config = {"command": "grpo", "train": {"learning_rate": 1e-4, "report_to": ["wandb"]},
              "model": {"name_or_path": "tiny/"}}
    return TrackedRun(output_dir=tmp_path, name=name, project="posttrain-test", config=config, start_step=0)


def feed(tmp_path, names, status="finished", run=None) -> None:
    logger = MetricsLogger(str(tmp_path), 3, 0, True, open_trackers(names, run or tracked(tmp_path)))
    for step, row in STREAM:
        logger.log(step, row)
    logger.close(status)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 2, 3]  # metrics.jsonl as ever


def series(pairs) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for key, step, value in pairs:
        out.setdefault(key, []).append((step, pytest.approx(value)))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items() if k in LOGGED}


# --- names, the old switch, and the start-up check ---------------------------------------------------------------

def test_report_to_names_the_trackers_and_tensorboard_stays_an_alias():
    assert trackers(TrainConfig()) == ("tensorboard",)
    assert trackers(TrainConfig(report_to=("none",))) == () == trackers(TrainConfig(report_to=()))
    assert trackers(TrainConfig(report_to=("wandb", "mlflow", "wandb"))) == ("wandb", "mlflow")
    assert trackers(TrainConfig(tensorboard=False)) == ()  # train.tensorboard=false in older recipes and scripts
    assert trackers(TrainConfig(report_to=("wandb",), tensorboard=True)) == ("wandb", "tensorboard")


def recipe(*overrides):
    return load_recipe(None, ["data.train=data.jsonl", *overrides], SFTAlgoConfig)


def test_report_to_is_checked_at_start_up():
    assert recipe("train.report_to=wandb").train.report_to == ("wandb",)  # a single name, as TRL allows
    assert recipe("train.report_to=[]").train.report_to == ()
    with pytest.raises(UserError, match="unknown tracker 'wandbb'; did you mean 'wandb'"):
        recipe("train.report_to=[wandbb]")
    with pytest.raises(UserError, match="'none' means no tracker"):
        recipe("train.report_to=[none, mlflow]")


def test_a_tracker_named_but_not_installed_is_exit_2_with_the_install_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(UserError, match=r"names trackio, but trackio is not installed; install it with "
                                        r"`pip install trackio`"):
        recipe("train.report_to=[tensorboard, trackio]")
    from posttrain.cli import run_command

    assert run_command(["sft", "data.train=missing.jsonl", "train.report_to=[trackio]"]) == 2  # before any data
    assert "pip install trackio" in capsys.readouterr().err


def test_mlflow_database_store_needs_sqlalchemy(monkeypatch):
    installed = {"mlflow", "sqlalchemy"}  # mlflow-skinny without alembic
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in installed else None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow's default: sqlite:///mlflow.db
    with pytest.raises(UserError, match="needs alembic: `pip install sqlalchemy alembic`"):
        recipe("train.report_to=[mlflow]")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # a server: nothing more to install
    recipe("train.report_to=[mlflow]")


def test_trackers_are_imported_only_when_named():
    code = ("import sys, posttrain.report.trackers, posttrain.rundir.metrics, posttrain.report; from posttrain.config.load import "
            "load_recipe; from posttrain.config.schema import SFTAlgoConfig; load_recipe(None, ['data.train=x', "
            "'train.report_to=[tensorboard]'], SFTAlgoConfig); print([m for m in ('wandb', 'mlflow', 'trackio', "
            "'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- a tracker that fails, and how a run that raised is closed ------------------------------------------------------

def test_a_tracker_that_fails_to_log_warns_once_and_the_run_goes_on(tmp_path, capsys):
    class Broken(Tracker):
        name = "broken"

        def write(self, step, metrics):
            raise ConnectionError("server went away")

    logger = MetricsLogger(str(tmp_path), 3, 0, True, [Broken(tracked(tmp_path))])
    for step, row in STREAM:
        logger.log(step, row)
    logger.close()
    assert capsys.readouterr().err.count("broken could not log step 0 (ConnectionError: server went away)") == 1
    assert len(read_metrics(tmp_path)) == len(STREAM)


def test_a_run_that_raised_closes_its_trackers_failed_or_killed():
    assert closing_status(RuntimeError("boom")) == "failed"
    assert closing_status(RunStopped("non-finite loss", exit_code=1)) == "failed"
    assert closing_status(RunStopped("SIGTERM", exit_code=143)) == "killed"
    assert closing_status(KeyboardInterrupt()) == "killed"


# --- each tracker, read back with its own library ---------------------------------------------------------------

def test_tensorboard_events_hold_every_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed(tmp_path, ("tensorboard",))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [(k, e.step, e.value) for k in events.Tags()["scalars"] for e in events.Scalars(k)]
    assert series(logged) == LOGGED
    assert "run/text_summary" in events.Tags()["tensors"]  # the run name and config, once


def wandb_records(run_file: Path):
    """W&B's offline run file: a LevelDB-style log (7-byte file header; records of crc32, length, type, data in
    32 KiB blocks, split across blocks as FIRST / MIDDLE / LAST) of wandb_internal Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, records = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_wandb_offline_run_folder_holds_the_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    feed(tmp_path, ("wandb",))
    import wandb

    wandb.teardown()  # W&B's service process writes the run file behind run.finish(); this waits for it
    folders = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 1
    records = wandb_records(next(folders[0].glob("run-*.wandb")))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.project) == ("run-a", "posttrain-test")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"] == {"learning_rate": 1e-4, "report_to": ["wandb"]} and config["command"] == "grpo"
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    steps = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.item} for h in history]
    logged = [(k, row["_step"], v) for row in steps for k, v in row.items()]
    assert series(logged) == LOGGED
    assert next(r.exit for r in records if r.WhichOneof("record_type") == "exit").exit_code == 0


def test_mlflow_local_file_store_holds_the_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # MLflow's sqlite store (its default) goes through the same client calls; creating its tables takes seconds
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store only on request
    feed(tmp_path, ("mlflow",))
    (tmp_path / "b").mkdir()
    feed(tmp_path / "b", ("mlflow",), status="failed", run=tracked(tmp_path / "b", "run-b"))
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("posttrain-test")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert {name: r.info.status for name, r in runs.items()} == {"run-a": "FINISHED", "run-b": "FAILED"}
    run = runs["run-a"]
    assert run.data.params["train.learning_rate"] == "0.0001" and run.data.params["command"] == "grpo"
    assert run.data.params["train.report_to"] == '["wandb"]'
    logged = [(k, m.step, m.value) for k in LOGGED for m in client.get_metric_history(run.info.run_id, k)]
    assert series(logged) == LOGGED


def test_trackio_local_project_holds_the_run(tmp_path):
    pytest.importorskip("trackio")
    # trackio reads TRACKIO_DIR when first imported: its own process, so the store is this test's folder
    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from pathlib import Path
from tests.unit.test_trackers import feed
from trackio.sqlite_storage import SQLiteStorage
feed(Path({str(tmp_path)!r}), ("trackio",))
print(json.dumps({{"logs": SQLiteStorage.get_logs("posttrain-test", "run-a"),
                  "config": SQLiteStorage.get_run_config("posttrain-test", "run-a")}}))
"""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    logged = [(k, row["step"], v) for row in found["logs"] for k, v in row.items() if isinstance(v, (int, float))]
    assert series(logged) == LOGGED
    assert found["config"]["train"]["learning_rate"] == 1e-4
    assert (tmp_path / "trackio" / "posttrain-test.db").is_file()



def test_the_recipe_checks_name_what_the_higher_layers_have():
    """config/validate.py keeps its own copies of three lists from layers above it (config/ stays torch-free): the
    trackers posttrain/report/trackers.py writes to, the dtypes models/load.py loads in and the roles of algorithms/base.py.
    They must not drift apart."""
    from posttrain.report import trackers
    from posttrain.algorithms.base import ROLE_NAMES
    from posttrain.config import validate
    from posttrain.models.load import DTYPES

    assert sorted(validate.TRACKERS) == sorted(trackers.TRACKERS)
    assert sorted(validate.CHOICES["model.dtype"]) == sorted(DTYPES)
    assert sorted(validate.PLACED_ROLES) == sorted(ROLE_NAMES)


def test_mlflows_default_store_is_inside_the_run(tmp_path, monkeypatch):
    """MLflow's own default, sqlite:///mlflow.db, is relative to the working directory: a file outside every run."""
    from posttrain.report.trackers import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking_uri(Path("runs/a")) == f"sqlite:///{tmp_path / 'runs' / 'a' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri(Path("runs/a")) == "http://127.0.0.1:5000"


def test_a_resumed_run_reads_metrics_jsonl_as_the_report_does(tmp_path, capsys):
    """One reader of metrics.jsonl (rundir/metrics.read_rows): a resumed run keeps the rows up to its checkpoint and
    drops a last line a kill cut short, as the report does; a line edited into something else mid-file stops it
    naming the line, where it used to be dropped without a word."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.')
    MetricsLogger(str(tmp_path), 5, 2, True).close("finished")
    assert "metrics.jsonl line 3 is cut short" in capsys.readouterr().err
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n{"step": 2, "loss": 1.5}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl line 2 is list"):
        MetricsLogger(str(tmp_path), 5, 2, True)
