"""model.lm_head_fp32 (TRL's cast_lm_head_to_fp32): the trainer's output layer in float32 on every path (the model's
own forward under autocast, the fused log-prob path), a tied embedding's output left in the model's dtype; a side
that cannot is refused before anything loads (the vLLM side: tests/unit/test_rollout_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms import ALGORITHMS
from posttrain.batch import Batch
from posttrain.config.load import load_recipe
from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError
from posttrain.models.forward import policy_logprobs, policy_logprobs_entropy
from posttrain.models.load import load_causal_lm
from posttrain.ops.logprobs import token_logprobs


def load(tiny_model_dir, fp32_head: bool):
    return load_causal_lm(ModelConfig(name_or_path=str(tiny_model_dir), dtype="bfloat16", lm_head_fp32=fp32_head))


def test_output_layer_runs_in_float32_on_every_path(tiny_model_dir):
    model, plain = load(tiny_model_dir, True), load(tiny_model_dir, False)
    head = model.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch(input_ids_BT=ids, completion_mask_BT=torch.ones_like(ids))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        assert hidden.dtype == torch.bfloat16  # the tied embedding's output was cast back: the layers ran in bf16
        with torch.autocast("cpu", enabled=False):
            expected_logits = torch.nn.functional.linear(hidden.float(), head.weight.float())
        assert out.logits.dtype == torch.float32
        torch.testing.assert_close(out.logits, expected_logits, rtol=0, atol=0)
        fused = policy_logprobs(model, batch)          # the fused path (llama): hidden states -> log-probs
        fused_entropy, _ = policy_logprobs_entropy(model, batch)
        unfused_bf16 = policy_logprobs(plain, batch)   # the bf16 head, as without the switch
    expected = token_logprobs(expected_logits, ids)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_entropy, expected, rtol=1e-5, atol=1e-5)
    assert (unfused_bf16 - expected).abs().max() > 1e-4  # the switch changed the precision: it ran
    # after the fused path the layer's own float32 forward is back
    assert head.forward.__func__.__name__ == "_fp32_linear"


def test_refused_where_a_side_cannot():
    grpo = ALGORITHMS["grpo"][0]
    base = ["data.train=x.jsonl", "rewards=[{name: exact_match}]", "model.lm_head_fp32=true"]
    assert load_recipe(None, base + ["generation.engine=vllm"], grpo).model.lm_head_fp32
    with pytest.raises(UserError, match="generation.placement=servers generates on vLLM servers"):
        load_recipe(None, base + ["generation.engine=vllm", "generation.placement=servers",
                                  "generation.servers=[http://127.0.0.1:8000]"], grpo)
    with pytest.raises(UserError, match="lm_head in model.lora.target_modules"):
        load_recipe(None, base + ["model.lora.enabled=true", "model.lora.target_modules=[q_proj, lm_head]"], grpo)


def test_trl_flag_maps_to_it():
    from posttrain.cli import command_line_overrides

    sft = ALGORITHMS["sft"][0]
    overrides = command_line_overrides([], {"cast_lm_head_to_fp32": True}, sft)
    assert load_recipe(None, overrides + ["data.train=x.jsonl"], sft).model.lm_head_fp32
