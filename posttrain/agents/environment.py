"""Environments: a stateful object per sample that opens the conversation and answers each of the model's turns.

    rollout:
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
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from posttrain.errors import UserError
from posttrain.rewards.load import load_callable


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> list[dict]:
        """The opening messages for this sample."""
        ...

    def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
        """(messages to append, reward of this step, done)."""
        ...


def load_environment(spec: str) -> type:
    """rollout.environment -> the class; UserError naming it when it does not import or lacks reset / step."""
    cls = load_callable(spec, "rollout.environment")
    if not isinstance(cls, type):
        raise UserError(f"rollout.environment '{spec}' is a {type(cls).__name__}; give a class with reset(row) and "
                        "step(assistant_message), made once per sample with no arguments")
    for method, arity in (("reset", 1), ("step", 1)):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise UserError(f"rollout.environment '{spec}' has no method {method}(); see docs/agents.md")
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"
                  and p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) != arity:
            raise UserError(f"rollout.environment '{spec}': {method} must take one argument besides self, "
                            f"it takes {[p.name for p in params]}")
    return cls


def check_messages(value: Any, where: str) -> list[dict]:
    """A list of {"role": str, "content": str} or a UserError saying `where` it came from."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in value):
        raise UserError(f"{where} returned {value!r:.200}; it must return a list of "
                        "{'role': str, 'content': str} messages")
    return value


class EnvironmentSession:
    """One instance of the user's environment for one sample, with every return value checked."""

    def __init__(self, cls: type, spec: str, sample: int):
        self.where = f"rollout.environment '{spec}' (sample: dataset row {sample})"
        try:
            self.env = cls()
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{self.where}: {cls.__name__}() failed: {type(e).__name__}: {e}") from e

    def reset(self, row: dict) -> list[dict]:
        messages = check_messages(self.env.reset(row), f"{self.where}.reset")
        if not messages:
            raise UserError(f"{self.where}.reset returned no messages; the conversation needs an opening turn")
        return messages

    def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
        out = self.env.step(assistant_message)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise UserError(f"{self.where}.step returned {out!r:.200}; it must return (messages, reward, done)")
        messages, reward, done = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise UserError(f"{self.where}.step returned reward {reward!r}; it must be a float")
        if not isinstance(done, bool):
            raise UserError(f"{self.where}.step returned done={done!r}; it must be a bool")
        return check_messages(messages, f"{self.where}.step"), float(reward), done
