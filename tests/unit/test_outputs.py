"""Output directories (issue #25): a run writes only into an empty directory or its own, never loses the user's
files, and overwrite_output_dir replaces only the run's own files, leaving the old run whole if it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.rundir import attempts, claim as outputs, files as checkpoint_files
from posttrain.config.load import load_recipe
from posttrain.config.schema import SFTAlgoConfig
from posttrain.errors import UserError


def recipe(out, *extra):
    return load_recipe(None, [f"output_dir={out}", "data.train=x.jsonl", *extra], SFTAlgoConfig)


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under root: file bytes, link targets, directories."""
    found = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        found[key] = ("link:" + os.readlink(p)) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return found


def user_dir(tmp_path) -> Path:
    out = tmp_path / "mine"
    (out / "final").mkdir(parents=True)
    (out / "final" / "README_MINE.md").write_text("my notes")
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    (out / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    return out


@pytest.mark.parametrize("flags", [[], ["train.resume_from_checkpoint=auto"], ["train.overwrite_output_dir=true"]])
def test_a_directory_no_run_made_is_refused_whatever_the_flags(tmp_path, flags):
    out = user_dir(tmp_path)
    before = snapshot(out)
    with pytest.raises(UserError, match=r"no posttrain run made it \(it has no \.posttrain-run\)"):
        outputs.check_output_dir(recipe(out, *flags))
    assert snapshot(out) == before


@pytest.mark.parametrize("where", ["/", str(Path.home()), ".", os.getcwd()])
@pytest.mark.parametrize("flags", [[], ["train.resume_from_checkpoint=auto"], ["train.overwrite_output_dir=true"]])
def test_root_home_and_working_directory_are_refused(where, flags):
    with pytest.raises(UserError, match="a run needs a directory of its own"):
        outputs.check_output_dir(recipe(where, *flags))


def test_a_new_or_empty_directory_starts(tmp_path):
    assert outputs.check_output_dir(recipe(tmp_path / "new")) is None
    (tmp_path / "empty").mkdir()
    assert outputs.check_output_dir(recipe(tmp_path / "empty")) is None


def test_a_run_directory_needs_auto_or_overwrite(tmp_path):
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False, command="sft")
    (out / "config.yaml").write_text("x")
    assert outputs.check_output_dir(recipe(out)) is None  # config.yaml alone: that run never trained
    (out / "metrics.jsonl").write_text("{}\n")
    outputs.end_attempt(out)  # it finished
    with pytest.raises(UserError, match="already holds a run"):
        outputs.check_output_dir(recipe(out))
    assert outputs.check_output_dir(recipe(out, "train.resume_from_checkpoint=auto")) is None
    assert outputs.check_output_dir(recipe(out, "train.overwrite_output_dir=true")) is None


def test_a_run_from_before_the_marker_is_recognised_by_its_config(tmp_path):
    out = tmp_path / "old-run"
    out.mkdir()
    (out / "config.yaml").write_text("output_dir: old-run\nseed: 1\nmodel: {}\ndata: {}\ntrain: {}\n")
    (out / "metrics.jsonl").write_text("{}\n")
    assert outputs.classify(out) == "run"
    assert outputs.check_output_dir(recipe(out, "train.resume_from_checkpoint=auto")) is None
    (out / "config.yaml").write_text("something: else\n")  # another tool's config
    assert outputs.classify(out) == "foreign"


def test_a_linked_final_is_refused_and_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False)
    (out / "config.yaml").write_text("x")
    (out / "final").symlink_to(elsewhere)
    before = snapshot(tmp_path)
    for flags in ([], ["train.overwrite_output_dir=true"], ["train.resume_from_checkpoint=auto"]):
        with pytest.raises(UserError, match="is a symbolic link"):
            outputs.check_output_dir(recipe(out, *flags))
    assert snapshot(tmp_path) == before
    with pytest.raises(UserError, match="symbolic link"):
        checkpoint_files.replace_dir(tmp_path / "new", out / "final")
    assert snapshot(tmp_path) == before


