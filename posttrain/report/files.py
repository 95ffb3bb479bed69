"""What `posttrain report` reads and where it writes, with the user's files treated as hostile input.

    rows = read_rows(run / "metrics.jsonl", needs_step=True)     # rundir/metrics.py: UserError naming the line, or rows
    out = report_path(paths, out_arg)                             # never a page the user wrote, never a non-run

A report is drawn from files anyone may have edited: every line of metrics.jsonl / samples.jsonl is a JSON object
(a metrics row with a whole `step` >= 0), summary.json is an object and config.yaml a mapping, or the report stops
(exit 2) naming the file and line. Only the last line may be cut short (a run killed while writing it): it is left
out with a warning, never silently. The page is written into a run (a directory holding posttrain's marker), to the
path given with --out, or to ./compare.html only when no file of that name exists other than a page this command
wrote before (its generator tag says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import yaml

from posttrain.errors import UserError

GENERATOR = "<meta name='generator' content='posttrain report'>"  # in every page: marks it as ours to redraw


def read_mapping(path: Path, what: str) -> dict:
    """summary.json (what='JSON') or config.yaml (what='YAML') as a dict ({} when absent); UserError naming it."""
    if not path.is_file():
        return {}
    try:
        text = path.read_text()
        loaded = json.loads(text) if what == "JSON" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise UserError(f"{path} is not valid {what} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                        "restore it or move it out of the run directory") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"{path} holds {type(loaded).__name__}, not a mapping; restore it or move it out of the run "
                        "directory")
    return loaded


def report_path(runs: list[Path], out: Optional[str]) -> Path:
    """Where the page goes: --out as given, else RUN/report.html (a run's own directory only) or ./compare.html
    (unless a file there is not a page of ours)."""
    from posttrain.rundir.claim import classify

    if out:
        path = Path(out).expanduser()
        if path.is_dir():
            raise UserError(f"--out {out} is a directory; give a file name such as {path / 'compare.html'}")
        return path
    if len(runs) == 1:
        if classify(runs[0]) != "run":
            raise UserError(f"{runs[0]} is not a posttrain run's output_dir (it has no .posttrain-run), so its "
                            "report.html may be yours: name where the page goes with --out")
        return runs[0] / "report.html"
    path = Path("compare.html")
    if path.is_symlink() or (path.exists() and (not path.is_file() or GENERATOR not in _head(path))):
        raise UserError(f"{path.resolve()} already exists and is not a page posttrain report wrote; name where the "
                        "page goes with --out")
    return path


def _head(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(4096).decode("utf-8", "replace")
