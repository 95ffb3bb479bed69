"""A verifiers (0.4, `verifiers.v1`) taskset as prompt data: its tasks' prompts, and what the rubric reward and the
tool environment rebuild from each row (rewards/verifiers_rubric.py, agents/verifiers_env.py).

    data:
      train: verifiers:my_envs:load_taskset?num_tasks=200      # a function (module:function) returning a Taskset
      train: verifiers:my-taskset?difficulty=2                 # or an installed taskset id (vf.load_taskset)
    rewards:
      - name: verifiers                                        # the task's @vf.reward functions, weights kept
    agent:
      environment: verifiers                                   # tasks with tools: the turns (docs/environments.md)

After `verifiers:` comes a `module:function` (or `file.py:function`) called with the query's arguments (YAML
values), returning a `vf.Taskset` or a `vf.Env` (its taskset is used), or an installed taskset id, whose config
type takes the arguments. Each row: `prompt` (the task's system prompt and prompt as messages), `vf_taskset` (the
spec) and `vf_index` (the task's position), and `tools` (the JSON schemas of the task's `@vf.tool` methods, which
the chat template shows) when its toolsets have any. Needs the `envs` extra (pip install 'posttrain[envs]').
"""

from __future__ import annotations

import asyncio
import functools
import urllib.parse
from typing import Any, Callable

import datasets
import yaml

from posttrain.errors import UserError, require_package
from posttrain.usercode import load_callable

PREFIX = "verifiers:"
COLUMNS = ("vf_taskset", "vf_index")


def is_verifiers_spec(source) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)  # a Path object is data on disk


def require_verifiers(what: str):
    return require_package("verifiers.v1", what, "verifiers")


def _arguments(query: str) -> dict[str, Any]:
    out = {}
    for key, text in urllib.parse.parse_qsl(query, keep_blank_values=True):
        try:
            out[key] = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            out[key] = text
    return out


@functools.lru_cache(maxsize=8)
def load_taskset(spec: str, what: str = "data.train"):
    """The taskset a `verifiers:` spec names, as a list of tasks (built once per spec)."""
    vf = require_verifiers(f"{what} (a verifiers: environment)")
    target, _, query = spec[len(PREFIX):].partition("?")
    arguments = _arguments(query)
    try:
        if ":" in target:
            made = load_callable(target, what)(**arguments)
        else:
            from verifiers.v1.utils.loaders import taskset_config_type

            made = vf.load_taskset(taskset_config_type(target)(id=target, **arguments))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's loader or verifiers' config validation
        raise UserError(f"{what}: loading the verifiers environment {target!r} with {arguments} failed: "
                        f"{type(e).__name__}: {e}") from None
    taskset = getattr(made, "taskset", made)
    if not isinstance(taskset, vf.Taskset):
        raise UserError(f"{what}: {target!r} returned a {type(made).__name__}; it must return a verifiers.v1 Taskset "
                        "or Env")
    tasks = list(taskset)
    if not tasks:
        raise UserError(f"{what}: the verifiers environment {target!r} has no tasks")
    return taskset, tasks


def task_at(spec: str, index: int):
    return load_taskset(spec)[1][int(index)]


def task_tools(spec: str, task) -> dict[str, Callable]:
    """name -> bound `@vf.tool` method of the toolsets of the task's taskset and of the task itself."""
    from verifiers.v1.utils.decorators import discover_decorated

    taskset = load_taskset(spec)[0]
    toolsets = [*type(taskset).toolsets(taskset.config), *type(task).toolsets(task.config)] \
        if hasattr(type(task), "toolsets") else list(type(taskset).toolsets(taskset.config))
    return {getattr(fn, "tool_name", None) or fn.__name__: fn for toolset in toolsets
            for fn in discover_decorated(toolset, "tool")}


def _schemas(tools: dict[str, Callable], what: str) -> list[dict] | None:
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in tools.items():
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers raises several types for a signature it cannot read
            raise UserError(f"{what}: the verifiers tool '{name}' has no usable signature for a tool schema "
                            f"({type(e).__name__}: {e}); give it type hints and a docstring with Args") from None
        schema["function"]["name"] = name
        schemas.append(schema)
    return schemas or None


def prompt_messages(task) -> list[dict]:
    """The task's opening as chat messages: its system prompt, then its prompt (text or messages)."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    for m in data.prompt or []:
        message = m.model_dump() if hasattr(m, "model_dump") else dict(m)
        messages.append({"role": message["role"], "content": str(message.get("content") or "")})
    return messages


def verifiers_rows(source: str, what: str) -> datasets.Dataset:
    """The rows of a `verifiers:` spec (see the module docstring)."""
    _, tasks = load_taskset(source, what)
    rows = []
    for i, task in enumerate(tasks):
        row = {"prompt": prompt_messages(task), "vf_taskset": source, "vf_index": i}
        schemas = _schemas(task_tools(source, task), what)
        if schemas:
            row["tools"] = schemas
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def trace_of(task, messages: list[dict]):
    """A verifiers Trace of one finished conversation (the prompt's messages, then the model's and the tools'), the
    model's turns marked sampled, for the task's scoring."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    def typed(i: int, m: dict):
        role, content = m["role"], str(m.get("content") or "")
        if role == "assistant":
            return vf.AssistantMessage(content=content)
        if role == "tool":
            return vf.ToolMessage(content=content, tool_call_id=f"call_{i}", name=m.get("name"))
        return (vf.SystemMessage if role == "system" else vf.UserMessage)(content=content)

    nodes = [MessageNode(parent=None if i == 0 else i - 1, message=typed(i, m), sampled=m["role"] == "assistant")
             for i, m in enumerate(messages)]
    return vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data),
                    agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)


def score_conversation(spec: str, index: int, messages: list[dict]) -> dict[str, tuple[float, float]]:
    """The task's rubric on a conversation: {reward name: (score, weight)} (its own event loop: called from a
    reward thread)."""
    task = task_at(spec, index)
    trace = trace_of(task, messages)
    asyncio.run(task.score(trace))
    return {name: (r.score, r.weight) for name, r in trace.rewards.items() if r is not None}
