"""The `verifiers` built-in reward: a verifiers (0.4) task's own rubric, its `@vf.reward` functions with their weights.

    data:
      train: verifiers:my_envs:load_taskset            # rows with vf_taskset / vf_index (data/verifiers_tasks.py)
    rewards:
      - name: verifiers

Each completion becomes a verifiers Trace (the row's prompt messages, then the completion's: the model's turns, and
in a multi-turn run the tool messages between them) scored by the row's task (`Task.score`); the reward is the
weighted sum of its reward functions, as verifiers totals them (`Trace.reward`), and each function's score is logged
under its own name (log_metric `verifiers/<function>`: the step's mean). A reward function that raises stops the run
naming it and the sample (rewards/combine.py re-runs the batch one sample at a time to find it), or counts as
missing with on_error: skip.
"""

from __future__ import annotations

from typing import Callable, Optional

from posttrain.data.verifiers_tasks import COLUMNS, require_verifiers, score_conversation
from posttrain.rewards.contract import require_source_columns


def _messages(prompt, completion) -> list[dict]:
    opening = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else \
        [dict(m) for m in completion]
    return opening + reply


def verifiers(prompts: list, completions: list, log_metric: Optional[Callable[[str, float], None]] = None,
              **kwargs) -> list[Optional[float]]:
    """The row's task's weighted rubric total per completion (see the module docstring); None for a row that is not
    a verifiers row."""
    require_source_columns(kwargs, COLUMNS, "verifiers", "verifiers:<environment>")
    out = []
    for prompt, completion, spec, index in zip(prompts, completions, kwargs["vf_taskset"], kwargs["vf_index"]):
        if spec is None:
            out.append(None)
            continue
        scores = score_conversation(spec, index, _messages(prompt, completion))
        for name, (score, _) in scores.items():
            if log_metric is not None:
                log_metric(f"verifiers/{name}", score)
        out.append(sum(score * weight for score, weight in scores.values()))
    return out


def check(kwargs: dict) -> None:
    require_verifiers("reward verifiers")
