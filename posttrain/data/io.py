"""Reading rows: local files, save_to_disk directories, or hub datasets -> one `datasets.Dataset`.

    rows = load_rows("data/train.jsonl", what="data.train")
    rows = load_rows("HuggingFaceH4/ultrachat_200k", split="train_sft")

JSON, JSON Lines and CSV are parsed here, so a broken row is reported as `file line N` (and CSV cells stay text);
parquet, save_to_disk directories and hub names are handed to `datasets`. Errors are `UserError`s that name the
file and the recipe key (`what`).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import datasets

from posttrain.data.reasoning_gym import is_task_spec, task_rows
from posttrain.data.verifiers_tasks import is_verifiers_spec, verifiers_rows
from posttrain.errors import UserError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def load_rows(source: str, split: str = "train", what: str = "data.train",
              held_out_from: str | None = None) -> datasets.Dataset:
    """One split of rows from a .jsonl/.json/.parquet/.csv file, a save_to_disk directory, a hub dataset name, a
    verifiers: environment's tasks (data/verifiers_tasks.py) or a reasoning_gym: task (data/reasoning_gym.py;
    held_out_from: the training source, which its rows never overlap)."""
    if is_task_spec(source):
        return task_rows(source, what, held_out_from)
    if is_verifiers_spec(source):
        return verifiers_rows(source, what)
    path = Path(source).expanduser()
    is_file = path.suffix.lower() in SUFFIXES or path.is_file()
    if is_file:
        rows = _read_file(path, what)
    elif path.is_dir():
        rows = _read_dir(path, split, what)
    elif source.startswith((".", "/", "~")):
        raise UserError(f"{what}: {source} does not exist")
    else:
        rows = _read_hub(source, split, what)
    if len(rows) == 0:
        name = source if is_file else f"{source} (split {split!r})"
        raise UserError(f"{what}: {name} holds no rows; give a dataset with at least one row")
    return rows


def _read_file(path: Path, what: str) -> datasets.Dataset:
    if not path.is_file():
        raise UserError(f"{what}: file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        known = ", ".join(SUFFIXES)
        raise UserError(f"{what}: {path} has an unknown extension {suffix or '(none)'!r}; use one of {known}")
    if suffix != ".parquet":  # parsed here, so a broken row is named by its line
        return _from_records((_read_csv if suffix == ".csv" else _read_json)(path, what), path, what)
    try:
        return datasets.Dataset.from_parquet(str(path))
    except Exception as e:  # pyarrow raises many types for a broken file
        raise UserError(f"{what}: could not read {path}: {e}") from None


def _read_json(path: Path, what: str) -> list[tuple[str, dict]]:
    """(where, row) pairs, where is 'line N' or 'item N'. A .json file holds one array of objects or is JSON Lines."""
    text = _read_text(path, what)
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{what}: {path} line {e.lineno}: not valid JSON: {e.msg}") from None
        except RecursionError:
            raise UserError(f"{what}: {path}: {_TOO_DEEP} (the first row too deep is not known: the file is one "
                            "array)") from None
        return [(f"item {i}", _check_row(item, f"{what}: {path} item {i}")) for i, item in enumerate(items)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{what}: {path} line {number}: not valid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise UserError(f"{what}: {path} line {number}: {_TOO_DEEP}") from None
        records.append((f"line {number}", _check_row(item, f"{what}: {path} line {number}")))
    return records


MAX_DEPTH = 32  # lists and objects inside one another in a row; chat rows with tool calls need about 6
_TOO_DEEP = (f"nested deeper than {MAX_DEPTH} levels of lists and objects; a row holds text, messages or "
             "prompt / completion columns: flatten it")


def _check_row(row, where: str) -> dict:
    """`row` if it is a JSON object nested at most MAX_DEPTH deep (counted without recursion): deeper rows are refused
    before Arrow or a template meets them."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object (one row), got {type(row).__name__}")
    stack = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise UserError(f"{where}: {_TOO_DEEP}")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return row


def _read_csv(path: Path, what: str) -> list[tuple[str, dict]]:
    """Every cell is text (no guessing that " 4" is the number 4); the first line names the columns."""
    with io.StringIO(_read_text(path, what), newline="") as f:
        reader = csv.DictReader(f)
        try:
            records = [(f"line {reader.line_num}", row) for row in reader]
        except csv.Error as e:
            raise UserError(f"{what}: {path} line {reader.line_num}: not valid CSV: {e}") from None
    for where, row in records:
        if None in row or None in row.values():
            count = "more" if None in row else "fewer"
            raise UserError(f"{what}: {path} {where}: has {count} cells than the header names")
    return records


