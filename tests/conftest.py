"""Shared fixtures: one tiny random model + locally trained tokenizer per test session (no downloads)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(out, arch="llama", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory):
    """The tiny model with head_dim 32 (2 heads of 32): vLLM's CPU attention has no kernel for head_dim 16."""
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-vllm") / "model"
    make_tiny_model(out, arch="llama", seed=0, num_heads=2, num_kv_heads=1)
    return out
