"""verifiers (0.4) environments written for the tests: a single-turn one with a two-function rubric, a tool one, and
one whose rubric raises. Loaded by `data.train: verifiers:tests.integration.verifiers_envs:<function>`."""

from __future__ import annotations

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) < 20)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 8


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield AddTask(AddData(prompt=f"What is {i} + 1?", answer=str(i + 1), system_prompt="Answer briefly."),
                          self.config.task)


def single_turn(num_tasks: int = 8) -> AddTaskset:
    return AddTaskset(AddConfig(id="add", num_tasks=num_tasks))


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two whole numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return str(a + b)


class CalcTask(AddTask):
    @classmethod
    def toolsets(cls, config) -> list:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=2.0)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield CalcTask(AddData(prompt=f"Use add to compute {i} + 1.", answer=str(i + 1)), self.config.task)


def with_tools(num_tasks: int = 8) -> CalcTaskset:
    return CalcTaskset(AddConfig(id="calc", num_tasks=num_tasks))


def every_turn_calls(text: str) -> list[dict]:
    """An agent.tool_parser reading any turn as a call of add on the turn's length (a random tiny model writes no
    well-formed call)."""
    return [{"name": "add", "arguments": {"a": len(text), "b": 1}}]


class BrokenTask(AddTask):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        if self.data.answer == "3":
            raise ValueError("no score for this one")
        return 0.0


class BrokenTaskset(vf.Taskset[BrokenTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield BrokenTask(AddData(prompt=f"What is {i} + 1?", answer=str(i + 1)), self.config.task)


def broken(num_tasks: int = 4) -> BrokenTaskset:
    return BrokenTaskset(AddConfig(id="broken", num_tasks=num_tasks))
