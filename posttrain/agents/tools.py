"""Tools: plain Python functions the model may call, named in the recipe, each call run in a process of its own.

    agent:
      tools: [my_tools:calculator, tools/search.py:lookup]

A tool is a function with type hints and a Google-style docstring (its description and an `Args:` line per
parameter); transformers' `get_json_schema` turns it into the JSON schema the chat template shows the model
(`apply_chat_template(tools=[...])`). The model's call `{"name": "calculator", "arguments": {"expression": "2+3"}}`
runs as `calculator(expression="2+3")`; what it returns comes back to the model as a tool message, as `str(result)`
(JSON for dicts and lists), cut to `agent.tool_max_output_chars`.

Each call runs in a forked child process with a deadline (`agent.tool_timeout`): a tool that hangs is killed, one
that raises or crashes its process gives the model an error message, and neither stops the batch. The counts go to
the step's metrics (tools/errors, tools/timeouts).

No process a tool starts outlives its call: the child leads a process group of its own, killed whole once the call
is over (a `subprocess.Popen(["sleep", "300"])` left running included), and every process it starts carries
POSTTRAIN_TOOL_OF=<this process's id> in its environment, so those that left the group (a new session) are found
and killed after each batch of calls and at exit. The child takes the default SIGTERM / SIGINT handlers: it must
not inherit the run's graceful-stop handler, which would keep it alive through the kill on timeout.
"""

from __future__ import annotations

import atexit
import json
import math
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from posttrain.errors import UserError
from posttrain.usercode import load_callable


@dataclass(frozen=True)
class Tool:
    name: str
    """The name the model calls it by (the function's __name__)."""
    fn: Callable
    """The function itself."""
    schema: dict
    """Its JSON schema ({"type": "function", "function": {...}}), as chat templates take it."""


def load_tools(specs: tuple[str, ...]) -> dict[str, Tool]:
    """agent.tools -> {name: Tool}; UserError naming the entry when it does not import, is not a function, has no
    usable signature (type hints + docstring with Args), or repeats another tool's name."""
    from transformers.utils import get_json_schema

    tools: dict[str, Tool] = {}
    for spec in specs:
        fn = load_callable(spec, "agent.tools entry")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers raises several types for a signature it cannot read
            raise UserError(f"agent.tools entry '{spec}': no usable signature for a tool schema ({type(e).__name__}: "
                            f"{e}); give every parameter a type hint and the docstring a description and an 'Args:' "
                            "line per parameter") from None
        name = schema["function"]["name"]
        if name in tools:
            raise UserError(f"agent.tools entry '{spec}': a tool named '{name}' is already listed; rename one")
        tools[name] = Tool(name, fn, schema)
    return tools


def opening_tools(agent) -> Optional[list[dict]]:
    """What tokenize_prompts(rollout_tools=) takes for `agent` (recipe.agent): the tools' schemas when a multi-turn
    episode opens from the dataset's prompts (the agent loop on, no environment: an environment writes its own
    opening); None otherwise."""
    if not agent.enabled or agent.environment:
        return None
    return [t.schema for t in load_tools(agent.tools).values()]


@dataclass(frozen=True)
class ToolResult:
    content: str
    """What the model reads in the tool message."""
    error: bool
    """The call failed: unknown tool, bad arguments, an exception, a crash or a timeout."""
    timed_out: bool
    """The call ran past agent.tool_timeout and its process was killed."""
    seconds: float
    """Wall time of the call."""


