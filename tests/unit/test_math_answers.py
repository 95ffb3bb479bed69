"""math-verify rewards (posttrain/rewards/math_answers.py): equal to TRL's accuracy_reward on a table of answers, the
open-r1 format reward on a hand-checked table, and the deadlines that keep a hostile completion from hanging a step."""

from __future__ import annotations

import sys
import time

import pytest

from posttrain.errors import UserError
from posttrain.rewards import load_reward
from posttrain.config.schema import RewardConfig

pytest.importorskip("math_verify")

# (completion, reference): LaTeX, boxed, fractions, units, wrong, empty, unparseable reference
TABLE = [
    (r"So the answer is \boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}"),
    (r"The answer is $42$.", "$42$"),
    (r"\boxed{42}", "42"),
    (r"$0.75$", r"$\frac{3}{4}$"),
    (r"$\frac{1}{2}$", "0.5"),
    ("", "7"),
    (r"\boxed{1}", "no answer here"),
    (r"\boxed{1+x^2}", "$x^2+1$"),
    (r"First \boxed{3} then \boxed{4}", "4"),
    (r"\boxed{10 \text{ cm}}", "$10$"),
    ("I think it is 5", "5"),
]


@pytest.fixture(scope="module")
def math_accuracy():
    reward = load_reward(RewardConfig(name="math_accuracy", kwargs={"verify_timeout": 1, "parsing_timeout": 1}))
    yield reward.fn
    reward.fn.checker.close()


def test_math_accuracy_equals_trls_accuracy_reward_on_strings_and_messages(math_accuracy):
    from trl.rewards import accuracy_reward

    completions = [[{"role": "assistant", "content": c}] for c, _ in TABLE]
    solutions = [s for _, s in TABLE]
    expected = accuracy_reward(completions, solutions)
    assert None in expected and 1.0 in expected and 0.0 in expected  # the table covers every outcome
    assert math_accuracy(completions, solution=solutions) == expected
    assert math_accuracy([c for c, _ in TABLE], solution=solutions) == expected  # plain-text completions alike


def test_a_hostile_completion_scores_zero_within_its_deadline(math_accuracy):
    """'9^(9^(9^9))' makes sympy's comparison run for ever: math-verify's alarm (verify_timeout=1) stops it in the
    worker's main thread, where TRL's reward in a thread would have no deadline at all."""
    assert math_accuracy([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{5}"], solution=["5", "5"]) == [0.0, 1.0]
    assert math_accuracy.checker.killed == 0  # math-verify's own alarm stopped it: the worker lives on


def _stall(conn, *timeouts):
    """A worker that never answers (an operation math-verify's alarm cannot interrupt)."""
    conn.send(("ready", None))
    conn.recv()
    time.sleep(600)


def test_a_worker_past_its_hard_deadline_is_killed_and_the_sample_named():
    from posttrain.rewards.math_answers import MathChecker

    checker = MathChecker(1, 1, deadline=0.5, target=_stall)
    try:
        assert checker.check("1", "1") == (0.0, "no answer within 0.5s (the worker was restarted)")
        assert checker.check("5", r"\boxed{5}")[0] == 0.0 and checker.killed == 2  # a fresh worker each time
    finally:
        checker.close()


def test_math_accuracy_names_a_missing_column_and_a_bad_timeout(math_accuracy):
    with pytest.raises(UserError, match="column 'solution'.*columns: answer.*kwargs.answer_column"):
        math_accuracy(["1"], answer=["1"])
    with pytest.raises(UserError, match="parsing_timeout must be a whole number"):
        load_reward(RewardConfig(name="math_accuracy", kwargs={"parsing_timeout": 0.5}))


def test_a_missing_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises ImportError
    with pytest.raises(UserError, match=r"reward math_accuracy needs the 'math-verify' package.*posttrain\[envs\]"):
        load_reward(RewardConfig(name="math_accuracy"))


@pytest.mark.parametrize("text, expected", [
    ("<think>\nreasoning\n</think>\n<answer>\n42\n</answer>", 1.0),
    ("<think>\nline one\nline two\n</think>\n<answer>\n42\n</answer>\ntrailing line", 1.0),  # MULTILINE: '$' at a line end
    ("<think>reasoning</think><answer>42</answer>", 0.0),  # the newlines are part of the format
    ("<think>\nreasoning\n</think>\n<answer>\n42\n</answer> trailing", 0.0),
    ("Sure! <think>\nx\n</think>\n<answer>\n1\n</answer>", 0.0),  # must open the completion
    ("<answer>\n42\n</answer>", 0.0),
    ("", 0.0),
])
def test_think_answer_format_is_open_r1s_format_reward(text, expected):
    """open-r1 (src/open_r1/rewards.py, format_reward) is not installable here: the expected values are worked out
    by hand from its pattern '^<think>\\n.*?\\n</think>\\n<answer>\\n.*?\\n</answer>$' under DOTALL | MULTILINE."""
    reward = load_reward(RewardConfig(name="think_answer_format")).fn
    assert reward([[{"role": "assistant", "content": text}]]) == [expected]