def _read_text(path: Path, what: str) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"{what}: {path} line {line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                        "save the file as UTF-8") from None


def _from_records(records: list[tuple[str, dict]], path: Path, what: str) -> datasets.Dataset:
    """Columns are the union of all rows' keys (a row without one holds null there, which detect_format names)."""
    rows = [row for _, row in records]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    try:
        return datasets.Dataset.from_dict({c: [row.get(c) for row in rows] for c in columns})
    except Exception as e:  # Arrow cannot hold a column whose rows disagree in type: find the row that breaks it
        for column in columns:
            first = None
            for where, row in records:
                shape = _shape(row.get(column))
                if shape == "null":
                    continue
                if first is None:
                    first = shape
                elif shape != first:
                    raise UserError(f"{what}: {path} {where}: column {column!r} holds {shape} where earlier rows "
                                    f"hold {first}; every row must use the same type per column") from None
        where = _first_misfit(records)  # the shapes agree at the top: the difference is deeper (a message's content)
        raise UserError(f"{what}: {path}{f' {where}' if where else ''}: a field holds values of different shapes "
                        "(within the row, or against the earlier rows: for example a message content that is a list "
                        f"where others are strings; {str(e).splitlines()[0][:200]}); give every message's content "
                        "as a string") from None


def _first_misfit(records: list[tuple[str, dict]]) -> str:
    """Where (line / row) the first row is that a table of the rows before it cannot take: the shortest prefix of
    rows that Arrow refuses, found by bisection (log2(rows) tries); '' when every prefix but the whole builds."""
    def builds(n: int) -> bool:
        rows = [row for _, row in records[:n]]
        columns = list(dict.fromkeys(k for row in rows for k in row))
        try:
            datasets.Dataset.from_dict({c: [row.get(c) for row in rows] for c in columns})
            return True
        except Exception:  # noqa: BLE001 - Arrow raises several types for rows that disagree
            return False

    good, bad = 0, len(records)  # rows[:good] builds, rows[:bad] does not
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if builds(middle) else (good, middle)
    return records[bad - 1][0] if bad >= 1 else ""


def _shape(value) -> str:
    """A coarse type name for comparing rows: 'string', 'number', 'list of object', ..."""
    if value is None:
        return "null"
    for kinds, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (dict, "object")):
        if isinstance(value, kinds):  # bool first: it is an int too
            return name
    if isinstance(value, list):
        inner = sorted({_shape(v) for v in value} - {"null"})
        return "list of " + (" or ".join(inner) if inner else "nothing")
    return type(value).__name__


def _read_dir(path: Path, split: str, what: str) -> datasets.Dataset:
    if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        # a folder of data files: datasets picks the builder, and with none of ours would read any text file as rows
        data_files = [p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                      p.relative_to(path).parts) and p.name.lower().removesuffix(".gz").endswith(SUFFIXES)]
        if not data_files:
            shown = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
            raise UserError(f"{what}: {path} is a directory with no data file ({'/'.join(SUFFIXES)}) and is not a "
                            f"save_to_disk dataset; it holds {shown}. Give the data file itself, or the folder "
                            "save_to_disk wrote")
        return _read_hub(str(path), split, what)
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"{what}: {path} has no split {split!r}; it has {', '.join(loaded)}")
        return loaded[split]
    return loaded


def _read_hub(name: str, split: str, what: str) -> datasets.Dataset:
    try:
        rows = datasets.load_dataset(name, split=split)
    except (OSError, ValueError) as e:  # not found / offline (OSError subclasses), no such split (ValueError)
        raise UserError(f"{what}: {name!r} is not a local file or directory, and loading it as a hub dataset (split "
                        f"{split!r}) failed: {e}") from None
    if not isinstance(rows, datasets.Dataset):
        raise UserError(f"{what}: {name!r} split {split!r} did not load as one table of rows")
    return rows


def rename_text_field(rows: datasets.Dataset, column: str, what: str) -> datasets.Dataset:
    """Rows whose text is in `column` (data.text_field, TRL's dataset_text_field) with that column named `text`,
    the name the dataset formats read."""
    if column == "text":
        return rows
    if column not in rows.column_names:
        raise UserError(f"{what}: data.text_field={column!r} names no column (columns: {sorted(rows.column_names)})")
    if "text" in rows.column_names:
        raise UserError(f"{what}: data.text_field={column!r}, but the rows also hold a 'text' column; drop or rename "
                        "one of the two")
    return rows.rename_column(column, "text")
