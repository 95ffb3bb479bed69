"""Output directories: a run writes only where nothing of the user's can be lost.

    resume_from = check_output_dir(recipe)        # every rank, before anything is loaded or written
    aside = begin_run(out, overwrite)             # rank 0: the marker; overwrite moves the old run's files aside
    (out / "config.yaml").write_text(...)
    end_overwrite(aside)                          # the old run's files go only once the new config is written
    ...
    end_attempt(out, error)                       # rank 0: how this attempt ended, in the marker

A run that failed before its first checkpoint (or died before step 1) is taken over by the next run without a flag:
nothing of it could be resumed, and its files are kept under failed-attempts/ (docs/reliability.md).

The rules, each with its reason, are in docs/reliability.md ("Output directories: nothing of yours is lost").
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Optional

import yaml

from posttrain.errors import warn
from posttrain.rundir.resume import UNIVERSAL_DIR
from posttrain.errors import UserError

MARKER = ".posttrain-run"
RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "tensorboard", "checkpoints", "final", "final-critic", "report.html",
                 "curves.png", "summary.json", "samples.jsonl", "sample_images", "ref_logprobs.safetensors", "mlflow.db",
                 UNIVERSAL_DIR)
ASIDE_PREFIX = ".posttrain-replaced-"  # overwrite_output_dir: the old run's files until the new run is set up
RECIPE_SECTIONS = ("output_dir", "model", "data", "train")  # what every config.yaml a run wrote holds
FAILED_DIR = "failed-attempts"  # a failed attempt's files, moved here when the next run takes its place
RAY_SESSION_DIR = "ray"  # the session (logs, sockets) of a Ray cluster the launcher started for the run


def launcher_dirs() -> tuple[str, ...]:
    """The folders the Ray launcher writes before the run itself starts: its generation engines' logs and the
    session of a cluster it started for the run."""
    from posttrain.generation.server_process import LOG_DIR

    return LOG_DIR, RAY_SESSION_DIR


def check_output_dir(recipe, command: str = "") -> Optional[Path]:
    """Refuse any output_dir a run could lose the user's files in. Returns the checkpoint to resume from, if any.
    command: this run's (sft, dpo, ...); a run of another command is never continued (see check_same_command)."""
    from posttrain.rundir.checkpoint import resolve_resume

    out = Path(recipe.output_dir)  # as run.py writes it (load_recipe expanded a leading ~)
    t = recipe.train
    refuse_special(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {out} is a file; choose a directory")
    check_writable(out)
    kind = classify(out)
    if kind == "foreign":
        shown = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise UserError(f"output_dir {out} is not empty ({shown}) and no posttrain run made it (it has no {MARKER}); "
                        "a run writes only into an empty directory or its own: choose another output_dir")
    refuse_links(out)
    if kind == "run" and not t.overwrite_output_dir and takeover_reason(out) is not None:
        check_own_files(out)  # a takeover moves them into failed-attempts/
    for left in sorted(out.glob(ASIDE_PREFIX + "*")) if out.is_dir() else ():
        warn(f"{left} holds the files of a run that overwrite_output_dir was replacing when it stopped; nothing "
             "removes it: move back what you need, then delete it")
    if kind == "run" and not t.overwrite_output_dir:
        check_same_command(out, command, "output_dir")
    if t.resume_from_checkpoint not in (None, "auto") and not t.overwrite_output_dir:
        check_same_command(Path(t.resume_from_checkpoint).parent.parent, command, "train.resume_from_checkpoint")
    resume = resolve_resume(str(out), t.resume_from_checkpoint, strict=t.resume_strict)
    if kind == "run" and t.resume_from_checkpoint is not None and not t.overwrite_output_dir:
        check_not_behind(out, resume, t.max_steps)
    if resume is not None or t.overwrite_output_dir or t.resume_from_checkpoint == "auto":
        return resume  # auto and no checkpoint yet (a run stopped before its first save): the run starts
    # config.yaml alone (or with an empty log): that run never trained; the Ray launcher's folders: it wrote them
    # first; a failed attempt (takeover_reason) is replaced by the next run
    if kind == "run" and not never_trained(out) and takeover_reason(out) is None:
        live = live_attempt(out)
        if live:
            raise UserError(f"output_dir {out} is in use by a run still going ({live}); wait for it, stop it, or "
                            "choose another output_dir")
        raise UserError(f"output_dir {out} already holds a run (config.yaml); pass train.resume_from_checkpoint=auto "
                        "to continue it, train.overwrite_output_dir=true to replace it, or choose another output_dir")
    return None


def check_not_behind(out: Path, resume: Optional[Path], max_steps: int = -1) -> None:
    """Resuming a run whose final/ holds step S (the marker records it) from behind S. With no checkpoint at all
    (train.save_final_checkpoint off) `auto` started the run from scratch over final/ and metrics.jsonl with exit 0,
    and a max_steps below S put an older model into final/: both refused. From an older checkpoint (the newest one was
    damaged) the steps after it are trained again, as exactly as before: said once. A run stopped before its end
    (max_steps_per_run, a signal, a failure) has no newer final/ and is continued as usual."""
    from posttrain.rundir.checkpoint import read_trainer_state

    final_step = read_marker(out).get("final_step")
    if type(final_step) is not int or not (out / "final").exists():
        return
    try:
        resumed = int(read_trainer_state(resume)["state"]["step"]) if resume else 0
    except (OSError, ValueError, KeyError, TypeError):
        return  # resolve_resume checked what it needs; a checkpoint without a step is not compared
    if final_step <= resumed:
        return
    fix = (f"To train on from its model, start another output_dir with model.name_or_path={out / 'final'}; "
           "train.overwrite_output_dir=true replaces the run")
    if resume is None:
        raise UserError(f"train.resume_from_checkpoint: the run in {out} finished at step {final_step} (final/) but "
                        "saved no checkpoint (train.save_final_checkpoint was off), so there is nothing to resume: the "
                        f"run would start from step 0 over its final/ and metrics.jsonl. {fix}; "
                        "train.save_final_checkpoint=true keeps a run extensible")
    if 0 < max_steps < final_step:
        raise UserError(f"train.max_steps={max_steps}: the run in {out} already finished at step {final_step} "
                        f"(final/); resuming from step {resumed} would replace final/ with the model of step "
                        f"{max_steps}. {fix}")
    warn(f"resuming {out} from step {resumed}, behind its final/ (step {final_step}): steps {resumed + 1}-{final_step} "
         "are trained again and final/ is replaced at the end")


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


def check_same_command(run: Path, command: str, key: str) -> None:
    """A run of another algorithm is not continued: its checkpoint holds another model head and optimiser, its
    metrics.jsonl other columns, and final/ would be replaced by this command's. The marker records the command."""
    recorded = read_marker(run).get("command")  # an unreadable marker still marks a run; it cannot tell the command
    if command and recorded and recorded != command:
        raise UserError(f"{key}: {run} holds a `posttrain {recorded}` run, and this is `posttrain {command}`; a run "
                        f"continues only with its own command. Start the {command} run in another output_dir (with "
                        f"model.name_or_path={run / 'final'} to train on from that run's model)")


def never_trained(out: Path) -> bool:
    """What a run leaves that stopped before its first step (its model did not load, an input error found once it
    had started): config.yaml, the marker, the Ray launcher's folders, and at most an empty metrics.jsonl and tensorboard/."""
    for p in out.iterdir():
        if p.name in ("config.yaml", MARKER, *launcher_dirs(), "tensorboard", FAILED_DIR):
            continue
        if p.name == "metrics.jsonl" and p.is_file() and not p.is_symlink() and p.stat().st_size == 0:
            continue
        return False
    return True


_started: list[Path] = []  # begin_run's output_dir in this process: from then on the run has written


def run_started() -> Optional[Path]:
    """The output_dir a run of this process has written into (exit 2 promises nothing was written), or None."""
    return _started[-1] if _started else None


def forget_started() -> None:
    """A new command starts (the CLI's main, called many times in one test process)."""
    _started.clear()


def refuse_special(out: Path) -> None:
    """`/`, the home directory and the working directory: a run's files would mix with everything there."""
    where = out.resolve()
    special = {Path("/").resolve(): "the root directory", Path.home().resolve(): "your home directory",
               Path.cwd().resolve(): "the working directory"}
    if where in special:
        raise UserError(f"output_dir {out} is {special[where]}; a run needs a directory of its own, e.g. "
                        "output_dir=runs/my-run")


def check_writable(out: Path) -> None:
    """output_dir (or the nearest folder above it that exists) must take new files; probed with a temporary file."""
    probe_in = next(p for p in (out, *out.parents) if p.exists())
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(f"{probe_in} is a file")
        fd, name = tempfile.mkstemp(prefix=".posttrain-probe-", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UserError(f"output_dir {out}: cannot write in {probe_in} ({e.strerror or e}); choose a writable "
                        "output_dir or fix its permissions") from None


def classify(out: Path) -> str:
    """new (absent or empty, or only the Ray launcher's folders), run (the marker, or a run from before the marker), or
    foreign (anything else: nothing there may be touched)."""
    if not out.is_dir():
        return "new"
    names = {p.name for p in out.iterdir()}
    if not names - set(launcher_dirs()):
        return "new"
    return "run" if MARKER in names or is_unmarked_run(out) else "foreign"


def is_unmarked_run(out: Path) -> bool:
    """A run written before the marker existed: its config.yaml is a posttrain recipe dump, beside another of a run's
    files (a recipe alone is the user's own, kept in the folder they mean to run into: never taken for a run)."""
    if not any(os.path.lexists(out / name) for name in RUN_ARTIFACTS if name != "config.yaml"):
        return False
    config = out / "config.yaml"
    if not config.is_file() or config.is_symlink() or config.stat().st_size > 2**20:
        return False
    try:
        loaded = yaml.safe_load(config.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(loaded, dict) and all(key in loaded for key in RECIPE_SECTIONS)


def refuse_links(out: Path) -> None:
    """A run replaces its own entries (final/, checkpoints/step-N/); through a link it would replace what the link
    points to."""
    if not out.is_dir():
        return
    entries = [out / name for name in (*RUN_ARTIFACTS, FAILED_DIR, *launcher_dirs())]
    if (out / "checkpoints").is_dir() and not (out / "checkpoints").is_symlink():
        entries += sorted((out / "checkpoints").iterdir())
    for entry in entries:
        if entry.is_symlink():
            raise UserError(f"output_dir: {entry} is a symbolic link (to {os.readlink(entry)}); a run writes only "
                            "its own files and never through a link: remove the link or choose another output_dir")


def begin_run(out: Path, overwrite: bool, command: str = "") -> Optional[Path]:
    """Rank 0, once the checks passed: create output_dir, write the marker with this attempt, and with overwrite
    move the previous run's own files into a folder inside output_dir (returned; pass it to end_overwrite once
    config.yaml is new). A failed attempt taken over (takeover_reason) has its files moved to failed-attempts/."""
    out.mkdir(parents=True, exist_ok=True)
    claim(out)
    _started.append(out)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    reason = None if overwrite or not (out / MARKER).exists() else takeover_reason(out)
    if reason is not None:
        kept = keep_failed_attempt(out, now)
        warn(f"output_dir {out}: the previous run there {reason}, before any checkpoint; this run takes its place"
             + (f" (its files are in {kept})" if kept else ""))
    previous = {} if overwrite else read_marker(out)  # a replaced run's marker named the command that wrote it
    previous.pop("files", None)  # the previous attempt's; this one records its own when it ends
    record = {"created": now, **previous, "command": command or previous.get("command", ""), "by": "posttrain"}
    record["attempt"] = {"pid": os.getpid(), "host": socket.gethostname(), "started": now, "status": "running"}
    write_marker(out, record)
    present = [name for name in RUN_ARTIFACTS if os.path.lexists(out / name)] if overwrite else []
    if not present:
        return None
    aside = Path(tempfile.mkdtemp(prefix=ASIDE_PREFIX, dir=out))
    moved = []
    try:
        for name in present:
            os.rename(out / name, aside / name)  # a link is moved as a link, never followed
            moved.append(name)
    except OSError:
        for name in moved:  # put back what moved: the old run stays as it was
            os.rename(aside / name, out / name)
        aside.rmdir()
        raise
    return aside


_claimed: dict[Path, int] = {}  # output_dir -> this process's open descriptor of it, locked while its run goes


def claim(out: Path) -> None:
    """Lock output_dir for this process's run (flock on the directory; released by end_attempt, or by the kernel when
    the process ends however it ends). Two runs started into one directory at the same moment both passed
    check_output_dir and both trained into it (two sets of metrics rows, one final/ over the other, exit 0 twice);
    the second is refused here, before it writes anything. A filesystem without flock is not locked."""
    if out in _claimed:
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"output_dir {out} is in use by a run still going ({live_attempt(out) or 'another process'}"
                        "); wait for it, stop it, or choose another output_dir") from None
    except OSError:  # no locks there (some network filesystems): check_output_dir's marker check is all there is
        pass
    _claimed[out] = fd


def release(out: Path) -> None:
    fd = _claimed.pop(out, None)
    if fd is not None:
        os.close(fd)


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


def check_own_files(out: Path) -> None:
    """Before a takeover moves a failed attempt's files into failed-attempts/: each is the attempt's own. One the
    user put there since (a summary.json of their own, their recipe saved over config.yaml) would be moved, and then
    replaced by the new run's: refused, naming it. The attempt's end recorded its files (end_attempt); an attempt
    whose process died recorded nothing, so its files must be no older than its start."""
    record = read_marker(out)
    recorded = record.get("files")
    started = (record.get("attempt") or {}).get("started")
    now = own_files(out)
    for name, stamp in now.items():
        if isinstance(recorded, dict):
            mine = name in recorded and (stamp == "dir" or recorded[name] == stamp)
        else:
            try:
                since = datetime.datetime.fromisoformat(started).timestamp() - 1
            except (TypeError, ValueError):
                return  # a marker from before attempts were recorded: nothing to tell its files by
            mine = stamp == "dir" or stamp / 1e9 >= since
        if not mine:
            when = "changed after that run ended" if isinstance(recorded, dict) else "older than that run's start"
            raise UserError(f"output_dir {out}: {name} is not the failed run's own ({when}), and taking the run's "
                            f"place would move it into {FAILED_DIR}/ and "
                            f"write this run's {name}: move it out of output_dir (a recipe belongs outside it), or "
                            "choose another output_dir")


def write_marker(out: Path, record: dict) -> None:
    """Replace the marker whole (a temporary file renamed), so a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(prefix=MARKER + ".", dir=out)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, out / MARKER)


def end_attempt(out: Path, error: Optional[BaseException] = None, final_step: Optional[int] = None) -> None:
    """Record how this process's attempt ended: finished, stopped (a signal, Ctrl-C) or failed (with the error's
    first line), and the step final/ holds when it wrote one (check_not_behind). Only the process that began it
    writes (rank 0; never a run that refused to start)."""
    try:
        record_end(out, error, final_step)
    finally:
        release(out)


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


def end_overwrite(aside: Optional[Path]) -> None:
    """The new run is set up: the old run's files moved aside by begin_run go."""
    if aside is not None:
        shutil.rmtree(aside)
