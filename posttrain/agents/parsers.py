"""Tool-call parsers: the model's turn (text) -> the calls it makes, in the format of the model's own chat template.

    agent:
      tool_parser: auto          # hermes | llama3 | auto (from the chat template) | my_module:parse

A parser takes the assistant turn's text and returns `(calls, errors)`: calls as {"name": str, "arguments": dict},
errors as messages for the calls it saw but could not read (bad JSON), which go back to the model as failed tool
calls. A custom parser `module:function` takes the text and returns a list of calls (raising ValueError for a
malformed one). Whatever the model wrote is data: a call whose name is not a string, or whose body is not an object,
goes back to the model as an error. A custom parser that raises anything else, returns something other than a list,
or runs past agent.user_code_timeout stops the run (exit 1) naming the parser and the turn.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from posttrain.errors import UserError
from posttrain.usercode import load_callable
from posttrain.usercode import UserCodeError, call_with_deadline

Parsed = tuple[list[dict], list[str]]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _read_calls(bodies, arguments_key: str = "arguments") -> Parsed:
    """Each JSON body as a call (its arguments under `arguments_key`, else "arguments"); an unreadable one: an error."""
    calls, errors = [], []
    for body in bodies:
        try:
            call = json.loads(body)
            call = {"name": call["name"], "arguments": call.get(arguments_key, call.get("arguments", {}))}
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            errors.append(f"could not read the tool call {body[:200]!r}: {type(e).__name__}: {e}")
            continue
        problem = call_problem(call)
        (errors if problem else calls).append(problem or call)
    return calls, errors


def call_problem(call) -> str:
    """Why a parsed call cannot run (the model wrote it: it goes back as an error), or '' when it can."""
    if not isinstance(call, dict) or "name" not in call:
        return f"a tool call must be an object with a name, got {call!r:.200}"
    if not isinstance(call["name"], str):
        return f"a tool call's name must be a string, got {type(call['name']).__name__} {call['name']!r:.100}"
    return ""


def parse_hermes(text: str) -> Parsed:
    """Hermes / Qwen 2.5-3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    return _read_calls(_HERMES.findall(text))


def parse_llama3(text: str) -> Parsed:
    """Llama 3.1-3.3 JSON tool calling: the whole turn is `{"name": ..., "parameters": {...}}` (optionally after
    <|python_tag|>, several separated by ';'). A turn that is not such JSON is a plain answer."""
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        return [], []
    return _read_calls((p.strip() for p in body.split(";") if p.strip()), "parameters")


TOOL_PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3": parse_llama3}

# How a chat template shows which format it teaches the model (checked in order).
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3"), ('"parameters"', "llama3"))


def _custom(spec: str, timeout: float) -> Callable[[str], Parsed]:
    fn = load_callable(spec, "agent.tool_parser")

    def parse(text: str) -> Parsed:
        what = f"agent.tool_parser '{spec}' on the model's turn {text[:80]!r}"

        def read(text: str):
            try:
                return fn(text)
            except ValueError as e:  # the documented way to say "malformed call": the model reads it
                return e

        calls = call_with_deadline(read, what, timeout, text)
        if isinstance(calls, ValueError):
            return [], [f"could not read the tool call: {calls}"]
        if not isinstance(calls, list):
            raise UserCodeError(f"{what} returned {type(calls).__name__}; it must return a list of "
                                "{'name': str, 'arguments': dict}")
        problems = [call_problem(c) for c in calls]
        return ([{"name": c["name"], "arguments": c.get("arguments", {})} for c, p in zip(calls, problems) if not p],
                [p for p in problems if p])

    return parse


def pick_parser(spec: str, chat_template, timeout: float = 60.0) -> Callable[[str], Parsed]:
    """agent.tool_parser -> a parser: a table entry, a custom import path, or (auto) the format the template uses.
    timeout: agent.user_code_timeout, for a custom parser."""
    if spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]
    if ":" in spec:
        return _custom(spec, timeout)
    if spec != "auto":
        raise UserError(f"agent.tool_parser is {spec!r}; choose auto, {', '.join(TOOL_PARSERS)} or give your own "
                        "as 'module:function'")
    text = " ".join(chat_template.values()) if isinstance(chat_template, dict) else str(chat_template or "")
    for marker, name in TEMPLATE_MARKERS:
        if marker in text:
            return TOOL_PARSERS[name]
    raise UserError("agent.tool_parser=auto: the chat template shows no tool-call format posttrain knows "
                    f"({', '.join(TOOL_PARSERS)}); set agent.tool_parser to one of them or to 'module:function'")
