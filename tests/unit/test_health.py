"""rundir/health.py: each sign of a run that is not learning fires on rows built to show it, once, with its fix, and
stays silent on healthy rows; the live logger and `posttrain doctor RUN_DIR` say the same."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from posttrain.cli import main
from posttrain.config import DataConfig
from posttrain.data import tokenize_prompts
from posttrain.errors import UserError
from posttrain.online.scoring import RankFigures
from posttrain.online.scoring import step_metrics
from posttrain.rundir.health import CHECKS, PATIENCE, diagnose
from posttrain.rundir.metrics import MetricsLogger
from tests.unit.test_data_tokenizers import CONVERSATION, chatml_tokenizer, rows

HEALTHY = {"loss": 0.1, "grad_norm": 0.5, "clip_fraction": 0.02, "frac_reward_zero_std": 0.25,
           "reward/mean": 0.4, "rewards/exact_match/mean": 0.4, "rewards/exact_match/std": 0.49,
           "truncated_fraction": 0.1, "trained_tokens": 512.0, "mismatch/k3": 2e-6}

# check -> (what breaks it, the subject it names)
SIGNS = {
    "untemplated_prompts": ({"prompts/untemplated_fraction": 1.0}, ""),
    "reward_zero_std": ({"frac_reward_zero_std": 0.95}, ""),
    "constant_reward": ({"rewards/exact_match/std": 0.0, "rewards/exact_match/mean": 0.0}, "exact_match"),
    "clip_fraction": ({"clip_fraction": 0.93}, ""),
    "zero_grad_norm": ({"grad_norm": 0.0}, ""),
    "all_truncated": ({"truncated_fraction": 1.0}, ""),
    "all_masked": ({"trained_tokens": 0.0}, ""),
    "engine_mismatch": ({"mismatch/k3": 0.05}, ""),
}


def run_rows(bad: dict, steps: int = 6, bad_from: int = 1) -> list[dict]:
    return [{"step": s, **HEALTHY, **(bad if s >= bad_from else {})} for s in range(1, steps + 1)]


def test_every_check_has_a_built_case():
    assert set(SIGNS) == {c.name for c in CHECKS}


def test_healthy_rows_are_silent():
    assert diagnose(run_rows({}, steps=20)) == []


@pytest.mark.parametrize("name", SIGNS)
def test_each_sign_fires_once_with_its_fix(name):
    check = next(c for c in CHECKS if c.name == name)
    bad, subject = SIGNS[name]
    findings = diagnose(run_rows(bad, steps=8, bad_from=2))
    assert [(f.check, f.subject) for f in findings] == [(name, subject)]
    assert findings[0].step == 2 + check.patience - 1  # chance signs must last PATIENCE logged rows
    assert findings[0].fix == check.fix and findings[0].fix in findings[0].text()


def test_a_chance_sign_shorter_than_patience_is_not_said_and_eval_rows_do_not_break_a_streak():
    zero = {"frac_reward_zero_std": 1.0}
    flicker = [{"step": s, **HEALTHY, **(zero if s % PATIENCE else {})} for s in range(1, 12)]
    assert diagnose(flicker) == []
    with_evals = []
    for row in run_rows(zero, steps=PATIENCE):
        with_evals += [row, {"step": row["step"], "eval/accuracy": 0.5}]  # eval rows have none of the metrics
    assert [f.check for f in diagnose(with_evals)] == ["reward_zero_std"]


def test_live_logger_warns_once_and_a_resumed_run_does_not_repeat_it(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), 8, 0, True)
    for row in run_rows({"clip_fraction": 0.99}, steps=4):
        logger.log(row["step"], row)
    logger.close()
    err = capsys.readouterr().err
    assert err.count("posttrain: warning: step 1: clip_fraction=0.99") == 1 and "Fix: lower train.learning_rate" in err
    resumed = MetricsLogger(str(tmp_path), 8, 4, True)
    resumed.log(5, run_rows({"clip_fraction": 0.99}, steps=5)[-1])
    resumed.close()
    assert "warning" not in capsys.readouterr().err


def test_doctor_on_a_run_dir_prints_the_same_diagnosis(tmp_path, capsys):
    bad = run_rows({"frac_reward_zero_std": 1.0, "grad_norm": 0.0}, steps=5)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    assert main(["doctor", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for finding in diagnose(bad):
        assert f"WARN  {finding.check}: step {finding.step}: {finding.detail}\n      fix: {finding.fix}" in out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run_rows({}, steps=5)))
    assert main(["doctor", str(tmp_path)]) == 0
    assert "PASS  run health" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path / "nowhere")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_plain_prompts_for_a_chat_model_are_counted_per_step():
    tok = chatml_tokenizer()
    (plain,), _ = tokenize_prompts(rows({"prompt": "2 + 2 =", "answer": "4"}), tok, DataConfig())
    (chat,), _ = tokenize_prompts(rows({"prompt": CONVERSATION[:1], "answer": "4"}), tok, DataConfig())
    assert (plain["untemplated"], chat["untemplated"]) == (True, False)
    tok = copy.deepcopy(tok)  # chatml_tokenizer() is shared by the session's tests
    tok.chat_template = None  # a base model: plain text is what it reads
    (plain,), _ = tokenize_prompts(rows({"prompt": "2 + 2 =", "answer": "4"}), tok, DataConfig())
    assert plain["untemplated"] is False
    part = RankFigures(total=[1.0, 0.0], scored=[True, True], per_function={"r": [1.0, 0.0]}, skipped=0, logged={},
                       lengths=[3, 4], truncated=[False, False], lags=[0, 0], agent=None, untemplated=[True, False])
    metrics = step_metrics([part], torch.tensor([1.0, 0.0]), torch.tensor([True, True]), 2)
    assert metrics["prompts/untemplated_fraction"] == 0.5
    chat = dataclasses.replace(part, untemplated=[False, False])
    assert "prompts/untemplated_fraction" not in step_metrics([chat], torch.tensor([1.0, 0.0]),
                                                              torch.tensor([True, True]), 2)
