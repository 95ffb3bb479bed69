"""Collation layouts, and the proof that packing is exact: a tiny random Llama gives the same per-token log-probs
from one packed row as from a padded batch (sdpa and eager attention)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.config import DataConfig
from posttrain.data import collate_packed, collate_padded, collate_preference, collate_prompts, tokenize_sft
from tests.unit.test_data_tokenizers import CONVERSATION, chatml_tokenizer, rows

PAD = 99
EXAMPLES = [
    {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [6, 7], "completion_mask": [0, 1]},
    {"input_ids": [8, 9, 10, 11, 12, 13, 14, 15], "completion_mask": [0, 1, 1, 1, 1, 1, 1, 1]},
]


def test_padded_layout():
    batch = collate_padded(EXAMPLES[:2], PAD)
    assert batch.input_ids_BT.tolist() == [[1, 2, 3, 4, 5], [6, 7, PAD, PAD, PAD]]
    assert batch.completion_mask_BT.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.input_ids_BT.dtype == torch.long and batch.completion_mask_BT.dtype == torch.bool
    assert batch.position_ids_BT is None and batch.num_sequences == 2


def test_packed_layout_never_trains_a_sequence_start():
    first_token_masked = [{"input_ids": [6, 7], "completion_mask": [1, 1]},
                          {"input_ids": [8, 9], "completion_mask": [1, 1]}]
    batch = collate_packed(EXAMPLES[:1] + first_token_masked)
    assert batch.input_ids_BT.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch.position_ids_BT.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1]]
    assert batch.sequence_index_BT.tolist() == [[0, 0, 0, 0, 0, 1, 1, 2, 2]]
    assert batch.completion_mask_BT.tolist() == [[False, False, True, True, True, False, True, False, True]]
    assert batch.attention_mask_BT is None and batch.num_sequences == 3
    assert set(batch.model_inputs()) == {"input_ids", "position_ids"}


def test_preference_layout():
    pairs = [{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5], "margin": 1.5},
             {"prompt_ids": [6], "chosen_ids": [7], "rejected_ids": [8, 9, 10], "margin": 0.0}]
    batch = collate_preference(pairs, PAD)
    assert batch.input_ids_BT.tolist() == [[1, 2, 3, 4], [6, 7, PAD, PAD], [1, 2, 5, PAD], [6, 8, 9, 10]]
    assert batch.completion_mask_BT.long().tolist() == [[0, 0, 1, 1], [0, 1, 0, 0], [0, 0, 1, 0], [0, 1, 1, 1]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.num_pairs == 2 and batch.num_sequences == 4
    assert batch.margin_B.tolist() == [1.5, 0.0]
    assert collate_preference([{k: v for k, v in p.items() if k != "margin"} for p in pairs], PAD).margin_B is None


def test_prompts_are_left_padded():
    input_ids_BT, attention_mask_BT = collate_prompts([{"prompt_ids": [1, 2, 3]}, {"prompt_ids": [4]}], PAD)
    assert input_ids_BT.tolist() == [[1, 2, 3], [PAD, PAD, 4]]
    assert attention_mask_BT.tolist() == [[1, 1, 1], [0, 0, 1]]


# --- packing is exact -------------------------------------------------------------------------------------------------


def tiny_llama(attn_implementation: str, vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=vocab_size, attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).float().eval()


def masked_token_logprobs(model, batch) -> list[torch.Tensor]:
    """Log-probs of the masked tokens, one tensor per sequence, in sequence order.

    use_cache=False matters: with a KV cache (config.use_cache defaults to True) transformers does not look for
    packed sequences in position_ids, and attention runs across them.
    """
    with torch.no_grad():
        logits_BTV = model(**batch.model_inputs(), use_cache=False).logits
    logprobs_BT = torch.log_softmax(logits_BTV[:, :-1], -1).gather(-1, batch.input_ids_BT[:, 1:, None])[..., 0]
    mask_BT = batch.completion_mask_BT[:, 1:]
    if batch.sequence_index_BT is None:
        return [logprobs_BT[b][mask_BT[b]] for b in range(logprobs_BT.shape[0])]
    index_BT = batch.sequence_index_BT[:, 1:]
    return [logprobs_BT[mask_BT & (index_BT == n)] for n in range(batch.num_sequences)]


def sft_examples():
    """Tokenised rows of different lengths (two conversations, a prompt-completion pair), and a one-token sequence."""
    tok = chatml_tokenizer()
    chats, _ = tokenize_sft(rows({"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}), tok, DataConfig())
    pair, _ = tokenize_sft(rows({"prompt": "2 + 2 =", "completion": " 4"}), tok, DataConfig())
    one_token = {"input_ids": [tok.eos_token_id], "completion_mask": [1]}
    return [chats[0], one_token, pair[0], chats[1]], len(tok)


@pytest.mark.parametrize("row_length", [None, 40])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_equals_padded(attn_implementation, row_length):
    examples, vocab_size = sft_examples()
    model = tiny_llama(attn_implementation, vocab_size)
    padded = masked_token_logprobs(model, collate_padded(examples, pad_id=0))
    packed_batch = collate_packed(examples, row_length=row_length, pad_id=0)
    if row_length is not None:  # several rows, none longer than row_length unless one sequence is
        longest = max(len(e["input_ids"]) for e in examples)
        assert packed_batch.input_ids_BT.shape[0] > 1
        assert packed_batch.input_ids_BT.shape[1] <= max(row_length, longest)
    packed = masked_token_logprobs(model, packed_batch)
    trained = [sum(e["completion_mask"][1:]) for e in examples]
    assert [p.numel() for p in packed] == [p.numel() for p in padded] == trained and trained[1] == 0
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # The SFT loss numerator: summed cross-entropy over the masked tokens.
    torch.testing.assert_close(-torch.cat(packed).sum(), -torch.cat(padded).sum(), atol=1e-5, rtol=0)


def test_packing_without_restarted_positions_would_leak_across_sequences():
    """The control that shows the comparison above can fail: positions that run on let attention cross sequences."""
    examples, vocab_size = sft_examples()
    model = tiny_llama("sdpa", vocab_size)
    packed = collate_packed(examples)
    leaky = dataclasses.replace(packed, position_ids_BT=torch.arange(packed.input_ids_BT.shape[1])[None])
    padded = masked_token_logprobs(model, collate_padded(examples, pad_id=0))
    assert not torch.allclose(torch.cat(masked_token_logprobs(model, leaky)), torch.cat(padded), atol=1e-3)
