"""report.html: the facts, the curves, and each held-out metric at its first and last evaluation."""

from __future__ import annotations

import json

from posttrain.logging import eval_endpoints, write_report


def test_eval_endpoints_are_the_first_and_last_evaluation():
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 5, "loss": 1.0}, {"step": 10, "eval/accuracy": 0.75,
                                                                           "eval/loss": 2.0}]
    assert eval_endpoints(rows) == [("eval/accuracy", (0, 0.5), (10, 0.75)), ("eval/loss", (10, 2.0), (10, 2.0))]
    assert eval_endpoints([{"step": 1, "loss": 1.0}]) == []


def test_report_lists_the_held_out_table_only_when_there_were_evaluations(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "eval/accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(tmp_path, "t", {"engine": "single"}).read_text()
    assert "<th>eval/accuracy</th><td>0.25 (step 0)</td><td>0.5 (step 2)</td>" in page
    assert (tmp_path / "curves.png").stat().st_size > 0
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert "Held-out evaluation" not in write_report(tmp_path, "t").read_text()