def test_overwrite_moves_only_the_runs_files_and_removes_them_after_the_new_config(tmp_path):
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False)
    (out / "config.yaml").write_text("old")
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "notes.txt").write_text("mine")
    aside = outputs.begin_run(out, overwrite=True)
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "config.yaml", "final"]
    assert (aside / "config.yaml").read_text() == "old"  # a failure here leaves the old run whole, inside out/
    (out / "config.yaml").write_text("new")
    outputs.end_overwrite(aside)
    assert sorted(p.name for p in out.iterdir()) == [".posttrain-run", "config.yaml", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_that_fails_midway_puts_everything_back(tmp_path, monkeypatch):
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False)
    for name in ("config.yaml", "metrics.jsonl", "report.html"):
        (out / name).write_text(name)
    before = snapshot(out)
    rename = os.rename

    def failing(src, dst):
        if Path(src).name == "report.html":
            raise OSError(5, "I/O error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError):
        outputs.begin_run(out, overwrite=True)
    assert snapshot(out) == before


def test_replace_dir_swaps_a_complete_directory_in(tmp_path):
    final, tmp = tmp_path / "final", tmp_path / ".tmp-final"
    final.mkdir()
    (final / "a").write_text("old")
    tmp.mkdir()
    (tmp / "a").write_text("new")
    checkpoint_files.replace_dir(tmp, final)
    assert (final / "a").read_text() == "new" and not tmp.exists() and not (tmp_path / ".old-final").exists()


def failed_run(tmp_path, error: BaseException | None = ValueError("reward 'acc' raised\nTraceback ...")) -> Path:
    """What a run that failed at step 0 leaves: the marker, config.yaml, metrics (eval at step 0), tensorboard."""
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False, command="grpo")
    (out / "config.yaml").write_text("x")
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/reward": 0.1}\n')
    (out / "tensorboard").mkdir()
    (out / "notes.txt").write_text("mine")
    outputs.end_attempt(out, error)
    return out


def test_a_run_that_failed_before_any_checkpoint_is_taken_over_and_its_files_kept(tmp_path, capsys):
    out = failed_run(tmp_path)
    assert outputs.check_output_dir(recipe(out)) is None
    outputs.begin_run(out, overwrite=False, command="grpo")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ended in an error (ValueError: reward 'acc' raised)" in err, err
    kept = next((out / attempts.FAILED_DIR).iterdir())
    assert str(kept) in err
    assert (kept / "metrics.jsonl").read_text() == '{"step": 0, "eval/reward": 0.1}\n'
    assert sorted(p.name for p in kept.iterdir()) == ["config.yaml", "metrics.jsonl", "tensorboard"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "metrics.jsonl").exists()
    assert attempts.read_marker(out)["attempt"]["status"] == "running"
    outputs.end_attempt(out, KeyboardInterrupt())  # stopped before anything was saved: taken over again
    outputs.begin_run(out, overwrite=False, command="grpo")
    assert "was stopped" in capsys.readouterr().err
    assert len(list((out / attempts.FAILED_DIR).iterdir())) == 1  # that attempt left no run files to keep


@pytest.mark.parametrize("saved", ["checkpoints/step-2", "final"])
def test_a_failed_run_with_a_checkpoint_or_final_still_needs_a_flag(tmp_path, saved):
    out = failed_run(tmp_path)
    (out / saved).mkdir(parents=True)
    with pytest.raises(UserError, match="already holds a run.*resume_from_checkpoint=auto"):
        outputs.check_output_dir(recipe(out))


def test_a_run_whose_process_died_is_taken_over_only_before_step_1(tmp_path):
    import subprocess
    import sys

    out = failed_run(tmp_path)
    record = attempts.read_marker(out)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record["attempt"] = {**record["attempt"], "status": "running", "pid": int(gone.stdout)}  # killed -9
    attempts.write_marker(out, record)
    assert attempts.takeover_reason(out).startswith("ended before step 1")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(UserError, match="already holds a run"):
        outputs.check_output_dir(recipe(out))
    record["attempt"]["pid"] = os.getpid()  # the attempt is still going: never taken over
    attempts.write_marker(out, record)
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=f"in use by a run still going \\(pid {os.getpid()}"):
        outputs.check_output_dir(recipe(out))


def test_the_continue_command_drops_overwrite_and_runs_as_printed(tmp_path):
    import shlex

    from posttrain.cli import continue_command
    from posttrain.config.trl_flags import split_trl_flags

    given = ["sft", "--config", "r.yaml", "--overwrite_output_dir", "--learning_rate", "1e-4", "train.max_steps=3",
             "train.resume_from_checkpoint=null"]
    assert continue_command(given, overwrite=True) == ("posttrain sft --config r.yaml train.max_steps=3 "
                                                       "--learning_rate 1e-4 train.resume_from_checkpoint=auto")
    rewards = ["grpo", "--reward_funcs", "r.py:a", "--reward_funcs", "b", "--eval_strategy", "no",
               "--no_remove_unused_columns"]
    assert continue_command(rewards, overwrite=False) == ("posttrain grpo --reward_funcs r.py:a b --eval_strategy no "
                                                          "--remove_unused_columns false train.resume_from_checkpoint=auto")
    config = tmp_path / "r.yaml"  # overwrite set by the recipe file (the demo's saved config.yaml does that)
    config.write_text(f"output_dir: {tmp_path / 'run'}\ndata:\n  train: x.jsonl\ntrain:\n  overwrite_output_dir: true\n")
    printed = continue_command(["sft", "--config", str(config)], overwrite=True)
    assert printed.endswith("train.resume_from_checkpoint=auto train.overwrite_output_dir=false")
    rest, flags = split_trl_flags(shlex.split(printed)[1:])
    resumed = load_recipe(str(config), rest[3:], SFTAlgoConfig)  # no conflict: it loads
    assert resumed.train.resume_from_checkpoint == "auto" and not resumed.train.overwrite_output_dir


