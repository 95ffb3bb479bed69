"""`posttrain doctor --config` checks the recipe's own inputs (it builds, its model and data exist) before saying "all
checks passed"; plan and doctor take key=value overrides anywhere among their flags, as training commands do."""

from __future__ import annotations

from pathlib import Path

from posttrain.cli import build_parser, parse_args
from posttrain.launch.doctor_inputs import check_inputs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "sft.yaml")


class Lines:
    def __init__(self):
        self.lines: list[tuple[str, str, str]] = []

    def add(self, status: str, name: str, detail: str, fix: str = "") -> None:
        self.lines.append((status, name, detail))


def statuses(config: str, overrides: list[str]) -> dict[str, tuple[str, str]]:
    report = Lines()
    check_inputs(report, config, overrides)
    return {name: (status, detail) for status, name, detail in report.lines}


def test_missing_model_and_data_fail(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    got = statuses(RECIPE, [f"model.name_or_path={tmp_path}/no-model", f"data.train={tmp_path}/none.jsonl"])
    assert got["recipe"][0] == "PASS" and got["model"][0] == "FAIL" and "does not exist" in got["model"][1]
    assert got["data.train"][0] == "FAIL" and "none.jsonl does not exist" in got["data.train"][1]
    assert got["data.eval"] == ("PASS", "examples/data/sft_eval.jsonl: 200 rows")


def test_present_model_and_data_pass(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(ROOT)
    got = statuses(RECIPE, [f"model.name_or_path={tiny_model_dir}", "data.eval=null"])
    assert got["model"][0] == "PASS" and got["data.train"] == ("PASS", "examples/data/sft_train.jsonl: 2000 rows")
    assert "data.eval" not in got


def test_an_uncached_hub_model_offline_fails_with_the_download_command(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, detail = statuses(RECIPE, ["model.name_or_path=no-such-org/no-such-model-46"])["model"]
    assert status == "FAIL" and "not in the Hugging Face cache" in detail


def test_a_recipe_that_does_not_build_fails_once():
    got = statuses(RECIPE, ["train.max_steps=abc"])
    assert list(got) == ["recipe"] and got["recipe"][0] == "FAIL"


def test_overrides_anywhere_among_plan_and_doctor_flags():
    argv = ["plan", "--config", RECIPE, "train.max_steps=3", "--gpus", "2", "data.max_length=64", "--bf16"]
    args = parse_args(build_parser("plan"), argv)
    assert args.overrides == ["train.max_steps=3", "data.max_length=64"] and args.gpus == 2 and args.bf16
    args = parse_args(build_parser("doctor"), ["doctor", "--config", RECIPE, "a.b=1", "--timeout", "5", "c.d=2"])
    assert args.overrides == ["a.b=1", "c.d=2"] and args.timeout == 5
