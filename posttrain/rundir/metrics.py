"""What the user sees while a run trains: a progress bar, metrics.jsonl, the trackers of train.report_to
(posttrain/report/trackers.py), and a warning with its fix the first time a row shows the run is not learning
(rundir/health.py). The report drawn from metrics.jsonl at the end is posttrain/report/write.py.

Only rank 0 writes; other ranks get a logger whose methods do nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from tqdm.auto import tqdm

from posttrain.errors import UserError, warn
from posttrain.rundir.health import Health


CONSOLE = ("loss", "grad_norm", "learning_rate")  # then the algorithm's headline metrics, as TRL's console shows


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, start_step: int, enabled: bool, trackers: Sequence = (),
                 headline: Sequence[str] = ()):
        """trackers: posttrain.report.trackers.Tracker objects, already open (rank 0); closed by close(). headline:
        the algorithm's own metrics the console shows beside loss, grad_norm and learning_rate."""
        self.enabled = enabled
        self.console = (*CONSOLE, *headline, "mismatch/k3", "tokens_per_second")  # k3: where an engine samples apart
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers = list(trackers) if enabled else []
        self.bar = None
        self.health = Health()
        if not enabled:
            return
        if self.path.exists():  # a resumed run rewrites history after its checkpoint: never two versions of a step
            kept = [row for row in read_rows(self.path, needs_step=True) if row["step"] <= start_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
            for row in kept:  # what the interrupted run said is not said again
                self.health.observe(row)
        # disable=None: a live bar on a terminal; in a log file (CI, nohup) one plain line per logging step instead
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr,
                        disable=None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        # NaN / inf are not JSON: a non-finite value (a skipped step's loss) is written as null
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        numbers = {k: v for k, v in record.items() if k != "step" and finite(v)}
        for tracker in self.trackers:
            tracker.log(step, numbers)
        for finding in self.health.observe(record):
            self.warn(finding.text())
        if self.bar is not None:
            keys = self.console + tuple(k for k in record if k.startswith("eval/"))
            shown = {k: f"{record[k]:.4g}" for k in keys if isinstance(record.get(k), (int, float))}
            if self.bar.disable:
                print(f"step {step}/{self.bar.total} " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
                return
            self.bar.set_postfix(shown, refresh=False)
            self.bar.n = step
            self.bar.refresh()

    def progress(self, step: int, loss: float) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.n = step
            self.bar.refresh()

    def info(self, message: str) -> None:
        if self.bar is not None and not self.bar.disable:  # a bar exists only where enabled
            self.bar.write(message)
        elif self.enabled:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        """A warning on stderr, above the bar."""
        if self.bar is not None and not self.bar.disable:
            self.bar.write(f"posttrain: warning: {message}", file=sys.stderr)
        elif self.enabled:
            print(f"posttrain: warning: {message}", file=sys.stderr, flush=True)

    def close(self, status: str = "finished") -> None:
        """status (for the trackers): finished, failed or killed. A second call does nothing."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish(status)


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows (none when it has none); UserError naming the line that is not a row."""
    return read_rows(Path(output_dir) / "metrics.jsonl", needs_step=True)


def read_rows(path: Path, needs_step: bool) -> list[dict]:
    """The JSON objects of a run's .jsonl file (metrics.jsonl, samples.jsonl; none when it is absent): the one
    reader of them, for the run resuming, the report, `posttrain doctor RUN_DIR` and the summary. Anyone may have
    edited the file: a line that is not a JSON object (with a whole `step` >= 0 where `needs_step`) is a UserError
    naming the file and line; only the last line may be cut short (a run killed while writing it), and it is left
    out with a warning."""
    if not path.is_file():
        return []
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise UserError(f"{path} line {line} is not UTF-8 text; this is not a file a posttrain run wrote") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            if number == len(lines):  # only the last line can be cut by a kill while writing it
                warn(f"{path} line {number} is cut short (the run was stopped while writing it); it is left out")
                continue
            raise UserError(f"{path} line {number} is not JSON ({e}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number} is {type(row).__name__} {line[:60]!r}, not a JSON object; fix or "
                            "remove that line")
        step = row.get("step")
        if needs_step and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise UserError(f"{path} line {number} has step {step!r:.60}; every row needs a whole step >= 0")
        if "step" in row and not needs_step and (not isinstance(step, int) or isinstance(step, bool)):
            raise UserError(f"{path} line {number} has step {step!r:.60}; it must be a whole number")
        rows.append(row)
    return rows


def finite(value: Any) -> bool:
    """A metric a chart or tracker can take: a finite int or float (not a bool, None or text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
