"""`posttrain report` on files anyone may have edited (issue #37): exit 2 naming the file and line, never a traceback;
everything from the files escaped in the page; and no page written over a file of the user's."""

from __future__ import annotations

import json
import random
import os

import pytest

from posttrain.cli import run_command
from tests.integration.test_bad_input import snapshot
from tests.unit.test_report import sft_rows, write_run


def a_run(path, **kwargs):
    write_run(path, sft_rows(steps=4), **kwargs)
    (path / ".posttrain-run").write_text("{}\n")
    return path


@pytest.mark.parametrize("file, content, fragment", [
    ("metrics.jsonl", random.Random(0).randbytes(64) + b"\xff\n", "metrics.jsonl line 1 is not UTF-8 text"),  # seeded: xdist workers collect the same ids
    ("metrics.jsonl", b'{"step": 1, "loss": 1.0}\n42\n{"step": 2, "loss": 0.5}\n', "line 2 is int '42', not a JSON "
     "object"),
    ("metrics.jsonl", b'{"step": 1, "loss": 1.0}\n{"loss": 0.5}\n', "line 2 has step None; every row needs a whole "
     "step >= 0"),
    ("metrics.jsonl", b'{"step": "<b>1</b>", "loss": 1.0}\n', "line 1 has step '<b>1</b>'"),
    ("metrics.jsonl", b'{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3}\n', "line 2 is not JSON"),
    ("summary.json", b"{not json", "summary.json is not valid JSON"),
    ("summary.json", b"[1, 2]", "summary.json holds list, not a mapping"),
    ("config.yaml", b"a: [unclosed", "config.yaml is not valid YAML"),
    ("samples.jsonl", b'{"step": 1}\n["a list"]\n{"step": 2}\n', "samples.jsonl line 2 is list"),
])
def test_a_damaged_run_file_is_exit_2_naming_it_and_nothing_is_written(tmp_path, capsys, file, content, fragment):
    run = a_run(tmp_path / "run")
    (run / file).write_bytes(content)
    before = snapshot(tmp_path)
    assert run_command(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("posttrain: error:") == 1 and fragment in err and "Traceback" not in err, err
    assert snapshot(tmp_path) == before


def test_a_last_line_cut_short_is_left_out_with_a_warning(tmp_path, capsys):
    run = a_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    assert run_command(["report", str(run)]) == 0
    assert "metrics.jsonl line 6 is cut short" in capsys.readouterr().err
    assert (run / "report.html").is_file()


def test_everything_from_the_files_is_escaped(tmp_path):
    script = "<script>alert(1)</script>"
    facts = {k: script for k in ("command", "parameters", "global_batch", "world_size", "engine", "device", "steps",
                                 "minutes")}
    config = {"model": {"name_or_path": script}, "data": {"train": script, "eval": script},
              "train": {"run_name": script}}
    samples = [{"step": 1, "prompt": script, "completion": script, "reward": 1.0, "rewards": {script: 1.0}},
               {"step": 1, "prompt": script, "completion": "b", "reward": 0.0, "rewards": {script: 0.0}}]
    rows = sft_rows(steps=4) + [{"step": 5, script: 1.0}, {"step": 6, script: 2.0}]
    run = write_run(tmp_path / "run", rows, facts=facts, config=config, samples=samples)
    (run / ".posttrain-run").write_text("{}\n")
    assert run_command(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_a_folder_that_is_no_run_keeps_its_report_html(tmp_path, capsys):
    mine = write_run(tmp_path / "mine", sft_rows(steps=4))  # metrics.jsonl, but no run marker
    (mine / "report.html").write_text("my own page")
    before = snapshot(tmp_path)
    assert run_command(["report", str(mine)]) == 2
    assert "is not a posttrain run's output_dir" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert run_command(["report", str(mine), "--out", str(tmp_path / "named.html")]) == 0  # a path the user names


def test_compare_never_overwrites_a_compare_html_it_did_not_write(tmp_path, monkeypatch, capsys):
    a, b = a_run(tmp_path / "a"), a_run(tmp_path / "b")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert run_command(["report", str(a), str(b)]) == 0  # none there: written
    page = (work / "compare.html").read_text()
    assert run_command(["report", str(a), str(b)]) == 0  # our own page: redrawn
    (work / "compare.html").write_text("<html>the user's compare page</html>")
    before = snapshot(work)
    assert run_command(["report", str(a), str(b)]) == 2
    assert "compare.html already exists and is not a page posttrain report wrote" in capsys.readouterr().err
    assert snapshot(work) == before and "2 runs compared" in page
