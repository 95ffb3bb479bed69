"""The tiny model factory: loads like a hub model, tokenizes digits one by one, speaks ChatML, same for both archs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from posttrain.errors import UserError
from posttrain.models.tiny import IM_END, IM_START, PAD, make_tiny_model

TEXTS = [
    "What is 123 + 456? 579",
    "  two  spaces\n\n\nnewlines\r\n tab\there",
    "(hello) .world ... I'LL we've",
    "naïve café 日本語 🤗",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_archs")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loads_and_generates(tiny_dirs, arch):
    tok = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    ids = tok("What is 1 + 2?", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids["input_ids"].shape[1] + 5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_special_tokens_and_padding(tiny_dirs, arch):
    tok = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == IM_END
    assert tok.pad_token == PAD
    assert tok.bos_token is None
    assert tok.padding_side == "right"
    assert 512 <= len(tok) <= 1024
    assert tok.convert_tokens_to_ids(IM_START) != tok.unk_token_id
    assert tok(IM_START + IM_END)["input_ids"] == [tok.convert_tokens_to_ids(IM_START), tok.eos_token_id]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_and_individual_digits(tiny_dirs, arch):
    tok = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    for s in TEXTS:
        assert tok.decode(tok(s)["input_ids"]) == s
    tokens = tok.convert_ids_to_tokens(tok("x 1234567890 y")["input_ids"])
    for digit in "1234567890":
        assert digit in tokens
    assert all(not (any(c.isdigit() for c in t) and len(t.lstrip("Ġ")) > 1) for t in tokens)


def test_both_archs_tokenize_identically(tiny_dirs):
    # transformers loads a qwen2 directory with Qwen2Tokenizer, a llama one with the generic backend.
    tok_llama = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    tok_qwen = AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])
    for s in TEXTS:
        assert tok_llama(s)["input_ids"] == tok_qwen(s)["input_ids"]


def test_chat_template_chatml(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|im_start|>assistant\n"


def test_chat_template_marks_assistant_tokens(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "12"}]
    out = tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    marked = [t for t, m in zip(tok.convert_ids_to_tokens(out["input_ids"]), out["assistant_masks"]) if m]
    assert marked == ["1", "2", IM_END]


def test_same_seed_same_weights_and_size_knobs(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "c", seed=4))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    big = make_tiny_model(tmp_path / "big", hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3)
    cfg = AutoModelForCausalLM.from_pretrained(big).config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (96, 3, 6, 3)


def test_bad_arch_and_shape_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(UserError, match="num_heads"):
        make_tiny_model(tmp_path / "y", hidden_size=60, num_heads=8)


def test_session_fixture(tiny_model_dir):
    assert (tiny_model_dir / "config.json").is_file()
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert (tiny_model_dir / "tokenizer.json").is_file()


def test_default_shape_fits_vllm_cpu_attention(tiny_dirs):
    """`posttrain make-tiny-model`'s default is what the shipped vLLM recipes run on: vLLM's CPU attention has no
    kernel for a head_dim under 32."""
    config = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).config
    assert config.hidden_size // config.num_attention_heads >= 32
