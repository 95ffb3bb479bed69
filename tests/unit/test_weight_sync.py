"""What a weight sync sends (`posttrain.distributed.weight_sync.sync_units`, `Backend.weight_buckets`), one process:
the plain model's names, every parameter once (tied weights once), LoRA folded in exactly as peft's own merge does,
and buckets no bigger than asked unless one tensor is. The sharded cases (ZeRO-3, FSDP2) are in tests/distributed."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.schema import LoraConfig, Recipe
from posttrain.distributed.weight_sync import sync_units


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def sent(units) -> dict[str, torch.Tensor]:
    return {u.name: u.compute([p.data for p in u.params]) for u in units}


def test_plain_model_every_parameter_once_under_its_name(model):
    tensors = sent(sync_units(model))
    assert tensors.keys() == dict(model.named_parameters()).keys()  # named_parameters lists a tied weight once
    for name, p in model.named_parameters():
        assert tensors[name] is p.data or torch.equal(tensors[name], p.data)


def test_tied_weight_sent_once(model):
    model.lm_head.weight = model.get_input_embeddings().weight
    names = [u.name for u in sync_units(model)]
    assert len(names) == len(set(names))
    assert ("lm_head.weight" in names) != ("model.embed_tokens.weight" in names)


def test_lora_folded_in_like_peft_merge(model):
    from posttrain.models.load import apply_lora

    peft_model = apply_lora(copy.deepcopy(model), LoraConfig(enabled=True, r=4, alpha=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)  # B starts at zero: make the adapters count
    tensors = sent(sync_units(peft_model))
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    assert tensors.keys() == merged.keys()
    for name, expected in merged.items():
        torch.testing.assert_close(tensors[name], expected, atol=1e-6, rtol=0)
    assert any(not torch.equal(tensors[n], p) for n, p in model.named_parameters())  # the adapters did change some


def test_buckets_respect_the_size(model, tmp_path):
    from posttrain.distributed.backend import Backend

    backend = Backend(Recipe(output_dir=str(tmp_path)))
    sizes = [u.nbytes for u in sync_units(model)]
    limit_mb = 2 * max(sizes) / 2**20
    buckets = [[(n, t.clone()) for n, t in b] for b in backend.weight_buckets(model, limit_mb)]
    assert 1 < len(buckets) < len(sizes)
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= limit_mb * 2**20 for b in buckets)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in model.named_parameters()]
