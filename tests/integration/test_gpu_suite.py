"""bench/gpu_suite.py end to end on CPU at --size tiny: one row over its budget is stopped and recorded as failed,
the row after it still runs and reports the planner's estimate and the measured peak, every planned row is in the
results file with figures or a reason, under the device, versions, date and commit."""

import datetime
import json
import shutil

from tests.unit.test_gpu_suite import load_suite


def test_a_failing_row_is_recorded_and_the_next_one_runs(tiny_model_dir, tmp_path):
    suite = load_suite()
    work, out = tmp_path / "work", tmp_path / "out"
    shutil.copytree(tiny_model_dir, work / "tiny" / "model")  # the prepare row finds it made (as on a warm GPU)
    code = suite.main(["--size", "tiny", "--tools", "posttrain", "--work", str(work), "--out", str(out),
                       "--rows", "sft 0.5b bs8x1024,plan sft 0.5b ddp1", "--budget", "sft 0.5b bs8x1024=1",
                       "--commit", "abc123"])
    assert code == 1  # a row failed

    doc = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == [r.name for r in suite.plan_rows("tiny", work, "posttrain")]  # every planned row
    for row in rows.values():
        assert row["status"] in ("passed", "failed", "skipped", "not run"), row
        assert row["reason"] if row["status"] != "passed" else row["figures"] or row["kind"] == "prepare", row
    assert rows["prepare 0.5b"]["status"] == "passed" and rows["prepare 0.5b"]["seconds"] > 0
    failed = rows["sft 0.5b bs8x1024"]
    assert failed["status"] == "failed" and "over its 1 s budget: stopped" in failed["reason"], failed
    assert "trl: not asked (--tools posttrain)" in failed["reason"]  # the empty TRL columns say why
    plan = rows["plan sft 0.5b ddp1"]  # ran after the failure
    assert plan["status"] == "passed", plan
    assert plan["figures"]["engine"] == "single" and plan["figures"]["device"] == "cpu"
    assert plan["figures"]["estimate"] > 0 and plan["figures"]["measured"] > 0
    assert rows["dpo 0.5b bs8x1024"]["status"] == "not run" and "not selected" in rows["dpo 0.5b bs8x1024"]["reason"]

    env = doc["environment"]
    assert env["device"]["cuda"] is False and "CPU" in env["device"]["name"]
    assert env["versions"]["torch"] and env["versions"]["transformers"] and {"trl", "deepspeed"} <= set(env["versions"])
    assert env["commit"] == "abc123" and env["code"].startswith("0.")
    assert datetime.datetime.fromisoformat(env["date"]).tzinfo is not None
    table = (out / "results.md").read_text()
    assert all(name in table for name in rows) and "over its 1 s budget" in table
