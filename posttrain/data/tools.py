"""Tool-calling data in TRL's format: a `tools` column beside the conversation, assistant `tool_calls` and `tool`
messages inside it.

    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "tool_calls": [{"type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "name": "get_weather", "content": "22C"},
                  {"role": "assistant", "content": "It is 22C."}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": ..., "parameters": ...}}]}

A row's `tools` is a list of JSON schemas, or the same list as a JSON string (TRL's datasets store it so, since
Arrow cannot hold schemas of different shapes in one column). The chat template renders them
(`apply_chat_template(tools=)`), as TRL's SFT and DPO trainers do. Python functions (TRL's GRPOTrainer(tools=[...]))
are agent.tools (posttrain/agents/tools.py): their schemas (transformers' `get_json_schema`) join each prompt's. A template that ignores them, or that drops an assistant turn's tool calls (and so
would train an empty turn), is refused with the row named rather than trained on silently.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from posttrain.data.chat import render
from posttrain.errors import UserError


def without_nulls(value: Any) -> Any:
    """`value` with None-valued dict entries removed at every depth: Arrow gives every row of a column of objects the
    union of all rows' keys, so one row's `{"city": ...}` arguments gain another row's `"unit": None`."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def row_tools(value: Any, where: str) -> Optional[list[dict]]:
    """A row's `tools` value -> a list of JSON schemas (None for no tools); UserError naming `where` otherwise."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: column 'tools' is a string but not JSON ({e.msg}); give a list of tool schemas "
                            "or its JSON text") from None
    if not isinstance(value, list):
        raise UserError(f"{where}: column 'tools' must be a list of tool schemas, got {type(value).__name__}")
    return [_schema(tool, f"{where}: column 'tools' item {i}") for i, tool in enumerate(value)]


def _schema(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or not tool_name(tool):
        raise UserError(f"{where}: a tool schema is an object with a name ({{'type': 'function', 'function': "
                        f"{{'name': ..., 'parameters': ...}}}}), got {tool!r:.60}")
    return without_nulls(tool)


def tool_name(entry: dict) -> Optional[str]:
    """The function name of a tool schema or of a tool call, in either nesting ({"function": {"name"}} or {"name"})."""
    inner = entry.get("function") if isinstance(entry.get("function"), dict) else entry
    name = inner.get("name")
    return name if isinstance(name, str) and name else None


def check_tools_rendered(tokenizer, messages: list[dict], tools: list[dict], where: str) -> None:
    """The chat template shows `tools` (its text changes with them); else the model would train on tool calls it was
    never shown the tools for."""
    if render(tokenizer, messages, tools=tools) == render(tokenizer, messages):
        raise UserError(f"{where}: the row has a 'tools' column but the chat template ignores tools (it renders the "
                        "same text with and without them); set model.chat_template to a template with tool support, "
                        "or drop the column")


def check_tool_calls_rendered(tokenizer, messages: list[dict], tools: Optional[list[dict]], where: str) -> None:
    """Every assistant message's tool calls appear in its rendered turn (each called function's name); a template that
    drops them would train the model on an empty assistant turn."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            continue
        try:
            before = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools) if i else ""
            turn = render(tokenizer, messages[: i + 1], tools=tools)[len(before):]
        except Exception as e:  # noqa: BLE001 - jinja raises its own types for a template that cannot do this
            raise UserError(f"{where}: message {i} has tool_calls the chat template cannot render ({type(e).__name__}: "
                            f"{e}); set model.chat_template to a template that renders assistant tool calls") from None
        missing = [tool_name(c) or "?" for c in calls if not isinstance(c, dict) or (tool_name(c) or "?") not in turn]
        if missing:
            raise UserError(f"{where}: message {i} calls {', '.join(missing)} but the chat template drops assistant "
                            "tool_calls, so the turn would train as an empty answer; set model.chat_template to a "
                            "template that renders them, or drop the row")