def test_a_checkpoint_of_another_commands_run_is_not_continued_and_overwrite_renames_the_command(tmp_path):
    sft_run = tmp_path / "sft"
    (sft_run / "checkpoints" / "step-2").mkdir(parents=True)
    outputs.begin_run(sft_run, overwrite=False, command="sft")
    step = sft_run / "checkpoints" / "step-2"
    with pytest.raises(UserError, match=r"train.resume_from_checkpoint: .*sft holds a `posttrain sft` run, and this "
                                        r"is `posttrain dpo`"):
        outputs.check_output_dir(recipe(tmp_path / "dpo", f"train.resume_from_checkpoint={step}"), "dpo")
    with pytest.raises(UserError, match="output_dir: .* holds a `posttrain sft` run"):
        outputs.check_output_dir(recipe(sft_run, "train.resume_from_checkpoint=auto"), "dpo")
    outputs.end_overwrite(outputs.begin_run(sft_run, overwrite=True, command="dpo"))  # replaced: now a dpo run
    assert '"command": "dpo"' in (sft_run / attempts.MARKER).read_text()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_second_run_started_into_the_same_directory_at_once_is_refused(tmp_path, overwrite):
    """Two runs started together both passed check_output_dir and both trained into one directory, exit 0 twice
    (metrics rows twice, one final/ over the other). The first to begin holds output_dir until its attempt ends
    (a flock on the directory, which the kernel drops with the process however it ends)."""
    import fcntl
    import subprocess
    import sys

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
                               "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the other run, between its check and its marker
        with pytest.raises(UserError, match=f"output_dir {out} is in use by a run still going"):
            outputs.begin_run(out, overwrite=overwrite, command="sft")
        assert list(out.iterdir()) == [] and outputs.run_started() != out  # refused before writing: exit 2
    finally:
        holder.kill()
        holder.wait()
    outputs.begin_run(out, overwrite=overwrite, command="sft")  # its process gone: the directory is free
    other = os.open(out, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # held by this run now
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        outputs.end_attempt(out)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the attempt ended
    finally:
        os.close(other)


def test_a_folder_holding_only_the_users_recipe_is_not_taken_for_a_run(tmp_path):
    """The user's own recipe (every section of one) in the folder they mean to run into: no marker, nothing else of a
    run's: refused as theirs, not overwritten (comments and all)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("# my recipe\noutput_dir: mine\nmodel: {}\ndata: {}\ntrain: {}\n")
    before = snapshot(out)
    assert outputs.classify(out) == "foreign"
    for flags in ([], ["train.resume_from_checkpoint=auto"], ["train.overwrite_output_dir=true"]):
        with pytest.raises(UserError, match="no posttrain run made it"):
            outputs.check_output_dir(recipe(out, *flags))
    assert snapshot(out) == before


def test_a_linked_failed_attempts_folder_is_refused_and_nothing_moves_outside(tmp_path):
    out = failed_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / attempts.FAILED_DIR).symlink_to(elsewhere)
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="failed-attempts is a symbolic link"):
        outputs.check_output_dir(recipe(out))
    assert snapshot(tmp_path) == before and not list(elsewhere.iterdir())


@pytest.mark.parametrize("name", ["summary.json", "config.yaml"])
def test_a_users_file_named_like_a_run_file_is_never_moved_by_a_takeover(tmp_path, name):
    """After the failure the user adds a summary.json of theirs, or saves their recipe over config.yaml: the next
    run would move it into failed-attempts/ and write its own; refused, naming it, nothing moved."""
    out = failed_run(tmp_path)
    os.utime(out / "config.yaml", ns=(1, 1))  # written well before: only a changed stamp tells
    record = attempts.read_marker(out)
    record["files"]["config.yaml"] = 1
    attempts.write_marker(out, record)
    (out / name).write_text("mine")
    before = snapshot(out)
    with pytest.raises(UserError, match=f"{name} is not the failed run's own"):
        outputs.check_output_dir(recipe(out))
    assert snapshot(out) == before


def test_a_takeover_after_a_crash_moves_only_files_written_since_the_attempt_began(tmp_path):
    out = failed_run(tmp_path)
    record = attempts.read_marker(out)
    del record["files"]  # killed -9: its end was never recorded
    attempts.write_marker(out, record)
    os.utime(out / "metrics.jsonl", (0, 0))  # a file from long before the attempt: not its own
    with pytest.raises(UserError, match="metrics.jsonl is not the failed run's own"):
        outputs.check_output_dir(recipe(out))
    os.utime(out / "metrics.jsonl")
    assert outputs.check_output_dir(recipe(out)) is None


def finished_run(tmp_path) -> Path:
    """What a run that finished leaves (as far as the checks read it): the marker, with the files its end recorded."""
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False, command="sft")
    texts = {"config.yaml": "output_dir: run\n", "metrics.jsonl": "", "summary.json": '{"command": "sft"}\n',
             "report.html": "<html>the run's</html>"}
    for name, text in texts.items():
        (out / name).write_text(text)
    (out / "final").mkdir()
    outputs.end_attempt(out, final_step=3)
    return out


@pytest.mark.parametrize("name", ["summary.json", "config.yaml", "report.html"])
def test_overwrite_refuses_a_users_file_named_like_a_run_file_and_moves_nothing(tmp_path, name):
    """After the run the user saves their recipe over config.yaml, or a summary.json / report.html of theirs:
    overwrite_output_dir deleted it with the run's files. Refused, naming it, before anything is written."""
    out = finished_run(tmp_path)
    (out / name).write_text("mine")
    os.utime(out / name, ns=(1, 1))  # whatever its age: only the stamp the run recorded makes it the run's
    before = snapshot(out)
    with pytest.raises(UserError, match=f"{name} is not the run's own .*overwrite_output_dir would delete it"):
        outputs.check_output_dir(recipe(out, "train.overwrite_output_dir=true"))
    assert snapshot(out) == before


def test_overwrite_after_a_crash_refuses_a_file_older_than_the_attempt(tmp_path):
    """A run killed -9 recorded no files at its end: a file from before its start is not its own."""
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False, command="sft")
    outputs.release(out)  # the process "died": its lock went with it
    (out / "config.yaml").write_text("the run's")
    (out / "summary.json").write_text("mine")
    os.utime(out / "summary.json", (0, 0))
    record = attempts.read_marker(out)
    record["attempt"]["pid"] = 2**22 + 1  # no such process
    attempts.write_marker(out, record)
    with pytest.raises(UserError, match="summary.json is not the run's own \\(older than that run's start\\)"):
        outputs.check_output_dir(recipe(out, "train.overwrite_output_dir=true"))
    os.utime(out / "summary.json")  # written during the attempt: the run's
    assert outputs.check_output_dir(recipe(out, "train.overwrite_output_dir=true")) is None


