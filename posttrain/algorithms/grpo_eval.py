"""Held-out evaluation for prompt data: greedy completions, exact-match accuracy and the recipe's reward.

    from posttrain.algorithms.grpo_eval import exact_match_accuracy
    accuracy = exact_match_accuracy(model, tokenizer, prompt_examples, max_new_tokens=16)   # one process

`prompt_examples` are what `posttrain.data.tokenize_prompts` returns ({"prompt_ids", "prompt", "columns"}); the
reference answer is the `answer` column, compared by `posttrain.rewards.exact_match`. During a GRPO run the same
numbers come from `evaluate_prompts` over every rank's share of data.eval (logged as eval/accuracy, eval/reward).
"""

from __future__ import annotations

from typing import Optional

import torch

from posttrain.rewards import exact_match
from posttrain.rollout import SamplingParams

ANSWER_COLUMN = "answer"


def greedy_texts(engine, tokenizer, examples: list[dict], max_new_tokens: int, per_call: Optional[int] = None):
    """Greedy completion of each example as (texts, token ids), `per_call` prompts per engine call (None: all)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    per_call = per_call or len(examples)
    ids: list[list[int]] = []
    for start in range(0, len(examples), per_call):
        ids += engine.generate([e["prompt_ids"] for e in examples[start : start + per_call]], params).completion_ids
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids


def greedy_trajectories(agent, examples: list[dict], max_new_tokens: int, per_call: Optional[int] = None):
    """A multi-turn run's held-out trajectories (posttrain.agents.AgentRollout), greedy, `per_call` prompts per
    batch of turns."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    per_call = per_call or len(examples)
    out = []
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        out += agent.run(chunk, list(range(start, start + len(chunk))), params)
    return out


def accuracy_counts(examples: list[dict], texts: list[str]) -> tuple[int, int]:
    """(correct, with a reference) by exact match against the `answer` column; (0, 0) when the data has none."""
    references = [e["columns"].get(ANSWER_COLUMN) for e in examples]
    scores = exact_match([e["prompt"] for e in examples], texts, answer=references)
    counted = [s for s in scores if s is not None]
    return int(sum(counted)), len(counted)


def exact_match_accuracy(model, tokenizer, prompt_examples: list[dict], max_new_tokens: int,
                         batch_size: Optional[int] = 64) -> float:
    """Share of prompts whose greedy completion's final answer equals the `answer` column (one process)."""
    from posttrain.rollout import HFEngine

    texts, _ = greedy_texts(HFEngine(model, tokenizer), tokenizer, prompt_examples, max_new_tokens, batch_size)
    correct, counted = accuracy_counts(prompt_examples, texts)
    return correct / counted if counted else 0.0


def evaluate_prompts(backend, engine, tokenizer, examples: list[dict], rewards, generation,
                     agent=None) -> dict[str, float]:
    """eval/accuracy, eval/reward and eval/completion_length over the whole eval set, every rank taking a strided
    share. Shares are padded to equal size (fillers are not counted) so every rank makes the same engine calls.
    agent: multi-turn trajectories instead, their last model turn scored (and the environment's reward added)."""
    share = -(-len(examples) // backend.world_size)
    mine = examples[backend.rank :: backend.world_size]
    weights = [1.0] * len(mine) + [0.0] * (share - len(mine))
    mine = mine + [examples[0]] * (share - len(mine))
    score = rewards.score
    with backend.autocast():
        if agent is not None:
            from posttrain.agents import score_trajectories

            trajectories = greedy_trajectories(agent, mine, generation.max_completion_length, generation.batch_size)
            texts, ids = [t.final_text for t in trajectories], [t.completion_ids for t in trajectories]
            score = score_trajectories(rewards, trajectories, agent.environment is not None)
        else:
            texts, ids = greedy_texts(engine, tokenizer, mine, generation.max_completion_length, generation.batch_size)
    real = [i for i, w in enumerate(weights) if w]
    correct, counted = accuracy_counts([mine[i] for i in real], [texts[i] for i in real])
    columns = {k: [e["columns"][k] for e in mine] for k in mine[0]["columns"]}
    columns.setdefault("completion_ids", ids)
    total_B, _, _ = score([e["prompt"] for e in mine], texts, columns)
    weight_B = torch.tensor(weights, dtype=torch.float64)
    local = torch.stack([
        torch.tensor(float(correct), dtype=torch.float64), torch.tensor(float(counted), dtype=torch.float64),
        (total_B.double() * weight_B).sum(),
        (torch.tensor([len(c) for c in ids], dtype=torch.float64) * weight_B).sum(),
        weight_B.sum(),
    ])
    correct, counted, reward_sum, length_sum, n = backend.all_reduce_sum(local.to(backend.device)).tolist()
    out = {"eval/reward": reward_sum / max(n, 1.0), "eval/completion_length": length_sum / max(n, 1.0)}
    if counted:
        out["eval/accuracy"] = correct / counted
    return out
