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


class TaskRowData(vf.TaskData):
    rg_dataset: str = ""
    rg_index: int = 0


class ReasoningGymTask(vf.Task[TaskRowData]):
    """A reasoning-gym row as a verifiers task, scored by the task's own scorer on the <answer> text."""

    @vf.reward(weight=1.0)
    async def reasoning_gym(self, trace: vf.Trace) -> float:
        from reasoning_gym.utils import extract_answer

        from posttrain.data.reasoning_gym import dataset_from_key

        dataset = dataset_from_key(self.data.rg_dataset)
        answer = extract_answer(trace.last_reply)
        return 0.0 if answer is None else float(dataset.score_answer(answer, dataset[self.data.rg_index]))


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, AddConfig]):
    def __init__(self, config, source: str):
        super().__init__(config)
        self.source = source

    def load(self):
        from posttrain.data import load_rows

        for row in load_rows(self.source, what="verifiers taskset"):
            system, user = row["prompt"]
            yield ReasoningGymTask(TaskRowData(prompt=user["content"], system_prompt=system["content"],
                                               rg_dataset=row["rg_dataset"], rg_index=row["rg_index"]), self.config.task)


def reasoning_gym_tasks(task: str = "chain_sum", size: int = 8, seed: int = 3) -> ReasoningGymTaskset:
    """The rows of reasoning_gym:<task>?size=&seed= wrapped as a verifiers environment."""
    return ReasoningGymTaskset(AddConfig(id="reasoning-gym"), f"reasoning_gym:{task}?size={size}&seed={seed}")