def test_overwrite_replaces_a_resumed_run_that_died_with_the_files_of_its_earlier_attempt(tmp_path):
    """An attempt keeps the record of the one before it: a continued run killed -9 before it rewrote summary.json
    still owns the first attempt's summary.json, so overwrite replaces the run rather than refusing its own file."""
    out = finished_run(tmp_path)
    outputs.begin_run(out, overwrite=False, command="sft")  # continued; then killed -9 (no end recorded)
    outputs.release(out)
    record = attempts.read_marker(out)
    record["attempt"].update(pid=2**22 + 1, started="2099-01-01T00:00:00+00:00")  # every file predates it
    attempts.write_marker(out, record)
    assert outputs.check_output_dir(recipe(out, "train.overwrite_output_dir=true")) is None
    aside = outputs.begin_run(out, overwrite=True, command="sft")
    (out / "config.yaml").write_text("new")
    outputs.end_overwrite(aside)
    assert sorted(p.name for p in out.iterdir()) == [".posttrain-run", "config.yaml"]


def test_a_report_redrawn_by_posttrain_report_stays_the_runs_own(tmp_path):
    import argparse

    from posttrain.report.write import run_report

    out = finished_run(tmp_path)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    record = attempts.read_marker(out)
    record["files"]["metrics.jsonl"] = attempts.own_files(out)["metrics.jsonl"]
    attempts.write_marker(out, record)
    before = (out / "report.html").stat().st_mtime_ns
    os.utime(out / "report.html", ns=(before - 10**9, before - 10**9))
    assert run_report(argparse.Namespace(runs=[str(out)], out=None)) == 0
    assert "<html" in (out / "report.html").read_text().lower()
    assert outputs.check_output_dir(recipe(out, "train.overwrite_output_dir=true")) is None
