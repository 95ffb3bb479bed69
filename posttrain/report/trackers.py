"""Experiment trackers (`train.report_to`): TensorBoard, Weights & Biases, MLflow and trackio, each through its own
library and imported only when named. Rank 0 opens them; `posttrain.rundir.metrics.MetricsLogger` hands each one every row
it writes to metrics.jsonl.

    train:
      report_to: [tensorboard, wandb]   # any of tensorboard, wandb, mlflow, trackio; none for none
      run_name: qwen-sft                # default: the output_dir's folder name
      project: my-project               # W&B project, MLflow experiment, trackio project

What each one gets, when, and where it writes: docs/tracking.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from posttrain.config.load import to_dict
from posttrain.errors import RunStopped, UserError


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker is told once, when it opens."""

    output_dir: Path
    name: str
    project: Optional[str]
    config: dict
    start_step: int


class Tracker:
    """One experiment tracker. log() never raises: a tracker that fails warns once and the run goes on."""

    name = ""
    project_env = ""  # the tracker's own environment variable for the project, honoured when train.project is unset
    warned = False  # set on the instance by its first failed log()

    def __init__(self, run: TrackedRun):
        """Open the tracker for `run` (each tracker's own)."""

    def project(self, run: TrackedRun) -> str:
        return run.project or os.environ.get(self.project_env) or "posttrain"

    def write(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, status: str) -> None:
        """status: finished, failed or killed."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        try:
            self.write(step, metrics)
        except Exception as e:
            if not self.warned:
                print(f"posttrain: warning: {self.name} could not log step {step} ({type(e).__name__}: {e}); the "
                      "run goes on and metrics.jsonl has every row", file=sys.stderr, flush=True)
            self.warned = True


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run overwrites the events logged after its checkpoint instead of drawing them twice
        self.writer = SummaryWriter(log_dir=str(run.output_dir / "tensorboard"), purge_step=run.start_step + 1)
        config = json.dumps(run.config, indent=2, default=str)
        self.writer.add_text("run", f"**{run.name}**\n\n```\n{config}\n```", run.start_step)

    def write(self, step, metrics):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, status):
        self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"
    project_env = "WANDB_PROJECT"

    def __init__(self, run: TrackedRun):
        import wandb

        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(run.output_dir)}
        self.run = wandb.init(project=self.project(run), name=run.name, config=run.config, **where)

    def write(self, step, metrics):
        self.run.log(metrics, step=step)

    def finish(self, status):
        self.run.finish(exit_code=0 if status == "finished" else 1)


def tracking_uri(output_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, else a store inside the run directory: MLflow's own default (sqlite:///mlflow.db) is
    relative to the working directory, so every run started there would write one shared file outside its run."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


class MLflowTracker(Tracker):
    """Through MlflowClient rather than mlflow's fluent API: no process-global active run to collide with."""

    name = "mlflow"
    project_env = "MLFLOW_EXPERIMENT_NAME"

    def __init__(self, run: TrackedRun):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri(run.output_dir))
        experiment = self.client.get_experiment_by_name(self.project(run))
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.project(run))
        self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flatten(run.config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def write(self, step, metrics):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, status):
        self.client.set_terminated(self.run_id, status.upper())  # MLflow's RunStatus: FINISHED, FAILED, KILLED


class TrackioTracker(Tracker):
    name = "trackio"
    project_env = "TRACKIO_PROJECT"

    def __init__(self, run: TrackedRun):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=self.project(run), name=run.name, config=run.config)

    def write(self, step, metrics):
        self.run.log(metrics, step=step)

    def finish(self, status):
        self.trackio.finish()


TRACKERS = {t.name: t for t in (TensorBoardTracker, WandbTracker, MLflowTracker, TrackioTracker)}
START_HINTS = {"wandb": "log in with `wandb login` or WANDB_API_KEY, or set WANDB_MODE=offline to sync later",
               "mlflow": "check MLFLOW_TRACKING_URI (a server URL, or sqlite:///path/mlflow.db)",
               "trackio": "check TRACKIO_DIR / TRACKIO_SPACE_ID",
               "tensorboard": "check that output_dir/tensorboard can be written"}


def open_trackers(names: tuple[str, ...], run: TrackedRun) -> list[Tracker]:
    """Open the named trackers (config validation already checked that each is installed); a tracker that cannot
    start stops the run, naming it, after closing the ones already open."""
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(TRACKERS[name](run))
        except Exception as e:
            for tracker in opened:
                tracker.finish("failed")
            raise UserError(f"train.report_to: {name} could not start ({type(e).__name__}: {e}); "
                            f"{START_HINTS[name]}, or drop {name} from train.report_to") from e
    return opened


def tracked_run(recipe, command: str, start_step: int, facts: dict[str, Any]) -> TrackedRun:
    """The run as trackers see it: name, project, and the resolved recipe with the command and the run's facts."""
    out = Path(recipe.output_dir)
    config = {"command": command, **to_dict(recipe), "facts": {k: v for k, v in facts.items() if v is not None}}
    return TrackedRun(output_dir=out, name=recipe.train.run_name or out.resolve().name,
                      project=recipe.train.project, config=config, start_step=start_step)


def closing_status(error: BaseException) -> str:
    """How a tracker records a run that raised: killed when stopped on purpose (a signal), else failed."""
    stopped = isinstance(error, KeyboardInterrupt) or (isinstance(error, RunStopped) and error.exit_code != 1)
    return "killed" if stopped else "failed"


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"learning_rate": 1e-4}} -> {"train.learning_rate": 1e-4}; lists as JSON (MLflow params are flat)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value, default=str) if isinstance(value, (list, tuple, dict)) else value
    return flat