def _render(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


OWNER_VARIABLE = "POSTTRAIN_TOOL_OF"


def _child(fn: Callable, arguments: dict, limit: int, conn) -> None:
    """In the forked process: call, render, cut, send back (ok, text). Only the capped text crosses the pipe."""
    os.setpgid(0, 0)  # a group of its own: killed whole when the call is over
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.environ[OWNER_VARIABLE] = str(os.getppid())
    try:
        text, ok = _render(fn(**arguments)), True
    except BaseException as e:  # noqa: BLE001 - whatever the tool raises is the model's to read
        text, ok = f"{type(e).__name__}: {e}", False
    conn.send((ok, text[:limit]))
    conn.close()


def kill_strays(owner: int) -> int:
    """Kill every process whose environment says a tool of process `owner` started it (those that left the tool's
    process group); returns how many. Linux only (/proc); elsewhere the group kill is all there is."""
    killed = 0
    mark = f"{OWNER_VARIABLE}={owner}".encode()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
            killed += 1
        except OSError:  # gone meanwhile, or another user's
            continue
    return killed


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # the group is empty: the tool and everything it started are gone
        pass


class ToolRunner:
    """Runs tool calls, several at once, each in a forked process with a deadline and an output cap."""

    def __init__(self, tools: dict[str, Tool], timeout: float, max_output_chars: int, workers: int):
        if not (math.isfinite(timeout) and timeout > 0):
            raise UserError(f"agent.tool_timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.tools, self.timeout, self.limit, self.workers = tools, timeout, max_output_chars, workers
        self._context = multiprocessing.get_context("fork")  # the child inherits the tools: no pickling, no import
        if tools:
            atexit.register(kill_strays, os.getpid())

    def run(self, calls: list[dict]) -> list[ToolResult]:
        """One result per call ({"name", "arguments"}), in order; at most `workers` processes at a time."""
        try:
            return [result for start in range(0, len(calls), self.workers)
                    for result in self._run_together(calls[start : start + self.workers])]
        finally:
            if calls:
                kill_strays(os.getpid())

    def _run_together(self, calls: list[dict]) -> list[ToolResult]:
        started = time.perf_counter()
        running: list[Any] = []
        for call in calls:
            name = call.get("name") if isinstance(call, dict) else None
            tool = self.tools.get(name) if isinstance(name, str) else None
            arguments = call.get("arguments") if isinstance(call, dict) else None
            if not isinstance(name, str):  # the model's own output: data, never a crash (a list is unhashable)
                running.append(f"a tool call's name must be a string, got {type(name).__name__} {name!r:.100}")
            elif tool is None:
                running.append(f"unknown tool {name!r:.100}; the tools are: {', '.join(self.tools)}")
            elif not isinstance(arguments, dict):
                running.append(f"the arguments of {tool.name} must be a JSON object, got {type(arguments).__name__}")
            else:
                receive, send = self._context.Pipe(duplex=False)
                process = self._context.Process(target=_child, args=(tool.fn, arguments, self.limit, send), daemon=True)
                process.start()
                send.close()
                running.append((process, receive))
        deadline = started + self.timeout
        return [ToolResult(f"Error: {item}"[: self.limit], True, False, 0.0) if isinstance(item, str)
                else self._collect(*item, deadline, started) for item in running]

    def _collect(self, process, receive, deadline: float, started: float) -> ToolResult:
        try:
            if receive.poll(max(0.0, deadline - time.perf_counter())):
                ok, text = receive.recv()
                process.join(timeout=1.0)
                return ToolResult(text if ok else f"Error: {text}"[: self.limit], not ok, False,
                                  time.perf_counter() - started)
            timed_out = process.is_alive()
            message = (f"Error: the tool did not return within {self.timeout:g}s" if timed_out
                       else f"Error: the tool's process died (exit code {process.exitcode})")
            return ToolResult(message, True, timed_out, time.perf_counter() - started)
        except EOFError:  # the child died after the poll said data or end of file was there
            process.join(timeout=1.0)
            return ToolResult(f"Error: the tool's process died (exit code {process.exitcode})", True, False,
                              time.perf_counter() - started)
        finally:
            _kill_group(process.pid)  # the tool's process and whatever it started in its group
            if process.is_alive():
                process.kill()
            process.join()
            receive.close()
