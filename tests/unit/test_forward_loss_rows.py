"""SFT's and DPO's forwards project onto the vocabulary only the rows that predict a token the loss reads (the
completion tokens), as GRPO's do: padded, padding-free and shared-prefix batches give the same log-probs at those
tokens and the same gradients as scoring every row, and the fused output layer sees only those rows (counted at
ops.logprobs._LinearTokenLogprobs, so a refactor that scores every row again fails here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.algorithms.preference_logps import sequence_logps
from posttrain.algorithms.sft import SFT
from posttrain.batch import share_prefixes
from posttrain.data import collate_padded
from posttrain.models.forward import policy_logprobs
from posttrain.ops import logprobs as ops_logprobs

PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # 9 tokens: rows that share it share a prefix (at least 8 tokens)
ROWS = [{"input_ids": PROMPT + completion, "completion_mask": [0] * len(PROMPT) + [1] * len(completion)}
        for completion in ([20, 21, 22], [23, 24], [25, 26, 27, 28])]
LOSS_TOKENS = 9  # 3 + 2 + 4 completion tokens


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=40, attn_implementation="sdpa", pad_token_id=0)
    return LlamaForCausalLM(config).float()


@pytest.fixture
def projected(monkeypatch):
    """Rows each fused output-layer call projects."""
    rows, original = [], ops_logprobs._LinearTokenLogprobs.apply
    monkeypatch.setattr(ops_logprobs._LinearTokenLogprobs, "apply",
                        lambda hidden_NH, *args: rows.append(hidden_NH.shape[0]) or original(hidden_NH, *args))
    return rows


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["padded", "padding_free", "shared"])
def test_only_the_loss_rows_are_projected_and_nothing_else_changes(model, projected, layout):
    batch = collate_padded(ROWS, 0)
    batch = {"padded": batch, "padding_free": dataclasses.replace(batch, padding_free=True),
             "shared": share_prefixes(batch)}[layout]
    mask_BT = batch.completion_mask_BT
    every = policy_logprobs(model, batch)
    every_grads = grads(model, -(every * mask_BT).sum())
    projected.clear()
    scored = policy_logprobs(model, batch, mask_BT=mask_BT)
    assert projected == [LOSS_TOKENS]  # all rows: 3 x 13 padded, 33 real, 3 x 13 shared slots
    torch.testing.assert_close(scored[mask_BT], every[mask_BT], atol=1e-6, rtol=1e-6)
    assert (scored[~mask_BT] == 0).all()
    scored_grads = grads(model, -(scored * mask_BT).sum())
    for name in every_grads:
        torch.testing.assert_close(scored_grads[name], every_grads[name], atol=1e-6, rtol=1e-5)


def test_sft_and_dpo_forwards_score_their_completion_rows(model, projected):
    batch = collate_padded(ROWS, 0)
    SFT(SimpleRecipe()).loss(model, batch, torch.tensor(float(LOSS_TOKENS)))
    sums_B, counts_B = sequence_logps(model, batch)
    assert projected == [LOSS_TOKENS, LOSS_TOKENS] and counts_B.tolist() == [3, 2, 4]


@dataclasses.dataclass
class SimpleRecipe:
    algo: object = None
