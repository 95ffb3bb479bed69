"""Dataset formats, in TRL's vocabulary, found from the column names and checked row by row.

| kind              | columns                                                                   |
|-------------------|---------------------------------------------------------------------------|
| language_modeling | text (standard) or messages (conversational)                              |
| prompt_completion | prompt, completion                                                        |
| prompt_only       | prompt                                                                    |
| preference        | prompt, chosen, rejected (explicit prompt) or chosen, rejected (implicit) |

Standard rows hold strings; conversational rows hold lists of messages `{"role": ..., "content": ...}`.
Conversational rows may carry a `tools` column (TRL's tool-calling format: JSON schemas the chat template shows the
model; posttrain/data/tools.py). Other columns are kept and ignored (prompt-only data passes them to reward functions).
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets

from posttrain.data.tools import without_nulls
from posttrain.errors import UserError

EXPECTED = "text | messages | prompt + completion | prompt | prompt + chosen + rejected | chosen + rejected"
DETECTION = ((("chosen", "rejected"), "preference", "chosen"), (("prompt", "completion"), "prompt_completion", "prompt"),
             (("messages",), "language_modeling", "messages"), (("text",), "language_modeling", "text"),
             (("prompt",), "prompt_only", "prompt"))  # (columns, kind, the column that tells the row type), first wins


@dataclass(frozen=True)
class DataFormat:
    kind: str
    """language_modeling, prompt_completion, prompt_only or preference."""
    conversational: bool
    """Rows hold lists of {role, content} messages rather than strings."""
    implicit_prompt: bool = False
    """Preference rows without a prompt column: the prompt is the part chosen and rejected share."""

    def columns(self) -> tuple[str, ...]:
        """The columns this format reads."""
        return {"language_modeling": ("messages",) if self.conversational else ("text",),
                "prompt_completion": ("prompt", "completion"), "prompt_only": ("prompt",),
                "preference": ("chosen", "rejected") if self.implicit_prompt else ("prompt", "chosen", "rejected")
                }[self.kind]


def detect_format(dataset: datasets.Dataset, what: str = "data.train") -> DataFormat:
    """The format of `dataset`, after checking every row's columns; a bad row raises a UserError naming it."""
    names = set(dataset.column_names)
    found = next(((kind, key) for columns, kind, key in DETECTION if set(columns) <= names), None)
    if found is None:
        raise UserError(f"{what}: columns {sorted(names)} match no known dataset format; expected {EXPECTED}")
    kind, key = found
    if len(dataset) == 0:
        raise UserError(f"{what}: the dataset holds no rows")
    conversational = key == "messages" or isinstance(dataset[0][key], list)
    fmt = DataFormat(kind, conversational, implicit_prompt=kind == "preference" and "prompt" not in names)
    like = "" if key == "messages" else f" like row 0's {key!r}"
    # Empty strings and message lists are not errors: the tokenizers drop and count every row that would train on
    # nothing (an empty completion, chosen, rejected or prompt), the same way for every algorithm (data/tokenize.py).
    for i, row in enumerate(dataset.select_columns(list(fmt.columns()))):
        for column, value in row.items():
            _check_value(value, fmt.conversational, f"{what} row {i}: column {column!r}", like)
    return fmt


def _check_value(value, conversational: bool, where: str, like: str) -> None:
    """Raise a UserError unless `value` is a string (standard) or a list of messages (conversational), either
    possibly empty. `like` says where the expected form comes from."""
    if value is None:
        raise UserError(f"{where} is empty (null); every row needs a value")
    if not conversational:
        if not isinstance(value, str):
            got = "a list of messages" if isinstance(value, list) else f"{type(value).__name__} {value!r:.40}"
            raise UserError(f"{where} must be a string{like}, got {got}")
        return
    if not isinstance(value, list):
        raise UserError(f"{where} must be a list of messages ({{'role': ..., 'content': ...}}){like}, got "
                        f"{type(value).__name__} {value!r:.40}")
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise UserError(f"{where} message {j} needs a 'role' string; each message is {{'role': ..., 'content': ...}}")
        content = message.get("content")
        if not (isinstance(content, (str, list)) or (content is None and message.get("tool_calls"))):
            raise UserError(f"{where} message {j} needs 'content' (a string), got {content!r:.40}")


def clean_messages(messages: list[dict]) -> list[dict]:
    """Messages without the None-valued keys Arrow adds when rows' messages have different keys (tool_calls, ...),
    at any depth inside tool calls (one call's arguments gain the keys of every other call in the column)."""
    return [{k: without_nulls(v) if k == "tool_calls" else v for k, v in m.items() if v is not None}
            for m in messages]
