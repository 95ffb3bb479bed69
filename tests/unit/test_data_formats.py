"""detect_format: TRL's formats, standard and conversational, and a UserError naming row and column for bad rows."""

from __future__ import annotations

import pytest

from posttrain.data import DataFormat, detect_format
from posttrain.errors import UserError
from tests.unit.test_data_tokenizers import rows

USER = [{"role": "user", "content": "2 + 2?"}]
GOOD = [{"role": "assistant", "content": "4"}]
BAD = [{"role": "assistant", "content": "5"}]


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"text": "hello"}, DataFormat("language_modeling", False)),
        ({"messages": USER + GOOD}, DataFormat("language_modeling", True)),
        ({"prompt": "2 + 2 =", "completion": " 4"}, DataFormat("prompt_completion", False)),
        ({"prompt": USER, "completion": GOOD}, DataFormat("prompt_completion", True)),
        ({"prompt": "2 + 2 =", "answer": "4"}, DataFormat("prompt_only", False)),
        ({"prompt": USER}, DataFormat("prompt_only", True)),
        ({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}, DataFormat("preference", False)),
        ({"prompt": USER, "chosen": GOOD, "rejected": BAD}, DataFormat("preference", True)),
        ({"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}, DataFormat("preference", False, implicit_prompt=True)),
        (
            {"chosen": USER + GOOD, "rejected": USER + BAD, "score": 1.0},
            DataFormat("preference", True, implicit_prompt=True),
        ),
    ],
)
def test_detects_each_format(row, expected):
    assert detect_format(rows(row, row)) == expected


def test_empty_chosen_is_allowed_here_because_tokenize_preference_drops_and_counts_it():
    assert detect_format(rows({"prompt": "p", "chosen": "", "rejected": "r"})).kind == "preference"


def test_unknown_columns_list_the_formats():
    message = r"data.train: columns \['answer', 'question'\] match no known dataset format; expected text"
    with pytest.raises(UserError, match=message):
        detect_format(rows({"question": "q", "answer": "a"}))


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"prompt": "p", "completion": None}, r"data.train row 2: column 'completion' is empty \(null\)"),
    ],
)
def test_missing_and_empty_values_name_row_and_column(bad_row, message):
    dataset = rows({"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": "c"}, bad_row)
    with pytest.raises(UserError, match=message):
        detect_format(dataset)


def test_empty_strings_pass_detection_for_the_tokenizers_to_drop_and_count():
    assert detect_format(rows({"prompt": "p", "completion": "  "}, {"prompt": "", "completion": "c"})).kind == (
        "prompt_completion")
    assert detect_format(rows({"messages": [{"role": "user", "content": "hi"}]}, {"messages": []})).conversational


def test_completion_that_is_an_int_is_named():
    message = r"data.eval row 0: column 'completion' must be a string like row 0's 'prompt', got int 4"
    with pytest.raises(UserError, match=message):
        detect_format(rows({"prompt": "2 + 2 =", "completion": 4}), "data.eval")


def test_messages_that_are_not_a_list():
    message = r"data.train row 0: column 'messages' must be a list of messages \(\{'role': .*\}\), got str 'hello'"
    with pytest.raises(UserError, match=message):
        detect_format(rows({"messages": "hello"}))


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user"}], r"row 0: column 'messages' message 0 needs 'content' \(a string\), got None"),
        ([{"content": "hi"}], r"row 0: column 'messages' message 0 needs a 'role' string"),
    ],
)
def test_bad_messages_are_named(messages, message):
    with pytest.raises(UserError, match=message):
        detect_format(rows({"messages": messages}))


def test_message_not_a_dict_is_named():
    dataset = rows({"messages": ["hello", "there"]})
    with pytest.raises(UserError, match=r"row 0: column 'messages' message 0 needs a 'role' string"):
        detect_format(dataset)


def test_mixed_forms_across_columns():
    message = r"row 0: column 'prompt' must be a list of messages .* like row 0's 'chosen', got str"
    with pytest.raises(UserError, match=message):
        detect_format(rows({"prompt": "2 + 2?", "chosen": GOOD, "rejected": BAD}))


def test_arrow_nulls_for_keys_other_messages_have_are_accepted():
    # Row 0's tool message has a key the others lack: Arrow gives every message that key, set to None.
    dataset = rows({"messages": USER + GOOD + [{"role": "tool", "content": "ok", "name": "calc"}]})
    assert dataset[0]["messages"][0]["name"] is None
    assert detect_format(dataset) == DataFormat("language_modeling", True)

