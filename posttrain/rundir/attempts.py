"""A run's marker (output_dir/.posttrain-run) and what it records: which command made the run, each attempt (its
process, how it ended), and the files the run wrote. These records decide what a later run may do there: continue it,
take a failed attempt's place, or replace it, and which files may move when it does (only the run's own).

    write_marker(out, {"command": "sft", "attempt": {"pid": ..., "status": "running", ...}})
    takeover_reason(out)          # why a failed attempt may be replaced without a flag, or None
    check_own_files(out, "...")   # before files move: each is the run's own, or UserError naming the one that is not
    record_end(out, error)        # how this attempt ended, and the run's files now

The rules, each with its reason, are in docs/reliability.md ("Output directories: nothing of yours is lost");
posttrain/rundir/claim.py applies them.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Optional

from posttrain.errors import UserError
from posttrain.rundir.resume import UNIVERSAL_DIR

MARKER = ".posttrain-run"
RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "tensorboard", "checkpoints", "final", "final-critic", "report.html",
                 "curves.png", "summary.json", "samples.jsonl", "sample_images", "ref_logprobs.safetensors", "mlflow.db",
                 UNIVERSAL_DIR)
FAILED_DIR = "failed-attempts"  # a failed attempt's files, moved here when the next run takes its place


def read_marker(out: Path) -> dict:
    """The marker's record ({} for a marker from before records, or one that cannot be read)."""
    try:
        record = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def live_attempt(out: Path) -> str:
    """'pid N on HOST' when the marker's attempt is running in a process alive on this host, else ''."""
    attempt = read_marker(out).get("attempt") or {}
    pid = attempt.get("pid")
    if attempt.get("status") != "running" or attempt.get("host") != socket.gethostname() or not isinstance(pid, int):
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except OSError:  # alive, owned by someone else
        pass
    return f"pid {pid} on {attempt['host']}"


def takeover_reason(out: Path) -> Optional[str]:
    """Why the run in `out` may be replaced without a flag, or None. Only a run with nothing to resume or keep (no
    checkpoint, no final/) whose attempt ended in an error, or whose process died before step 1 (a crash, kill -9,
    out of memory): rerunning the same command after fixing the cause is then all a user wants."""
    if any((out / name).exists() for name in ("final", "checkpoints")):
        return None
    attempt = read_marker(out).get("attempt") or {}
    status = attempt.get("status")
    if status in ("failed", "stopped"):
        error = f" ({attempt['error']})" if attempt.get("error") else ""
        return ("ended in an error" if status == "failed" else "was stopped") + error
    if status == "running" and attempt.get("host") == socket.gethostname() and not live_attempt(out):
        from posttrain.rundir.metrics import read_metrics

        if not any(row.get("step", 0) >= 1 for row in read_metrics(out)):
            return f"ended before step 1 (its process, pid {attempt.get('pid')}, is gone)"
    return None


def keep_failed_attempt(out: Path, stamp: str) -> Optional[Path]:
    """Move a failed attempt's own files to failed-attempts/<when it was replaced>/ (None when it left none)."""
    present = [name for name in RUN_ARTIFACTS if os.path.lexists(out / name)]
    if not present:
        return None
    kept = out / FAILED_DIR / stamp.replace(":", "")
    suffix = 0
    while os.path.lexists(kept):  # two takeovers within a second (a link there is never followed)
        suffix += 1
        kept = out / FAILED_DIR / f"{stamp.replace(':', '')}-{suffix}"
    kept.mkdir(parents=True)
    for name in present:
        os.rename(out / name, kept / name)  # a link is moved as a link, never followed
    return kept


def own_files(out: Path) -> dict[str, object]:
    """The run's files present now, as end_attempt records them: a file's mtime (ns), 'dir' for a folder."""
    found = {}
    for name in RUN_ARTIFACTS:
        try:
            info = os.lstat(out / name)
        except OSError:
            continue
        found[name] = "dir" if os.path.isdir(out / name) else info.st_mtime_ns
    return found


TAKEOVER, OVERWRITE = "takeover", "overwrite"
"""check_own_files' two callers: a failed attempt's files move to failed-attempts/; overwrite_output_dir deletes the
run's files."""


