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
