"""Held-out evaluation: greedy completions, exact-match accuracy and the recipe's reward for prompt data; the policy's
own preference accuracy for preference pairs (`preference_accuracy`, also the demo's metric).

    from posttrain.train.evaluation import exact_match_accuracy
    accuracy = exact_match_accuracy(model, tokenizer, prompt_examples, max_new_tokens=16)   # one process

`prompt_examples` are what `posttrain.data.tokenize_prompts` returns ({"prompt_ids", "prompt", "columns"}); the
reference answer is the `answer` column, compared by `posttrain.rewards.exact_match`. During a GRPO run the same
numbers come from `evaluate_prompts` over every rank's share of data.eval (logged as eval/accuracy, eval/reward; with
train.eval_pass_k also eval/pass_at_<k>, the unbiased pass@k from sampled completions).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.algorithms import preference_logps as pl
from posttrain.config.schema import DataConfig
from posttrain.data import collate_preference, load_rows, tokenize_preference
from posttrain.errors import UserError
from posttrain.ops.pass_at_k import pass_at_k
from posttrain.rewards import exact_match
from posttrain.generation import HFEngine, SamplingParams
from posttrain.train.scoring import score

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


def exact_match_accuracy(model, tokenizer, prompt_examples: list[dict], max_new_tokens: int,
                         batch_size: Optional[int] = 64) -> float:
    """Share of prompts whose greedy completion's final answer equals the `answer` column (one process)."""
    texts, _ = greedy_texts(HFEngine(model, tokenizer), tokenizer, prompt_examples, max_new_tokens, batch_size)
    correct, counted = accuracy_counts(prompt_examples, texts)
    return correct / counted if counted else 0.0


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
    scored = score(rewards, mine, sample, tokenizer, link.with_environment, trainer_state)
    correct, counted = accuracy_counts(mine[:real], scored.texts[:real])
    total_B = scored.total_B
    weight_B = torch.tensor(weights, dtype=torch.float64)
    length_B = torch.tensor([len(c) for c in sample.completion_ids], dtype=torch.float64)
    scored_weight_B = weight_B * scored.scored_B.double()  # TRL's nanmean: a completion no reward scored is left out
    local = torch.tensor([correct, counted, (total_B.double() * scored_weight_B).sum(), scored_weight_B.sum(),
                          (length_B * weight_B).sum(), weight_B.sum()], dtype=torch.float64)
    correct, counted, reward_sum, n_scored, length_sum, n = backend.all_reduce_sum(local.to(backend.device)).tolist()
    out = {"eval/reward": reward_sum / n_scored if n_scored else math.nan,
           "eval/completion_length": length_sum / max(n, 1.0)}
    if counted:
        out["eval/accuracy"] = correct / counted
    if pass_k:
        n = pass_k_samples or max(pass_k)
        out.update(sampled_pass_at_k(backend, link, tokenizer, mine, real, pass_k, n))
    return out


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
    texts = sample.texts(tokenizer)
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


def preference_accuracy(model_or_dir: Any, tokenizer: Any = None, examples: Any = (), *, reference: Any = None,
                        length_normalised: bool = False, batch_size: int = 16, max_length: int = 512,
                        device: Optional[str] = None) -> float:
    """Fraction of pairs whose chosen completion the model prefers: log p(chosen) > log p(rejected) under the policy,
    or, given a `reference` (model or directory), the implicit reward log-ratio (policy - reference) of chosen >
    rejected, as DPO's rewards/accuracies.

    model_or_dir: a causal LM or a Hugging Face directory (a run's final/). tokenizer: None loads it from the
    directory. examples: preference rows (dicts with prompt/chosen/rejected, as in examples/data/pref_eval.jsonl),
    a path to such a file, or tokenised pairs (prompt_ids, chosen_ids, rejected_ids). Ties count as wrong.
    """
    model, tokenizer = _model_and_tokenizer(model_or_dir, tokenizer, device)
    ref = _model_and_tokenizer(reference, tokenizer, device)[0] if reference is not None else None
    pairs = _tokenised_pairs(examples, tokenizer, max_length)
    if not pairs:
        raise UserError("preference_accuracy: no preference pairs to score")
    run_device = next(model.parameters()).device
    correct = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                batch = collate_preference(pairs[start : start + batch_size], tokenizer.pad_token_id).to(run_device)
                sums_B, counts_B = pl.sequence_logps(model, batch)
                if ref is not None:
                    sums_B = sums_B - pl.sequence_logps(ref, batch.to(next(ref.parameters()).device))[0].to(run_device)
                scores_B = pl.reduce_logps(sums_B, counts_B, length_normalised)
                chosen_P, rejected_P = pl.split_pairs(scores_B, batch.num_pairs)
                correct += int((chosen_P > rejected_P).sum())
    finally:
        model.train(was_training)
    return correct / len(pairs)


def _model_and_tokenizer(model_or_dir: Any, tokenizer: Any, device: Optional[str]):
    if not isinstance(model_or_dir, (str, Path)):
        if tokenizer is None:
            raise UserError("preference_accuracy: pass the tokenizer along with a model object")
        return model_or_dir, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_or_dir).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"preference_accuracy: {model_or_dir} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _tokenised_pairs(examples: Any, tokenizer, max_length: int) -> list[dict]:
    if isinstance(examples, (str, Path)):
        rows = load_rows(str(examples), "train", "preference_accuracy examples")
    else:
        examples = list(examples)
        if examples and "chosen_ids" in examples[0]:
            return examples
        import datasets

        rows = datasets.Dataset.from_list(examples) if examples else None
    if rows is None or len(rows) == 0:
        return []
    pairs, _ = tokenize_preference(rows, tokenizer, DataConfig(train="-", max_length=max_length), "preference_accuracy")
    return pairs
