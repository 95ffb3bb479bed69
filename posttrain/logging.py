"""What the user sees: a progress bar, metrics.jsonl, TensorBoard events and report.html with the curves.

Only rank 0 writes; other ranks get a logger whose methods do nothing.
"""

from __future__ import annotations

import html
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from tqdm.auto import tqdm


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, start_step: int, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        self.bar = None
        if not enabled:
            return
        self._truncate_after(start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)
        # disable=None: a live bar on a terminal; in a log file (CI, nohup) one plain line per logging step instead
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr,
                        disable=None)

    def _truncate_after(self, step: int) -> None:
        """A resumed run rewrites history after its checkpoint, so the file never holds two versions of a step."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line, row in zip(lines, map(_parse, lines)) if row is not None and row.get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        # NaN / inf are not JSON: a non-finite value (a skipped step's loss) is written as null
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.bar is not None:
            keys = ("loss", "reward/mean", "learning_rate", "tokens_per_second") + tuple(k for k in record if k.startswith("eval/"))
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
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for row in map(_parse, path.read_text().splitlines()) if row is not None]


def _parse(line: str) -> Optional[dict[str, Any]]:
    """One metrics row, or None for a blank line or one a kill cut short (only the last line can be)."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def eval_endpoints(rows: list[dict[str, Any]]) -> list[tuple[str, tuple[int, float], tuple[int, float]]]:
    """(metric, (step, value) at its first evaluation, (step, value) at its last) for every eval/ metric: with an
    evaluation at step 0 the first is the starting model's."""
    out = []
    for key in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            out.append((key, points[0], points[-1]))
    return out


def write_report(output_dir: str | Path, title: str, extra: Optional[dict[str, Any]] = None) -> Path:
    """report.html + curves.png: every numeric metric against step, plus a table of `extra` facts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    rows = read_metrics(output_dir)
    keys = sorted({k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))})
    keys = [k for k in keys if k not in ("num_tokens",)]
    cols = 3
    nrows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if key in r and isinstance(r[key], (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(output_dir / "curves.png", dpi=80)
    plt.close(fig)
    facts = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in (extra or {}).items()
    )
    evals = "".join(
        f"<tr><th>{html.escape(key)}</th><td>{first:.4g} (step {s0})</td><td>{last:.4g} (step {s1})</td></tr>"
        for key, (s0, first), (s1, last) in eval_endpoints(rows)
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><table>{facts}</table>"
        + (f"<h2>Held-out evaluation</h2><table><tr><th>metric</th><th>first</th><th>last</th></tr>{evals}</table>"
           if evals else "")
        + f"<img src='curves.png' alt='training curves'><p>{len(rows)} logged rows in metrics.jsonl</p></body></html>"
    )
    report = output_dir / "report.html"
    report.write_text(page)
    return report
