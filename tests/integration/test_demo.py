"""`posttrain demo --quick` runs the whole pipeline (tiny model -> SFT -> DPO -> GRPO) and writes every report."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main


def test_quick_demo_writes_reports_and_results(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "demo_results.json").read_text())
    for key in ("sft_accuracy", "dpo_accuracy", "grpo_accuracy", "dpo_pref_accuracy_before", "dpo_pref_accuracy_after"):
        assert 0.0 <= results[key] <= 1.0, key
    for stage in ("sft", "dpo", "grpo"):
        assert (out / stage / "report.html").exists()
        assert (out / stage / "final" / "config.json").exists()
        rows = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert any("loss" in r for r in rows)
    grpo_rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in r for r in grpo_rows)
    # the reports show the held-out numbers before (step 0: the SFT model) and after
    dpo_rows = [json.loads(line) for line in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    before = next(r for r in dpo_rows if "eval/logps/accuracies" in r)
    assert before["step"] == 0
    assert before["eval/logps/accuracies"] == pytest.approx(results["dpo_pref_accuracy_before"], abs=1e-6)
    page = (out / "dpo" / "report.html").read_text()
    assert "Held-out evaluation" in page and "<th>eval/logps/accuracies</th>" in page and "(step 0)" in page
    assert "<th>eval/accuracy</th>" in (out / "grpo" / "report.html").read_text()
