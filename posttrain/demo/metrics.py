"""Accuracy of a model outside a run, in one process: the demo's metrics, and a user's quick check of a final/.

    from posttrain.demo.metrics import exact_match_accuracy, preference_accuracy
    accuracy = exact_match_accuracy(model, tokenizer, prompt_examples, max_new_tokens=16)
    preferred = preference_accuracy("runs/dpo/final", examples="examples/data/pref_eval.jsonl")

During a run the same numbers come from posttrain.online.evaluation over every rank's share of data.eval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.algorithms import preference_logps as pl
from posttrain.config.schema import DataConfig
from posttrain.data import collate_preference, load_rows, tokenize_preference
from posttrain.errors import UserError
from posttrain.generation import HFEngine
from posttrain.online.evaluation import accuracy_counts, greedy_texts


def exact_match_accuracy(model, tokenizer, prompt_examples: list[dict], max_new_tokens: int,
                         batch_size: Optional[int] = 64) -> float:
    """Share of prompts whose greedy completion's final answer equals the `answer` column (one process)."""
    texts, _ = greedy_texts(HFEngine(model, tokenizer), tokenizer, prompt_examples, max_new_tokens, batch_size)
    correct, counted = accuracy_counts(prompt_examples, texts)
    return correct / counted if counted else 0.0


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
