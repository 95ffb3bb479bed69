"""Reward functions written the way TRL's GRPO docs write them: they run unchanged under TRL's GRPOTrainer and here.

    posttrain grpo --config recipes/grpo.yaml \
        --reward_funcs examples/rewards/trl_rewards.py:format_reward examples/rewards/trl_rewards.py:accuracy_reward \
        --reward_weights 0.2 1.0

The data (examples/data/prompts_*.jsonl) is conversational, so each completion is a list of messages:
[{"role": "assistant", "content": "..."}]. Every function takes **kwargs: the trainer passes more than it names.
"""

import re


def format_reward(completions, **kwargs):
    """1.0 when the completion is '<think>...</think>' followed by '<answer>...</answer>', else 0.0."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content, re.DOTALL) else 0.0 for content in contents]


def accuracy_reward(completions, answer, **kwargs):
    """1.0 when the last number in the completion equals the `answer` column, else 0.0; None (not applicable)
    for a row without an answer."""
    rewards = []
    for completion, truth in zip(completions, answer):
        if truth is None:
            rewards.append(None)
            continue
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion[0]["content"])
        rewards.append(1.0 if numbers and float(numbers[-1]) == float(truth) else 0.0)
    return rewards


def brevity_reward(completions, trainer_state, log_metric=None, log_extra=None, **kwargs):
    """Shorter answers score higher, more so as training goes on (trainer_state.epoch); logs the mean length (a
    metric) and each completion's length (a column beside it in samples.jsonl)."""
    lengths = [len(completion[0]["content"]) for completion in completions]
    if log_metric is not None:
        log_metric("brevity/mean_chars", sum(lengths) / len(lengths))
    if log_extra is not None:
        log_extra("chars", lengths)
    strength = min(1.0, 0.5 + trainer_state.epoch)
    return [-strength * n / 100 for n in lengths]
