"""Held-out evaluation of a sampled run: greedy completions, exact-match accuracy and the recipe's reward for prompt
data, and pass@k from sampled completions (one process, outside a run: posttrain.demo.metrics).

`prompt_examples` are what `posttrain.data.tokenize_prompts` returns ({"prompt_ids", "prompt", "columns"}); the
reference answer is the `answer` column, compared by `posttrain.rewards.exact_match`. During a GRPO run the same
numbers come from `evaluate_prompts` over every rank's share of data.eval (logged as eval/accuracy, eval/reward; with
train.eval_pass_k also eval/pass_at_<k>, the unbiased pass@k from sampled completions).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from posttrain.errors import UserError
from posttrain.ops.pass_at_k import pass_at_k
from posttrain.rewards import exact_match
from posttrain.generation import SamplingParams
from posttrain.online.scoring import score

ANSWER_COLUMN = "answer"


def greedy_texts(engine, tokenizer, examples: list[dict], max_new_tokens: int, per_call: Optional[int] = None):
    """Greedy completion of each example as (texts, token ids), `per_call` prompts per engine call (None: all)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    per_call = per_call or len(examples)
    ids: list[list[int]] = []
    for start in range(0, len(examples), per_call):
        ids += engine.generate([e["prompt_ids"] for e in examples[start : start + per_call]], params).completion_ids
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids


def accuracy_counts(examples: list[dict], texts: list[str]) -> tuple[int, int]:
    """(correct, with a reference) by exact match against the `answer` column; (0, 0) when the data has none."""
    references = [e["columns"].get(ANSWER_COLUMN) for e in examples]
    scores = exact_match(completions=texts, answer=references)
    counted = [s for s in scores if s is not None]
    return int(sum(counted)), len(counted)


