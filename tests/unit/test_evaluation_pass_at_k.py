"""train.eval_pass_k's evaluation path on the tiny model: sampled completions judged by exact match, the unbiased
estimator over the prompts with a reference, fillers and reference-less prompts not counted."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config.schema import GenerationConfig, Recipe
from posttrain.generation import HFEngine, SamplingParams
from posttrain.rewards import RewardSet
from posttrain.online.engine_link import EngineLink
from posttrain.online.evaluation import evaluate_prompts


def test_pass_at_k_counts_prompts_with_a_reference(tiny_model_dir, tmp_path):
    from posttrain.distributed.backend import Backend

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, tokenizer)
    prompts = ["3 + 4 =", "the cat sat on", "1 2 3 4", "what is 9 * 9?", "no reference here"]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    greedy = engine.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0)).completion_ids
    greedy_texts = tokenizer.batch_decode(greedy, skip_special_tokens=True)
    # at temperature 1e-3 every sample is the greedy completion: prompts 0 and 2 are always right (c = n), 1 and 3
    # never (c = 0), 4 has no reference; so pass@k = 2/4 for every k, and the greedy accuracy is 2/4 too
    answers = [greedy_texts[0], "zzz never zzz", greedy_texts[2], "qqq never qqq", None]
    examples = [{"prompt_ids": i, "prompt": p, "columns": {"answer": a}} for i, p, a in zip(ids, prompts, answers)]
    generation = GenerationConfig(max_completion_length=2, temperature=1e-3, batch_size=2)
    backend = Backend(Recipe(output_dir=str(tmp_path)))
    out = evaluate_prompts(backend, EngineLink.over(engine, backend, generation, seed=3), tokenizer, examples,
                           RewardSet([]), pass_k=(1, 2, 4), pass_k_samples=5)
    assert out["eval/accuracy"] == pytest.approx(0.5)
    assert {k: out[f"eval/pass_at_{k}"] for k in (1, 2, 4)} == pytest.approx({1: 0.5, 2: 0.5, 4: 0.5})

    # at temperature 1, the same seed gives the same figures, and pass@k grows with k
    hot = GenerationConfig(max_completion_length=2, temperature=1.0, batch_size=2)
    runs = [evaluate_prompts(backend, EngineLink.over(engine, backend, hot, seed=7), tokenizer, examples,
                             RewardSet([]), pass_k=(1, 4)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0]["eval/pass_at_1"] <= runs[0]["eval/pass_at_4"]
