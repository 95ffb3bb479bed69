"""The short version of bench/chaos.py that CI runs: kill -9 an SFT run twice (during a checkpoint write, then during
the export), resume it with `auto` each time, and end bitwise equal to the uninterrupted run with no checkpoint ever
left corrupt. The 20-kill figures come from the full script (see its docstring)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kills_mid_save_and_mid_export_resume_bitwise_equal(tmp_path):
    result = load_chaos().main(["--kills", "2", "--steps", "4", "--kinds", "checkpoint,export", "--out", str(tmp_path)])
    assert result["failures"] == 0, result["problems"]
    assert result["kills"] == 2 and result["resumes"] == 2 and result["episodes"] == 1, result
    assert result["kinds"] == {"checkpoint": 1, "export": 1}, result["kinds"]
    assert result["max_abs_dw"] == 0.0
