"""Built-in rewards against hand-written completions and hand-computed numbers."""

from __future__ import annotations

import pytest

from posttrain.errors import UserError
from posttrain.rewards.builtin import (
    BUILTIN_REWARDS,
    check_builtin_kwargs,
    exact_match,
    extract_answer,
    format_reward,
    length_penalty,
)


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("2 + 3 = 5, so the result is 5", "5"),
        ("First 12, then 30. Finally 42", "42"),
        ("The sum is \\boxed{42}. Check: 40 + 2 = 42, and 7 is unrelated", "42"),
        ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}"),
        ("Reasoning 3 * 4 = 12\n#### 12\nextra 99", "12"),
        ("I computed 17 items.\nAnswer: 18\n", "18"),
        ("answer: Paris", "Paris"),
        ("No numbers here", "No numbers here"),
        ("It costs -3.5 dollars", "-3.5"),
        ("That is 1,234 apples", "1,234"),
    ],
)
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("so the total is 72", "72", 1.0),
        ("so the total is 71", "72", 0.0),
        ("Answer: $1,000.", "1000", 1.0),
        ("\\boxed{72.0}", "72", 1.0),
        ("the answer is 72 apples\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K reference
        ("Answer: 42 apples", "42", 1.0),
        ("Answer: Paris.", "paris", 1.0),
        ("Answer: Lyon", "Paris", 0.0),
        ("The capital is Paris", "Paris", 0.0),  # no marker, no number: the whole text is the answer
        ("Paris", " paris ", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("7 then 8", 8, 1.0),  # non-string references
        ("no answer", None, None),
    ],
)
def test_exact_match(completion, reference, expected):
    assert exact_match(completions=[completion], answer=[reference]) == [expected]


def test_exact_match_other_column_and_missing_column():
    assert exact_match(completions=["4", "5"], answer_column="solution", solution=["4", "4"]) == [1.0, 0.0]
    with pytest.raises(UserError, match="column 'answer'.*columns: solution"):
        exact_match(completions=["4"], solution=["4"])


def test_format_reward():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    completions = [
        "<think>a\nb</think>\n<answer>4</answer>",  # '.' spans lines
        "<think>a</think><answer>4</answer> trailing",
        "prefix <think>x</think><answer>4</answer>",
        "nothing",
    ]
    assert format_reward(completions=completions, pattern=pattern) == [1.0, 0.0, 0.0, 0.0]
    assert format_reward(completions=completions, pattern=pattern, fullmatch=False) == [1.0, 1.0, 1.0, 0.0]


def test_length_penalty_numbers():
    completions = ["x" * n for n in (0, 10, 11, 15, 20, 30)]
    # target 10, max 20: 0 up to 10 characters, then -(L - 10) / 10, capped at -1
    assert length_penalty(completions=completions, max_length=20, target_length=10) == [
        0.0,
        0.0,
        -0.1,
        -0.5,
        -1.0,
        -1.0,
    ]
    assert length_penalty(completions=["abcd", "ab"], max_length=4) == [-1.0, -0.5]


def test_length_penalty_in_tokens(tiny_model_dir):
    ids = [[1] * 3, [1] * 5, [1] * 9]
    assert length_penalty(
        completions=["", "", ""], max_length=9, target_length=3, unit="tokens", completion_ids=ids
    ) == [
        0.0,
        pytest.approx(-1 / 3),
        -1.0,
    ]
    # without a completion_ids column: re-encoded with the tokenizer (digits are single tokens in the tiny one)
    assert length_penalty(completions=["1234"], max_length=8, unit="tokens", tokenizer=str(tiny_model_dir)) == [-0.5]
    with pytest.raises(UserError, match="needs kwargs.tokenizer"):
        length_penalty(completions=["1234"], max_length=8, unit="tokens")


def test_builtin_table():
    assert set(BUILTIN_REWARDS) == {"exact_match", "format", "length_penalty", "reward_model", "overlong", "judge",
                                    "math_accuracy", "think_answer_format", "reasoning_gym",
                                    "verifiers"}


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("exact_match", {"answer_colum": "x"}, "unknown kwarg 'answer_colum'; did you mean 'answer_column'"),
        ("format", {}, "needs kwargs pattern"),
        ("format", {"pattern": "(unclosed"}, "not a valid regular expression"),
        ("length_penalty", {"max_length": 10, "target_length": 10}, "target_length < kwargs.max_length"),
        ("length_penalty", {"max_length": 10, "unit": "words"}, "chars or tokens"),
        ("reward_model", {}, "needs kwargs path"),
        ("reward_model", {"path": "/no/such/dir"}, "local path '/no/such/dir' does not exist"),
    ],
)
def test_check_builtin_kwargs_rejects(name, kwargs, message):
    with pytest.raises(UserError, match=message):
        check_builtin_kwargs(name, kwargs)


def test_check_builtin_kwargs_accepts():
    check_builtin_kwargs("exact_match", {})
    check_builtin_kwargs("format", {"pattern": "a+", "fullmatch": False})
    check_builtin_kwargs("length_penalty", {"max_length": 100, "target_length": 50})
