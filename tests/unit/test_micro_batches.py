"""Padding-free forwards and token-budget micro-batches (posttrain/train/micro_batches.py, Batch.padding_free):
the packed forward gives each row's log-probs, scores and values (and their gradients) as the padded one does, on
a tiny random Llama with sdpa and eager attention; regrouping keeps pairs whole, stays within the budget, agrees a
count with fillers, and leaves a loss summed over micro-batches unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

from posttrain.data import collate_padded, collate_preference
from posttrain.errors import UserError
from posttrain.models.critic import critic_values
from posttrain.models.forward import policy_logits, policy_logprobs, sequence_scores
from posttrain.ops.logprobs import sequence_sum, token_logprobs
from posttrain.train.micro_batches import check_token_budget, shape, split_units
from posttrain.train.sources import DatasetSource, example_tokens

PAD = 0
ROWS = [{"input_ids": list(range(3, 3 + n)), "completion_mask": [0, 0] + [1] * (n - 2)} for n in (9, 3, 6, 12, 4)]
PAIRS = [{"prompt_ids": [5, 6, 7][:k], "chosen_ids": list(range(10, 10 + c)), "rejected_ids": list(range(20, 20 + r))}
         for k, c, r in ((3, 2, 5), (1, 6, 1), (2, 3, 3))]


def config(attn_implementation: str, **extra) -> LlamaConfig:
    torch.manual_seed(0)
    return LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=40, attn_implementation=attn_implementation, pad_token_id=PAD,
                       **extra)


def recipe(budget=None, packing=False, max_length=16):
    return SimpleNamespace(train=SimpleNamespace(max_tokens_per_microbatch=budget),
                           data=SimpleNamespace(packing=packing, max_length=max_length, max_prompt_length=None),
                           generation=SimpleNamespace(max_completion_length=8))


def grads(model, loss_fn):
    model.zero_grad()
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, atol=1e-5):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4)
    else:
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_padding_free_logprobs_and_gradients_equal_padded(attn_implementation):
    model = LlamaForCausalLM(config(attn_implementation)).float()
    padded = collate_padded(ROWS, PAD)
    free = dataclasses.replace(padded, padding_free=True)
    mask_BT = padded.completion_mask_BT
    inputs = free.model_inputs()  # rows of 9, 3, 6, 12, 4 tokens in rows of 12: [12], [9, 3], [6, 4] + 2 filler
    assert inputs["input_ids"].shape == (3, 12)
    assert inputs["position_ids"].tolist() == [list(range(12)), [*range(9), *range(3)], [*range(6), *range(4), 0, 1]]
    real = inputs["input_ids"][inputs["input_ids"] > 0]
    assert sorted(real.tolist()) == sorted(t for r in ROWS for t in r["input_ids"])
    # the fused output layer (llama is in FUSED_HEAD_MODELS) and the logits path
    fused = [policy_logprobs(model, b) for b in (padded, free)]
    plain = [token_logprobs(policy_logits(model, b), b.input_ids_BT) for b in (padded, free)]
    for a, b in (fused, plain):
        assert_same(torch.where(mask_BT, a, 0), torch.where(mask_BT, b, 0))
    assert (fused[1][:, 0] == 0).all()  # no prediction from the previous packed row leaks into position 0
    loss = lambda b: -sequence_sum(policy_logprobs(model, b), mask_BT).sum()  # noqa: E731
    assert_same(grads(model, lambda: loss(padded)), grads(model, lambda: loss(free)))


def test_padding_free_scores_and_values_equal_padded():
    scorer = LlamaForSequenceClassification(config("sdpa", num_labels=1)).float()
    pairs = collate_preference(PAIRS, PAD)
    free = dataclasses.replace(pairs, padding_free=True)
    assert_same(sequence_scores(scorer, pairs), sequence_scores(scorer, free))
    assert_same(grads(scorer, lambda: sequence_scores(scorer, pairs).sum()),
                grads(scorer, lambda: sequence_scores(scorer, free).sum()))
    critic = LlamaForTokenClassification(config("sdpa", num_labels=1, classifier_dropout=0.0)).float()
    padded = collate_padded(ROWS, PAD)
    real_BT = padded.attention_mask_BT.bool()
    a = critic_values(critic, padded)
    b = critic_values(critic, dataclasses.replace(padded, padding_free=True))
    assert_same(torch.where(real_BT, a, 0), torch.where(real_BT, b, 0))


def test_units_keep_pairs_whole_and_regrouping_stays_within_the_budget():
    pairs = dataclasses.replace(collate_preference(PAIRS, PAD), example_index_B=torch.tensor([7, 8, 9]))
    units = split_units(pairs)
    assert [u.num_pairs for u in units] == [1, 1, 1] and [u.example_index_B.item() for u in units] == [7, 8, 9]
    tokens = [example_tokens(p) for p in PAIRS]
    assert [int(u.attention_mask_BT.sum()) for u in units] == tokens
    budget = max(tokens)
    shaped = shape([pairs], recipe(budget=budget, packing=True), PAD, agree=lambda count: count)
    assert all(int(b.attention_mask_BT.sum()) <= budget and b.padding_free for b in shaped)
    assert sorted(i for b in shaped for i in b.example_index_B.tolist()) == [7, 8, 9]
    for batch in shaped:  # row p is chosen, row P + p its rejected partner: the same prompt starts both
        p = batch.num_pairs
        prompt_of = {7: [5, 6, 7], 8: [5], 9: [5, 6]}
        for k, index in enumerate(batch.example_index_B.tolist()):
            width = len(prompt_of[index])
            chosen, rejected = batch.input_ids_BT[k, :width], batch.input_ids_BT[p + k, :width]
            assert chosen.tolist() == rejected.tolist() == prompt_of[index]
            assert batch.input_ids_BT.shape[1] == int(batch.attention_mask_BT.sum(-1).max())  # trimmed


def test_agreed_count_adds_fillers_that_weigh_nothing():
    padded = collate_padded(ROWS, PAD)
    asked = []
    shaped = shape([padded], recipe(budget=100), PAD, agree=lambda count: asked.append(count) or 7)
    assert asked == [1]  # 34 tokens fit one micro-batch here; another rank needs 7
    assert len(shaped) == 7 and sum(b.filler for b in shaped) == 2
    assert sum(b.num_sequences for b in shaped if not b.filler) == len(ROWS)


@pytest.mark.parametrize("budget", [12, 20, 1000])
def test_a_summed_loss_is_the_same_whatever_the_budget(budget):
    model = LlamaForCausalLM(config("sdpa")).float()
    padded = [collate_padded(ROWS[:2], PAD), collate_padded(ROWS[2:], PAD)]
    total = sum(int(b.completion_mask_BT.sum()) for b in padded)

    def step_loss(batches):
        return sum(-sequence_sum(policy_logprobs(model, b), b.completion_mask_BT).sum() / total for b in batches)

    shaped = shape(padded, recipe(budget=budget, packing=True), PAD, agree=lambda count: count)
    assert all(int(b.attention_mask_BT.sum()) <= max(budget, 12) for b in shaped)
    assert (len(shaped) == 1) == (budget == 1000) and sum(b.num_sequences for b in shaped) == 5
    assert_same(grads(model, lambda: step_loss(padded)), grads(model, lambda: step_loss(shaped)))


def test_a_budget_below_the_longest_unit_is_refused():
    sft = SimpleNamespace(name="sft", data_kind="sft", source_kind="dataset")
    dpo = SimpleNamespace(name="dpo", data_kind="preference", source_kind="dataset")
    check_token_budget(recipe(budget=16), sft)
    with pytest.raises(UserError, match=r"2 x data.max_length \(16\) = 32"):
        check_token_budget(recipe(budget=16), dpo)
    with pytest.raises(UserError, match="max_tokens_per_microbatch=8 is below data.max_length = 16"):
        check_token_budget(recipe(budget=8), sft)


def test_balanced_shares_cover_the_global_batch_once():
    examples = [{"input_ids": [1] * n, "completion_mask": [1] * n} for n in (5, 60, 7, 30, 2, 44, 9, 13)]
    shares = [DatasetSource(examples, lambda e: e, 2, 2, 2, rank, seed=1, balance=True).step_indices(0)
              for rank in range(2)]
    assert all(len(s) == 1 for s in shares)
    assert sorted(shares[0][0] + shares[1][0]) == sorted(
        i for micro in DatasetSource(examples, lambda e: e, 2, 4, 1, 0, seed=1).step_indices(0) for i in micro)
    sums = [sum(len(examples[i]["input_ids"]) for i in s[0]) for s in shares]
    assert abs(sums[0] - sums[1]) <= 10, sums


def grpo_rows(prompts=2, generations=4, prompt=12):
    """`prompts` prompts of `prompt` tokens, `generations` completions each of 3 tokens (the completions differ from
    their first token)."""
    return [{"input_ids": [3 + p] * prompt + [20 + g, 30, 31], "completion_mask": [0] * prompt + [1, 1, 1]}
            for p in range(prompts) for g in range(generations)]


@pytest.mark.parametrize("budget, micro_batches", [(24, 2), (18, 4)])
def test_a_budget_counts_a_shared_prompt_once(budget, micro_batches):
    """2 prompts of 12 tokens, 4 completions of 3 tokens each: a prompt's group forwards 12 + 4 x 3 = 24 tokens
    shared (4 x 15 = 60 row by row). Budget 24: one group a micro-batch (row by row 24 holds one 15-token row, 8
    micro-batches); 18: two rows of a group each (12 + 2 x 3). The summed loss and gradients equal the plain step."""
    model = LlamaForCausalLM(config("sdpa")).float()
    rows = grpo_rows()
    padded = [collate_padded(rows[:3], PAD), collate_padded(rows[3:], PAD)]  # the source cut a group in two
    total = sum(int(b.completion_mask_BT.sum()) for b in padded)
    shaped = shape(padded, recipe(budget=budget), PAD, agree=lambda count: count, shared_prefix=True)
    assert len(shaped) == micro_batches and all(b.shares_prefix for b in shaped)
    assert [b.forwarded_tokens() for b in shaped] == [budget] * micro_batches
    assert sum(b.num_sequences for b in shaped) == 8

    def step_loss(batches):
        return sum(-sequence_sum(policy_logprobs(model, b), b.completion_mask_BT).sum() / total for b in batches)

    assert_same(grads(model, lambda: step_loss(padded)), grads(model, lambda: step_loss(shaped)))
