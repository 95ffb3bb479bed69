"""The demo's arithmetic task: the carry rule, the sloppy demonstrator, and splits that never overlap."""

from __future__ import annotations

import json
import random

import pytest

from posttrain.demo.tasks import carries, forgot_carry, preference_rows, sft_rows, wrong_answer, write_example_data


@pytest.mark.parametrize("a, b, carry, slipped", [(57, 8, True, 55), (51, 8, False, 59), (999, 8, True, 997),
                                                  (10, 0, False, 10), (5, 5, True, 0)])
def test_the_carry_and_its_slip(a, b, carry, slipped):
    assert carries(a, b) is carry
    assert forgot_carry(a, b) == slipped


def test_wrong_answers_are_wrong_and_the_carry_slip_where_there_is_a_carry():
    rng = random.Random(0)
    for a in range(0, 200, 7):
        for b in range(10):
            wrong = wrong_answer(a, b, rng)
            assert wrong != a + b and wrong >= 0
            if carries(a, b):
                assert wrong == a + b - 10


def test_sloppy_demonstrations_forget_about_the_asked_share_of_carries_and_keep_the_true_answer():
    problems = [(a, b) for a in range(1000) for b in range(10)]
    rows = sft_rows(problems, carry_slip=0.5, seed=3)
    carrying = [(p, r) for p, r in zip(problems, rows) if carries(*p)]
    slipped = [r for p, r in carrying if r["completion"][0]["content"] == str(forgot_carry(*p))]
    assert 0.47 < len(slipped) / len(carrying) < 0.53
    for (a, b), row in zip(problems, rows):
        assert row["answer"] == str(a + b)
        if not carries(a, b):
            assert row["completion"][0]["content"] == str(a + b)
    assert all(r["completion"][0]["content"] == r["answer"] for r in sft_rows(problems[:500]))


def test_preference_rows_prefer_the_true_sum():
    rows = preference_rows([(57, 8), (51, 3)], seed=0)
    assert [r["chosen"][0]["content"] for r in rows] == ["65", "54"]
    assert rows[0]["rejected"][0]["content"] == "55"
    assert rows[1]["rejected"][0]["content"] != "54"


def _problems(path):
    return {r["prompt"][0]["content"] for r in map(json.loads, path.read_text().splitlines())}


def test_a_separate_rl_split_never_overlaps_sft_or_held_out(tmp_path):
    files = write_example_data(tmp_path, n_train=300, n_eval=50, max_operand=999, max_addend=9, n_rl=120,
                               carry_slip=0.5)
    sft, held, rl = _problems(files["sft_train"]), _problems(files["prompts_eval"]), _problems(files["prompts_train"])
    assert (len(sft), len(held), len(rl)) == (300, 50, 120)
    assert not sft & held and not sft & rl and not rl & held
    assert _problems(files["pref_train"]) == rl and _problems(files["pref_eval"]) == held
    evals = [json.loads(line) for line in files["sft_eval"].read_text().splitlines()]
    assert all(r["completion"][0]["content"] == r["answer"] for r in evals)  # held-out answers are never sloppy


def test_without_an_rl_split_every_training_file_uses_the_sft_problems(tmp_path):
    files = write_example_data(tmp_path, n_train=80, n_eval=20)
    sft = _problems(files["sft_train"])
    assert _problems(files["prompts_train"]) == sft == _problems(files["pref_train"])
