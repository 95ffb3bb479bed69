"""The README's demo table is docs/demo_results.json's figures (recorded from a run by scripts/demo_table.py), in the
row format the demo itself prints at its end (tests/integration/test_demo.py holds the demo to that format)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from posttrain.demo.table import BEGIN, END, readme_block, readme_row

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_is_the_recorded_run():
    record = json.loads((ROOT / "docs" / "demo_results.json").read_text())
    page = (ROOT / "README.md").read_text()
    assert page[page.index(BEGIN):page.index(END) + len(END)] == readme_block(record)
    assert record["held_out_prompts"] == 200  # a full run, not --quick
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo_table.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_row_format():
    results = {"seed": 1, "sft_accuracy": 0.59, "dpo_pref_accuracy_before": 0.68, "dpo_pref_accuracy_after": 0.955,
               "dpo_accuracy": 0.8, "grpo_accuracy": 0.765, "ppo_accuracy": 0.755}
    assert readme_row(results) == "| 1 | 59.0% | 68.0% -> 95.5% | 80.0% | 76.5% | 75.5% |"


def test_recording_a_quick_run_is_refused(tmp_path):
    quick = tmp_path / "demo_results.json"
    quick.write_text(json.dumps({"held_out_prompts": 40}))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo_table.py"), str(quick)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--quick run" in done.stderr


def test_readme_make_test_duration_is_the_recorded_ci_run():
    """The README's `make test` duration is docs/ci_run.json's (recorded by scripts/ci_duration.py from a CI run),
    and says it covers the whole .ci/run, install included."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ci_duration", ROOT / "scripts" / "ci_duration.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = json.loads((ROOT / "docs" / "ci_run.json").read_text())
    page = (ROOT / "README.md").read_text()
    block = page[page.index(script.BEGIN):page.index(script.END) + len(script.END)]
    assert block == script.readme_block(record)
    assert f"({record['seconds']} s)" in block and ".ci/run" in block and "not timed apart" in block
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci_duration.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
