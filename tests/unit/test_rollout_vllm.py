"""VLLMEngine specifics that need no running engine: bad input fails before vLLM loads anything."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from posttrain.errors import UserError
from posttrain.generation.vllm_engine import VLLMEngine, vllm_available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")]


def test_cpu_head_dim_without_kernel_is_a_user_error(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the head_dim check is for vLLM's CPU attention")
    with pytest.raises(UserError, match="head_dim 16.*generation.engine=hf"):
        VLLMEngine(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))


def test_sampling_params_stop_at_every_eos_of_the_generation_config(eos_ids_model_dir):
    """vLLM's own eos handling is off (ignore_eos): its SamplingParams carry the whole stop set, and a completion that
    reached max_tokens on the second eos is finished."""
    from vllm import SamplingParams as VSamplingParams

    from posttrain.config.schema import ModelConfig
    from posttrain.generation.base import SamplingParams, vllm_sampling, vllm_truncated
    from posttrain.models.facts import stop_ids
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(eos_ids_model_dir(7))))
    stops = stop_ids(tokenizer)
    vparams = VSamplingParams(**vllm_sampling(SamplingParams(max_new_tokens=4), stops, 0))
    assert vparams.stop_token_ids == [tokenizer.eos_token_id, 7]
    assert not vllm_truncated("length", [5, 7], stops) and vllm_truncated("length", [5, 6], stops)


def test_in_process_engine_is_asked_for_a_float32_head_with_model_lm_head_fp32(monkeypatch, tiny_model_dir):
    """model.lm_head_fp32: vLLM computes the logits in float32 (its head_dtype), as the trainer does."""
    import dataclasses

    import torch
    import vllm
    from vllm.config.model import _get_head_dtype

    from posttrain.config.schema import ModelConfig
    from posttrain.generation import vllm_engine
    from posttrain.models.load import load_tokenizer

    asked = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            asked.update(kwargs)

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(vllm_engine, "check_cpu_head_dim", lambda model_dir: None)  # no engine starts here
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    vllm_engine.VLLMEngine(tiny_model_dir, tokenizer, fp32_head=True)
    assert asked["hf_overrides"] == {"head_dtype": "float32"}
    asked.clear()
    vllm_engine.VLLMEngine(tiny_model_dir, tokenizer)
    assert "hf_overrides" not in asked
    # and vLLM reads it off the model config it overrides: a bf16 generation model gets a float32 head
    config = dataclasses.make_dataclass("Config", [("head_dtype", str)])("float32")
    assert _get_head_dtype(config, torch.bfloat16, "generate") == torch.float32
