"""Environments: a stateful object per sample that opens the conversation and answers each of the model's turns.

    agent:
      environment: my_envs:GuessNumber      # a class; one instance per sample, made with no arguments

    class GuessNumber:
        def reset(self, row: dict) -> list[dict]:
            self.target = row["target"]
            return [{"role": "user", "content": "Guess my number (1-10)."}]

        def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
            guess = assistant_message["content"].strip()
            if guess == str(self.target):
                return [], 1.0, True
            return [{"role": "user", "content": "No, try again."}], 0.0, False

`reset(row)` gets the dataset row (its `prompt` and other columns) and returns the opening messages; `step` gets
the model's turn as {"role": "assistant", "content": text, "tool_calls": [...parsed calls]} and returns the messages
to append (user or tool turns), a reward for the step and whether the episode is over. The trajectory's reward from
the environment is the sum of its steps' rewards, added to the `rewards:` functions' total.

The constructor, reset and step run with a deadline (agent.user_code_timeout). One that raises, calls sys.exit /
os._exit, never returns, or returns something malformed (a NaN or infinite reward included) stops the run with
exit 1 naming the environment, the method and the sample (usercode.UserCodeError).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Protocol, runtime_checkable

from posttrain.errors import UserError
from posttrain.usercode import load_callable
from posttrain.usercode import UserCodeError, call_with_deadline


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> list[dict]:
        """The opening messages for this sample."""
        ...

    def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
        """(messages to append, reward of this step, done)."""
        ...


def load_environment(spec: str) -> type:
    """agent.environment -> the class; UserError naming it when it does not import or lacks reset / step."""
    cls = load_callable(spec, "agent.environment")
    if not isinstance(cls, type):
        raise UserError(f"agent.environment '{spec}' is a {type(cls).__name__}; give a class with reset(row) and "
                        "step(assistant_message), made once per sample with no arguments")
    for method, arity in (("reset", 1), ("step", 1)):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise UserError(f"agent.environment '{spec}' has no method {method}(); see docs/agents.md")
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"
                  and p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) != arity:
            raise UserError(f"agent.environment '{spec}': {method} must take one argument besides self, "
                            f"it takes {[p.name for p in params]}")
    return cls


def check_messages(value: Any, where: str) -> list[dict]:
    """A list of {"role": str, "content": str} or a UserCodeError saying `where` it came from."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in value):
        raise UserCodeError(f"{where} returned {value!r:.200}; it must return a list of "
                            "{'role': str, 'content': str} messages")
    return value


class EnvironmentSession:
    """One instance of the user's environment for one sample, with a deadline on each call and every return value
    checked."""

    def __init__(self, cls: type, spec: str, sample: int, timeout: float = 60.0):
        self.where = f"agent.environment '{spec}' (sample: dataset row {sample})"
        self.timeout = timeout
        self.env = call_with_deadline(cls, f"{self.where}: {cls.__name__}()", timeout)

    def reset(self, row: dict) -> list[dict]:
        where = f"{self.where}.reset"
        messages = check_messages(call_with_deadline(self.env.reset, where, self.timeout, row), where)
        if not messages:
            raise UserCodeError(f"{where} returned no messages; the conversation needs an opening turn")
        return messages

    def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
        where = f"{self.where}.step"
        out = call_with_deadline(self.env.step, where, self.timeout, assistant_message)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise UserCodeError(f"{where} returned {out!r:.200}; it must return (messages, reward, done)")
        messages, reward, done = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise UserCodeError(f"{where} returned reward {reward!r:.100}; it must be a finite float")
        if not isinstance(done, bool):
            raise UserCodeError(f"{where} returned done={done!r:.100}; it must be a bool")
        return check_messages(messages, where), float(reward), done