def check_own_files(out: Path, action: str = TAKEOVER) -> None:
    """Before a run's files move (a takeover puts a failed attempt's into failed-attempts/, overwrite_output_dir
    deletes them): each is the run's own. One the user put there since (a summary.json of their own, their recipe
    saved over config.yaml) would be moved, then replaced by the new run's: refused, naming it, before anything is
    written. An attempt's end recorded the run's files (record_end; an attempt keeps the record of the one before it);
    an attempt whose process died recorded nothing, so a file it wrote is one no older than its start."""
    record = read_marker(out)
    attempt = record.get("attempt") or {}
    recorded = record.get("files") if isinstance(record.get("files"), dict) else None
    since = None
    if attempt.get("status") == "running" or recorded is None:  # its process died (a live one is refused earlier)
        try:
            since = datetime.datetime.fromisoformat(attempt.get("started")).timestamp() - 1
        except (TypeError, ValueError):
            pass
    if recorded is None and since is None:
        return  # a marker from before attempts were recorded: nothing to tell its files by
    for name, stamp in own_files(out).items():
        mine = stamp == "dir" or (recorded or {}).get(name) == stamp or (since is not None and stamp / 1e9 >= since)
        if mine:
            continue
        when = "older than that run's start" if since is not None else "changed after that run ended"
        if action == TAKEOVER:
            raise UserError(f"output_dir {out}: {name} is not the failed run's own ({when}), and taking the run's "
                            f"place would move it into {FAILED_DIR}/ and write this run's {name}: move it out of "
                            "output_dir (a recipe belongs outside it), or choose another output_dir")
        raise UserError(f"output_dir {out}: {name} is not the run's own ({when}), and train.overwrite_output_dir "
                        f"would delete it with the run's files and write this run's {name}: move it out of "
                        "output_dir (a recipe belongs outside it), or choose another output_dir")


def record_rewritten(out: Path, name: str) -> None:
    """A run's file posttrain wrote again after the run (`posttrain report` redraws report.html): the record of the
    run's files takes its new stamp, so the file stays the run's own (check_own_files)."""
    record = read_marker(out)
    files = record.get("files")
    if isinstance(files, dict) and name in files and name in own_files(out):
        files[name] = own_files(out)[name]
        write_marker(out, record)


def start_attempt(out: Path, command: str, now: str, replaced: bool, taken_over: bool = False) -> None:
    """Record this process's attempt in the marker (status running), keeping the run's earlier record (its command,
    when it was created, the files the attempt before wrote: if this one dies, those are still the run's own) unless
    the run is `replaced` (overwrite_output_dir); `taken_over`: the failed attempt's files were moved away."""
    previous = {} if replaced else read_marker(out)  # a replaced run's marker named the command that wrote it
    if taken_over:
        previous.pop("files", None)  # those moved to failed-attempts/; this attempt records its own when it ends
    record = {"created": now, **previous, "command": command or previous.get("command", ""), "by": "posttrain"}
    record["attempt"] = {"pid": os.getpid(), "host": socket.gethostname(), "started": now, "status": "running"}
    write_marker(out, record)


def write_marker(out: Path, record: dict) -> None:
    """Replace the marker whole (a temporary file renamed), so a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(prefix=MARKER + ".", dir=out)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, out / MARKER)


def record_end(out: Path, error: Optional[BaseException], final_step: Optional[int] = None) -> None:
    record = read_marker(out)
    attempt = record.get("attempt") or {}
    if attempt.get("pid") != os.getpid() or attempt.get("status") != "running":
        return
    from posttrain.errors import RunStopped

    stopped = isinstance(error, (KeyboardInterrupt, RunStopped))
    attempt["status"] = "finished" if error is None else "stopped" if stopped else "failed"
    if error is not None:
        attempt["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    if final_step is not None:
        record["final_step"] = final_step
    record["files"] = own_files(out)  # what the run wrote: only these may move when a later run takes its place
    attempt["ended"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        write_marker(out, record)
    except OSError:  # a full or vanished disk: the run's own error is the news
        pass
