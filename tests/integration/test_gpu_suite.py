"""bench/gpu_suite.py running rows on CPU.

- Rows of cheap real processes: the results file holds each finished row as soon as it finished, a row past its
  budget is stopped and recorded, and a suite stopped from outside (the device call's time limit) leaves every earlier
  row, with the running one recorded and its process group gone. The file is whole whenever it is read.
- The real rows at --size tiny: the SFT row (posttrain's side) and the planner's estimate read from its run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.unit.test_gpu_suite import REPO, load_suite

DRIVER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, "bench")
import gpu_suite as s
from gpu_suite_report import document, write_results

out, logs, marker = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
py = "python"
rows = [
    s.Row("writes", "plan", "-", (py, "-c", "import json, sys; json.dump({'x': 1}, open(sys.argv[1], 'w'))",
                                   "{figures}"), 60, True),
    s.Row("overruns", "plan", "-", (py, "-c", "import time; time.sleep(60)"), 1, True),
    s.Row("hangs", "plan", "-", (py, "-c", f"import time; time.sleep(600)  # {marker}"), 300, True),
    s.Row("after", "plan", "-", (py, "-c", "pass"), 60, True),
]
found = {"device": {"cuda": False, "name": "CPU"}, "missing": {}, "missing_core": [], "unmet": {}, "modules": {}}
info = {"device": found["device"], "versions": {}, "code": "test", "commit": "test",
        "date": "2026-11-26T00:00:00+00:00"}
selected = {r.name for r in rows}
save = lambda results: write_results(out, document("tiny", 8, info, found, rows, selected, results, []), logs)
save({})
s.run_suite(rows, selected, found, {}, logs, time.monotonic() + 600, {}, save)
"""


def _marked(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (the hanging row's, started by this test)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_rows_are_kept_as_they_finish_and_a_stopped_suite_loses_none(tmp_path):
    out, logs, marker = tmp_path / "out", tmp_path / "logs", f"hang-{uuid.uuid4().hex}"
    suite = subprocess.Popen([sys.executable, "-c", DRIVER, str(out), str(logs), marker], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline, by = time.monotonic() + 90, {}
        while time.monotonic() < deadline:  # every read finds a whole file
            if (out / "results.json").exists():
                by = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
                if by["hangs"]["status"] == "running":
                    break
            assert suite.poll() is None, suite.stdout.read()
            time.sleep(0.05)
        assert by["hangs"]["status"] == "running", by
        assert by["writes"]["status"] == "passed" and by["writes"]["figures"] == {"x": 1}
        assert by["overruns"]["status"] == "failed" and "over its 1 s budget: stopped" in by["overruns"]["reason"]
        assert by["after"]["status"] == "pending" and _marked(marker)
        suite.send_signal(signal.SIGTERM)  # what the device call's time limit does
        assert suite.wait(timeout=60) == 143, suite.stdout.read()
    finally:
        if suite.poll() is None:
            suite.kill()
    by = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert by["writes"]["status"] == "passed" and by["overruns"]["status"] == "failed"
    assert by["hangs"]["status"] == "failed" and "the suite was stopped during this row" in by["hangs"]["reason"]
    assert by["after"]["status"] == "pending" and "not reached" in by["after"]["reason"]
    assert "| hangs |" in (out / "results.md").read_text() and (out / "logs.tar.gz").exists()
    time.sleep(0.5)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _marked(marker)}
    assert not left  # the hanging row's process was stopped with the suite


def test_the_sft_row_and_the_plan_read_from_its_run(tiny_model_dir, tmp_path):
    suite = load_suite()
    work, out = tmp_path / "work", tmp_path / "out"
    shutil.copytree(tiny_model_dir, work / "tiny" / "model")  # the prepare row finds it made (as on a warm GPU)
    code = suite.main(["--size", "tiny", "--tools", "posttrain", "--work", str(work), "--out", str(out),
                       "--rows", "plan sft 0.5b bs8x1024", "--commit", "abc123"])
    assert code == 0

    doc = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert [r["status"] for r in doc["rows"][:5]] == ["passed", "passed", "not run", "not run", "passed"]
    sft = rows["sft 0.5b bs8x1024"]
    assert sft["figures"]["tools"]["posttrain"]["s/step"] > 0 and sft["steps"] == "4 (1 left out)"
    assert "trl: not asked (--tools posttrain)" in sft["reason"]  # the empty TRL columns say why
    plan = rows["plan sft 0.5b bs8x1024"]["figures"]
    assert plan["steps"] == 4 and plan["estimate"] > 0 and plan["measured"] > 0 and plan["device"] == "cpu (peak RSS)"
    env = doc["environment"]
    assert env["device"]["cuda"] is False and env["commit"] == "abc123" and env["versions"]["torch"]
    assert "sft 0.5b bs8x1024" in (out / "results.md").read_text()


def test_the_vision_row_runs_one_sft_step_of_the_tiny_vlm(tmp_path):
    """--size tiny on this CPU: the row makes the tiny Qwen2-VL and the shapes images, trains one step, and its
    figures reach results.json and results.md."""
    suite = load_suite()
    out = tmp_path / "out"
    code = suite.main(["--size", "tiny", "--tools", "posttrain", "--work", str(tmp_path / "work"), "--out", str(out),
                       "--rows", "sft vision tiny-qwen2-vl 1 step", "--commit", "abc123"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    vision = rows["sft vision tiny-qwen2-vl 1 step"]
    assert vision["status"] == "passed", vision
    f = vision["figures"]
    assert f["exit"] == 0 and f["steps"] == 1 and f["loss"] > 0 and f["s/step"] > 0 and f["device"] == "cpu"
    assert f["peak_memory_mb"] > 0
    assert [r["status"] for r in rows.values() if r["name"] != vision["name"]] == ["not run"] * (len(rows) - 1)
    table = (out / "results.md").read_text()
    assert f"| sft vision tiny-qwen2-vl 1 step | cpu | 1 | {f['loss']:.4g} |" in table