def evaluate_prompts(backend, link, tokenizer, examples: list[dict], rewards, trainer_state=None,
                     pass_k: tuple[int, ...] = (), pass_k_samples: int = 0) -> dict[str, float]:
    """eval/accuracy, eval/reward and eval/completion_length over the whole eval set, every rank taking a strided
    share, greedy, through the run's engine link (train/engine_link.py; a multi-turn run's trajectories are scored
    whole, the environment's reward added). Shares are padded to equal size (fillers are not counted) so every rank
    makes the same engine calls. trainer_state: what
    the reward functions get as trainer_state (TRL passes the trainer's during evaluation too). pass_k: also
    eval/pass_at_<k> for each k (`sampled_pass_at_k`), from pass_k_samples (0: max k) completions per prompt sampled
    with the recipe's generation settings, seeded by the link's seed."""
    share = -(-len(examples) // backend.world_size)
    mine = examples[backend.rank :: backend.world_size]
    real = len(mine)  # then fillers
    weights = [1.0] * real + [0.0] * (share - real)
    mine = mine + [examples[0]] * (share - real)
    sample = link.sample(mine, list(range(len(mine))), greedy=True)
    texts, scores = score(rewards, mine, sample, tokenizer, link.with_environment, trainer_state)
    correct, counted = accuracy_counts(mine[:real], texts[:real])
    total_B = scores.total_B
    weight_B = torch.tensor(weights, dtype=torch.float64)
    length_B = torch.tensor([len(c) for c in sample.completion_ids], dtype=torch.float64)
    scored_weight_B = weight_B * scores.scored_B.double()  # TRL's nanmean: a completion no reward scored is left out
    local = torch.tensor([correct, counted, (total_B.double() * scored_weight_B).sum(), scored_weight_B.sum(),
                          (length_B * weight_B).sum(), weight_B.sum()], dtype=torch.float64)
    correct, counted, reward_sum, n_scored, length_sum, n = backend.all_reduce_sum(local.to(backend.device)).tolist()
    out = {"eval/reward": reward_sum / n_scored if n_scored else math.nan,
           "eval/completion_length": length_sum / max(n, 1.0)}
    if counted:
        out["eval/accuracy"] = correct / counted
    out.update(per_task(backend, examples, mine[:real], scores.per_function))
    if pass_k:
        n = pass_k_samples or max(pass_k)
        out.update(sampled_pass_at_k(backend, link, tokenizer, mine, real, pass_k, n))
    return out


TASK_COLUMN = "task"


def per_task(backend, examples: list[dict], mine: list[dict], per_function: dict) -> dict[str, float]:
    """eval/<reward>/<task> for data with a `task` column (a reasoning_gym: source writes it; mixed tasks): each
    reward function's mean over that task's held-out rows, the rows it gave no value left out. The tasks come from
    the whole eval set, so every rank reduces the same figures; the report draws eval/<reward>/<task> with the
    training metric <reward>/<task> a reward logs
    (rewards/reasoning_gym.py)."""
    if not examples or TASK_COLUMN not in examples[0]["columns"]:
        return {}
    tasks = sorted({str(e["columns"][TASK_COLUMN]) for e in examples})
    names = sorted(per_function)
    mine_tasks = [str(e["columns"][TASK_COLUMN]) for e in mine]
    local = torch.zeros(len(tasks), len(names), 2, dtype=torch.float64)  # (sum, count) per task and reward
    for j, name in enumerate(names):
        values_B = per_function[name][: len(mine)].double()
        for i, task in enumerate(tasks):
            take_B = torch.tensor([t == task for t in mine_tasks], dtype=torch.bool) & ~values_B.isnan()
            local[i, j] = torch.stack([values_B[take_B].sum(), take_B.sum().double()])
    totals = backend.all_reduce_sum(local.to(backend.device)).cpu()
    return {f"eval/{name}/{task}": float(totals[i, j, 0] / totals[i, j, 1])
            for i, task in enumerate(tasks) for j, name in enumerate(names) if totals[i, j, 1] > 0}


def check_eval_settings(recipe, algorithm) -> None:
    """train.eval_pass_k acts only where completions of data.eval are sampled: an online algorithm with data.eval.
    Anywhere else it was accepted and did nothing."""
    if not recipe.train.eval_pass_k:
        return
    if algorithm.source_kind != "rollout":
        raise UserError("train.eval_pass_k samples completions of data.eval's prompts, which only the online "
                        "algorithms do (grpo, ppo); this command evaluates by its loss: drop train.eval_pass_k")
    if not recipe.data.eval:
        raise UserError("train.eval_pass_k evaluates on data.eval, which is not set: nothing would be evaluated; "
                        "set data.eval (prompts with an 'answer' column) or drop train.eval_pass_k")


def check_answer_columns(recipe, algorithm, train_examples: list[dict], eval_examples: Optional[list[dict]]) -> None:
    """What compares completions with the `answer` column finds it, before any model loads: dynamic sampling on
    accuracy (data.train) and train.eval_pass_k (data.eval)."""
    needs = []
    dynamic = algorithm.dynamic_sampling
    if dynamic is not None and dynamic.metric == "accuracy":
        needs.append(("data.train", train_examples, "algo.dynamic_sampling.metric=accuracy",
                      "or set algo.dynamic_sampling.metric=reward"))
    if recipe.train.eval_pass_k and eval_examples is not None:  # without data.eval nothing is evaluated at all
        needs.append(("data.eval", eval_examples, "train.eval_pass_k", "or drop train.eval_pass_k"))
    for where, examples, what, otherwise in needs:
        if examples and ANSWER_COLUMN not in examples[0]["columns"]:
            columns = ", ".join(sorted(examples[0]["columns"])) or "none"
            raise UserError(f"{what} compares completions with the '{ANSWER_COLUMN}' column, which {where} does not "
                            f"have (columns: {columns}); add it, {otherwise}")


EVAL_POSITIONS = 2**40
"""Where evaluation's sampling positions start: beyond every training prompt's position in the global order."""


def sampled_pass_at_k(backend, link, tokenizer, examples: list[dict], real: int, ks: tuple[int, ...],
                      n: int) -> dict[str, float]:
    """eval/pass_at_<k>: the unbiased estimator (posttrain.ops.pass_at_k) over the prompts with a reference, from n
    completions of each sampled through the engine link at generation.temperature and judged by exact match against
    the `answer` column. `examples` is this rank's share padded to the same size on every rank (the same engine
    calls everywhere); the first `real` count. The draws are seeded by positions past any training prompt's
    (EVAL_POSITIONS), so evaluation never repeats a training draw and does not move the training stream."""
    share_start = EVAL_POSITIONS + backend.rank * len(examples)
    sample = link.sample(examples, [share_start + i for i in range(len(examples))], group=n)
    texts = sample.completion_texts(tokenizer)
    references = [e["columns"].get(ANSWER_COLUMN) for e in examples for _ in range(n)]
    scores = exact_match(completions=texts, answer=references)
    correct = [-1 if scores[i] is None else int(sum(scores[i : i + n])) for i in range(0, len(texts), n)]
    scored_P = torch.tensor(correct[:real], dtype=torch.long)
    scored_P = scored_P[scored_P >= 0]  # prompts without a reference are not counted
    sums = [pass_at_k(torch.full_like(scored_P, n), scored_P, k).sum() for k in ks]
    local = torch.tensor([float(len(scored_P)), *map(float, sums)], dtype=torch.float64)
    counted, *totals = backend.all_reduce_sum(local.to(backend.device)).tolist()
    return {f"eval/pass_at_{k}": total / counted for k, total in zip(ks, totals)} if counted else {}


def evaluate_online(backend, source, tokenizer, eval_examples, rewards, recipe) -> dict[str, float]:
    """An online algorithm's held-out figures (`evaluate_prompts`, with train.eval_pass_k) with the rollout source's
    engine, so evaluation runs wherever generation does, on the current policy's weights (an engine holding a copy is
    synced first)."""
    source.before_evaluation()
    t = recipe.train
    return evaluate_prompts(backend, source.link, tokenizer, eval_examples, rewards, source.trainer_state(),
                            t.eval_pass_k, t.eval_pass_k_samples)
