"""load_rows: every local source kind, and a UserError naming the file and line for each kind of bad input."""

from __future__ import annotations

import json

import datasets
import pytest

from posttrain.data import load_rows
from posttrain.errors import UserError

ROWS = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": " 6"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert load_rows(str(path)).to_list() == ROWS


def test_json_array_and_json_lines_named_json(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps(ROWS))
    lines = write_jsonl(tmp_path / "lines.json", ROWS)
    assert load_rows(str(array)).to_list() == ROWS
    assert load_rows(str(lines)).to_list() == ROWS


def test_parquet_and_csv(tmp_path):
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "t.parquet"))
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "t.csv"), index=False)
    assert load_rows(str(tmp_path / "t.parquet")).to_list() == ROWS
    assert load_rows(str(tmp_path / "t.csv")).to_list() == ROWS


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS[:1])
    ).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "single")).to_list() == ROWS
    assert load_rows(str(tmp_path / "dict"), split="test").to_list() == ROWS[:1]
    with pytest.raises(UserError, match=r"data.eval: .*dict has no split 'validation'; it has train, test"):
        load_rows(str(tmp_path / "dict"), split="validation", what="data.eval")


def test_missing_file_names_key_and_file(tmp_path):
    with pytest.raises(UserError, match=r"^data.train: file .*x.jsonl does not exist"):
        load_rows(str(tmp_path / "x.jsonl"))
    with pytest.raises(UserError, match=r"^data.eval: ./nowhere/data does not exist"):
        load_rows("./nowhere/data", what="data.eval")


def test_malformed_json_line_is_named(tmp_path):
    path = tmp_path / "x.jsonl"
    lines = [json.dumps(ROWS[0])] * 6 + ['{"prompt": "a", "completion": ']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"^data.train: .*x.jsonl line 7: not valid JSON"):
        load_rows(str(path))


def test_line_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(UserError, match=r"x.jsonl line 2: expected a JSON object \(one row\), got list"):
        load_rows(str(path))


def test_row_whose_type_differs_from_earlier_rows_is_named(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", ROWS + [{"prompt": "a", "completion": 5}])
    message = r"x.jsonl line 3: column 'completion' holds number where earlier rows hold string"
    with pytest.raises(UserError, match=message):
        load_rows(str(path))


def test_empty_file_and_empty_array(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "empty.json").write_text("[]")
    for name in ("empty.jsonl", "empty.json"):
        with pytest.raises(UserError, match=rf"^data.train: .*{name} holds no rows"):
            load_rows(str(tmp_path / name))


def test_unknown_extension(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("hello\n")
    with pytest.raises(UserError, match=r"^data.train: .*train.txt has an unknown extension '.txt'; use one of .jsonl"):
        load_rows(str(path))


def test_unreachable_hub_name_is_a_user_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"^data.train: 'no-such-org/no-such-dataset' is not a local file or directory"):
        load_rows("no-such-org/no-such-dataset")


def test_csv_cells_stay_text_and_ragged_rows_are_named(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text('prompt,completion\n2 + 2 =, 4\n"multi\nline",7\n3 + 3 =, 6,extra\n')
    with pytest.raises(UserError, match=r"x.csv line 5: has more cells than the header names"):
        load_rows(str(path))
    path.write_text('prompt,completion\n2 + 2 =, 4\n"multi\nline",7\n')
    expected = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "multi\nline", "completion": "7"}]
    assert load_rows(str(path)).to_list() == expected


def test_columns_are_the_union_of_the_rows_keys(tmp_path):
    """A key missing from some rows is null there (detect_format then names the row), never silently dropped."""
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "2 + 2 ="}, ROWS[1]])
    assert load_rows(str(path)).to_list() == [{"prompt": "2 + 2 =", "completion": None}, ROWS[1]]


@pytest.mark.parametrize("depth", [33, 100_000])
def test_json_nested_too_deep_names_the_file_and_line(tmp_path, depth):
    """100,000 levels overflow Python's JSON reader (RecursionError); 33 would reach Arrow and the templates."""
    rows = tmp_path / "deep.jsonl"
    rows.write_text('{"text": "fine"}\n' + '{"text": "x", "meta": ' + "[" * depth + "]" * depth + "}\n")
    with pytest.raises(UserError, match=r"data.train: .*deep.jsonl line 2: nested deeper than 32 levels"):
        load_rows(str(rows))
    array = tmp_path / "deep.json"
    array.write_text('[{"text": "fine"}, {"text": "x", "meta": ' + "[" * depth + "]" * depth + "}]")
    with pytest.raises(UserError, match=r"deep.json.*nested deeper than 32 levels"):
        load_rows(str(array))


def test_chat_rows_with_tool_calls_are_not_too_deep(tmp_path):
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": {"b": {"c": [1, 2]}}}}}
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert len(load_rows(str(path))) == 1
