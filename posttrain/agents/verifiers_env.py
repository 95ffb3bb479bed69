"""A verifiers (0.4) task's turns through posttrain's agent loop: `agent.environment: verifiers`.

    data:
      train: verifiers:my_envs:load_taskset        # its tasks' prompts, and the schemas of their @vf.tool methods
    rewards:
      - name: verifiers                            # the task's rubric on the whole conversation
    agent:
      environment: verifiers
      max_turns: 4

Why the loop is adapted and no OpenAI-compatible server is started for verifiers' own rollout: the trained tokens
must be exactly the sampled ones. posttrain's AgentLoop continues each turn from the trajectory's ids (token in,
token out) and appends only the chat template's delta for the tool messages; verifiers' harnesses send whole message
lists to a chat endpoint, which re-renders and re-tokenises the conversation at every turn. So posttrain keeps the
loop and asks the verifiers task only what is its own: the opening messages (reset: the row's prompt), the tools
(its toolsets' `@vf.tool` methods, called in this process with the arguments the model wrote, under the
environment's deadline, agent.user_code_timeout), and the rubric (the `verifiers` reward). The model's tool calls
are read with the template's parser (agent.tool_parser); a turn without a call ends the trajectory, as a verifiers
tool episode does. Not taken over: harnesses that run their own agent program, runtimes and sandboxes, and `@vf.stop`
predicates (agent.max_turns bounds the turns instead).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Callable

from posttrain.data.verifiers_tasks import is_verifiers_spec, task_at, task_tools
from posttrain.errors import UserError

NAME = "verifiers"


def verifiers_environment(spec: str, parse: Callable) -> type:
    """An Environment class (agents/environment.py) over the tasks of `spec`, reading tool calls with `parse`."""

    class VerifiersEnvironment:
        def reset(self, row: dict) -> list[dict]:
            self.task = task_at(spec, row["vf_index"])
            self.tools = task_tools(spec, self.task)
            return [dict(m) for m in row["prompt"]]

        def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
            calls, errors = parse(assistant_message["content"])
            if not calls and not errors:
                return [], 0.0, True
            replies = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
            for call in calls:
                replies.append({"role": "tool", "name": str(call.get("name")), "content": self._call(call)})
            return replies, 0.0, False

        def _call(self, call: dict) -> str:
            fn = self.tools.get(call.get("name"))
            if fn is None:
                return f"Error: no tool named {call.get('name')!r}; the tools are {', '.join(self.tools) or 'none'}"
            try:
                result = fn(**(call.get("arguments") or {}))
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            except Exception as e:  # noqa: BLE001 - the model reads what went wrong, as from posttrain's own tools
                return f"Error: {type(e).__name__}: {e}"
            return result if isinstance(result, str) else json.dumps(result, default=str)

    VerifiersEnvironment.__name__ = f"VerifiersEnvironment[{spec}]"
    return VerifiersEnvironment


async def _awaited(awaitable):
    return await awaitable


def check_verifiers_environment(recipe) -> str:
    """The data.train spec `agent.environment: verifiers` plays, or a UserError."""
    spec = recipe.data.train
    if not is_verifiers_spec(spec):
        raise UserError("agent.environment: verifiers plays the tasks of a verifiers environment, so data.train must "
                        f"be verifiers:<environment>, not {spec!r} (docs/environments.md)")
    return spec
