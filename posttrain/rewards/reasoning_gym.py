"""The `reasoning_gym` built-in reward: each row's own task scores the answer the prompt asked for.

    data:
      train: reasoning_gym:basic_arithmetic?size=2000      # rows with rg_dataset / rg_index (data/reasoning_gym.py)
    rewards:
      - name: reasoning_gym

The answer is the text between the last <answer> and </answer> tags (what every reasoning-gym system prompt asks
for, read with reasoning-gym's own `extract_answer`); the score is the row's dataset's `score_answer(answer, entry)`
on the entry rebuilt from `rg_dataset` / `rg_index` (a composite dataset hands it to the row's own task), in [0, 1]:
0.0 without an answer. Each score is also logged per task (log_metric `reasoning_gym/<task>`: the step's mean is
that task's accuracy on the training rollouts; held-out figures: eval/reasoning_gym/<task>, drawn with it in the report).
"""

from __future__ import annotations

from typing import Callable, Optional

from posttrain.data.reasoning_gym import dataset_from_key, require_reasoning_gym
from posttrain.rewards.contract import completion_text, require_source_columns

COLUMNS = ("rg_dataset", "rg_index")


def reasoning_gym(completions: list, log_metric: Optional[Callable[[str, float], None]] = None,
                  tag: str = "answer", **kwargs) -> list[Optional[float]]:
    """The row's task's score of the completion's <tag> answer (see the module docstring); None for a row that is
    not a reasoning-gym row (rg_dataset null)."""
    require_source_columns(kwargs, COLUMNS, "reasoning_gym", "reasoning_gym:<task>")
    from reasoning_gym.utils import extract_answer

    out = []
    for completion, key, index, task in zip(completions, kwargs["rg_dataset"], kwargs["rg_index"],
                                            kwargs.get("task") or [None] * len(completions)):
        if key is None:
            out.append(None)
            continue
        dataset = dataset_from_key(key)
        entry = dataset[int(index)]
        answer = extract_answer(completion_text(completion), tag_name=tag)
        score = 0.0 if answer is None else float(dataset.score_answer(answer, entry))
        out.append(score)
        if log_metric is not None:
            log_metric(f"reasoning_gym/{task or entry['metadata'].get('source_dataset')}", score)
    return out


def check(kwargs: dict) -> None:
    require_reasoning_gym("reward reasoning_gym")
