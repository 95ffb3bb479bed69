"""docs/rewards.md's examples run as written: every ```python block is executed and its functions are scored by
RewardSet the way a run calls them (TRL's contract), on standard, conversational and multi-turn completions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from posttrain.rewards import RewardSet, TrainerState, as_completions
from posttrain.rewards.combine import Reward

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


@pytest.fixture(scope="module")
def doc():
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL):
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


def score(doc, name, prompts, completions, columns=None, ids=None, state=None):
    return RewardSet([Reward(name, doc[name])]).score(prompts, completions, columns, ids, state)


def test_standard_examples(doc):
    prompts = ["What is 2 + 3?", "What is 1 + 1?"]
    texts = ["so \\boxed{5}", "\\boxed{3}"]
    assert score(doc, "reward_len", prompts, texts, ids=[[1, 2], [3]]).total_B.tolist() == [2.0, 1.0]
    assert score(doc, "boxed_accuracy", prompts, texts, {"ground_truth": ["5", "2"]}).total_B.tolist() == [1.0, 0.0]


def test_conversational_examples(doc):
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
    completions = as_completions(prompts, ["<think>add</think> <answer>5</answer>", "<answer>6</answer>"])
    assert score(doc, "format_reward", prompts, completions).total_B.tolist() == [1.0, 0.0]
    assert score(doc, "accuracy_reward", prompts, completions, {"answer": ["5", "5"]}).total_B.tolist() == [1.0, 0.0]


def test_none_per_task_async_and_trainer_state(doc):
    prompts, texts = ["p"] * 3, ["4", "a\nb\nc\nd", "please do"]
    rewards = RewardSet([Reward("math_reward", doc["math_reward"]), Reward("poem_reward", doc["poem_reward"]),
                         Reward("judge_reward", doc["judge_reward"], 0.5)])
    scores = rewards.score(prompts, texts, {"task": ["math", "poem", "chat"], "answer": ["4", None, None]})
    assert scores.total_B.tolist() == [1.0, 1.0, 0.5]
    assert scores.per_function["math_reward"][1:].isnan().all() and scores.skipped == 4

    scores = score(doc, "curriculum_brevity", prompts[:2], ["12345", "1"], state=TrainerState(global_step=50))
    assert scores.total_B.tolist() == pytest.approx([-0.025, -0.005])
    assert scores.logged.metrics == {"brevity/mean_chars": [3.0]} and scores.logged.extra == {"chars": [5, 1]}


def test_multi_turn_example(doc):
    trajectory = [{"role": "assistant", "content": "<tool_call>add(2, 3)</tool_call>"},
                  {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]]
    assert score(doc, "final_answer_reward", prompts, [trajectory], {"answer": ["5"]}).total_B.tolist() == [1.0]
