"""Loading models and tokenizers, source checks, sequence classifiers, LoRA, reference copies, parameter counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.schema import LoraConfig, ModelConfig
from posttrain.errors import UserError
from posttrain.models.load import (
    apply_lora,
    check_model_source,
    count_parameters,
    disable_adapter,
    is_peft_model,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    merge_lora,
)
from posttrain.models.reference import make_reference

LORA = LoraConfig(enabled=True, r=4, alpha=8)


@pytest.fixture
def cfg(tiny_model_dir):
    return ModelConfig(name_or_path=str(tiny_model_dir))


def input_ids(tokenizer, texts=("What is 12 + 7? 19", "Hello there")):
    return tokenizer(list(texts), return_tensors="pt", padding=True)


def randomise_lora_b(model, seed=0):
    """Fresh LoRA adapters are a no-op (B = 0); give B values so the adapter changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def checkpointing(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


# --- source checks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["./nope", "~/definitely-missing-model-dir", "missing/", "runs/x/final", "/no/such"])
def test_missing_local_path_is_user_error(source):
    with pytest.raises(UserError, match="model.name_or_path.*does not exist"):
        check_model_source(ModelConfig(name_or_path=source))


def test_directory_without_config_is_user_error(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(UserError, match="no config.json"):
        check_model_source(ModelConfig(name_or_path=str(tmp_path)))
    with pytest.raises(UserError, match="algo.ref.name_or_path"):
        check_model_source(ModelConfig(name_or_path=str(tmp_path / "weights.bin")), what="algo.ref.name_or_path")


def test_hub_ids_and_model_dirs_pass(tiny_model_dir):
    for source in ["Qwen/Qwen2.5-0.5B", "gpt2", "org/name-v1.5_x", str(tiny_model_dir), str(tiny_model_dir) + "/"]:
        check_model_source(ModelConfig(name_or_path=source))


def test_tokenizer_path_is_checked(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="model.tokenizer_name_or_path"):
        check_model_source(ModelConfig(name_or_path=str(tiny_model_dir), tokenizer_name_or_path=str(tmp_path)))


def test_loaders_check_the_source_first():
    with pytest.raises(UserError, match="does not exist"):
        load_causal_lm(ModelConfig(name_or_path="./nope/"))
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(ModelConfig(name_or_path="./nope/"))


# --- tokenizer --------------------------------------------------------------------------------------------------


def test_tokenizer_defaults(cfg):
    tok = load_tokenizer(cfg)
    assert tok.pad_token == "<|endoftext|>"
    assert tok.padding_side == "right"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>user")


def test_pad_falls_back_to_eos(tiny_model_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "nopad"
    shutil.copytree(tiny_model_dir, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["pad_token"] = None
    tc["padding_side"] = "left"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = load_tokenizer(ModelConfig(name_or_path=str(d)))
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.padding_side == "right"


def test_chat_template_override_inline_and_file(cfg, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = load_tokenizer(dataclasses.replace(cfg, chat_template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    tok = load_tokenizer(dataclasses.replace(cfg, chat_template=str(path)))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user> hi\n"


def test_bad_chat_template_is_user_error(cfg, tmp_path):
    with pytest.raises(UserError, match="chat_template"):
        load_tokenizer(dataclasses.replace(cfg, chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(UserError, match="does not render"):
        load_tokenizer(dataclasses.replace(cfg, chat_template="{% for m in messages %}{{ m['content'] }"))


# --- models -----------------------------------------------------------------------------------------------------


def test_causal_lm_dtype_and_checkpointing(cfg):
    model = load_causal_lm(cfg, gradient_checkpointing=False)
    assert model.dtype == torch.float32
    assert not checkpointing(model)
    model = load_causal_lm(dataclasses.replace(cfg, dtype="bfloat16", attn_implementation="eager"), True)
    assert model.dtype == torch.bfloat16
    assert checkpointing(model)
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "eager"
    model.train()
    tok = load_tokenizer(cfg)
    out = model(**input_ids(tok), labels=input_ids(tok)["input_ids"])
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bad_dtype_is_user_error(cfg):
    with pytest.raises(UserError, match="model.dtype"):
        load_causal_lm(dataclasses.replace(cfg, dtype="fp8"))


def test_sequence_classifier_from_causal_lm(cfg):
    tok = load_tokenizer(cfg)
    model = load_sequence_classifier(cfg, gradient_checkpointing=True)
    assert model.config.num_labels == 1
    assert model.config.pad_token_id == tok.pad_token_id
    assert checkpointing(model)
    batch = input_ids(tok)
    scores = model(**batch).logits
    assert scores.shape == (2, 1)
    # Right padding: the score is read at the last real token, so padding more does not change it.
    longer = tok(["What is 12 + 7? 19", "Hello there"], return_tensors="pt", padding="max_length", max_length=32)
    torch.testing.assert_close(model.eval()(**longer).logits, model(**batch).logits)


def test_reference_is_frozen_copy(cfg):
    policy = load_causal_lm(cfg)
    reference = make_reference(cfg)
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    for (name, p), q in zip(policy.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
        assert p.data_ptr() != q.data_ptr()
    rm_ref = make_reference(cfg, "seq_cls")
    assert rm_ref.config.num_labels == 1 and not rm_ref.training


def test_count_parameters(cfg):
    model = load_causal_lm(cfg)
    total, trainable = count_parameters(model)
    assert total == trainable == sum(p.numel() for p in model.parameters())
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert with_duplicates - total == model.config.vocab_size * model.config.hidden_size  # tied: counted once
    model.model.embed_tokens.requires_grad_(False)
    assert count_parameters(model) == (total, total - model.config.vocab_size * model.config.hidden_size)


# --- LoRA -------------------------------------------------------------------------------------------------------


def test_lora_trains_only_adapters(cfg):
    plain = load_causal_lm(cfg)
    assert not is_peft_model(plain)
    model = apply_lora(plain, LORA)
    assert is_peft_model(model)
    total, trainable = count_parameters(model)
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable_names and all("lora_" in n for n in trainable_names)
    assert 0 < trainable < total
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable_names)
    targeted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable_names}
    assert targeted == set(LORA.target_modules)


def test_lora_seq_cls_trains_score_head(cfg):
    model = apply_lora(load_sequence_classifier(cfg), LORA, task="seq_cls")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable)
    assert all("lora_" in n or "score" in n for n in trainable)
    assert model(**input_ids(load_tokenizer(cfg))).logits.shape == (2, 1)


def test_lora_unknown_targets_is_user_error(cfg):
    with pytest.raises(UserError, match="target_modules.*q_proj"):
        apply_lora(load_causal_lm(cfg), dataclasses.replace(LORA, target_modules=("c_attn",)))


def test_disable_adapter_gives_base_logits_exactly(cfg):
    tok = load_tokenizer(cfg)
    batch = input_ids(tok)
    base = load_causal_lm(cfg).eval()
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = apply_lora(base, LORA).eval()
    randomise_lora_b(model)
    with torch.no_grad():
        adapted = model(**batch).logits
        with disable_adapter(model):
            disabled = model(**batch).logits
        again = model(**batch).logits
    assert not torch.allclose(adapted, base_logits)
    assert torch.equal(disabled, base_logits)
    assert torch.equal(again, adapted)


def test_disable_adapter_needs_lora_model(cfg):
    with pytest.raises(TypeError, match="peft"):
        with disable_adapter(load_causal_lm(cfg)):
            pass


def test_merge_gives_plain_model_with_same_logits(cfg, tmp_path):
    from peft import PeftModel

    tok = load_tokenizer(cfg)
    batch = input_ids(tok)
    model = apply_lora(load_causal_lm(cfg), LORA).eval()
    randomise_lora_b(model, seed=1)
    with torch.no_grad():
        adapted = model(**batch).logits
    merged = merge_lora(model)
    assert not isinstance(merged, PeftModel)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, adapted, atol=1e-5, rtol=0)
    merged.save_pretrained(tmp_path / "merged", safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, adapted, atol=1e-5, rtol=0)
    plain = load_causal_lm(cfg)
    assert merge_lora(plain) is plain


def test_lora_with_gradient_checkpointing_backward(cfg):
    model = apply_lora(load_causal_lm(cfg, gradient_checkpointing=True), LORA)
    model.train()
    batch = input_ids(load_tokenizer(cfg))
    model(**batch, labels=batch["input_ids"]).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # A's are 0 while B is 0
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_missing_peft_is_user_error(cfg, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(UserError, match=r"pip install posttrain\[peft\]"):
        apply_lora(load_causal_lm(cfg), LORA)


def test_checkpointing_is_turned_on_by_the_name_newer_transformers_do_not_deprecate(cfg, monkeypatch):
    """transformers 5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable and made the old
    name warn FutureWarning; where the new one exists it is the one called (5.24's split, put in here)."""
    import warnings

    from transformers import LlamaForCausalLM

    original = LlamaForCausalLM.gradient_checkpointing_enable

    def deprecated(self, gradient_checkpointing_kwargs=None):
        warnings.warn("`gradient_checkpointing_enable` is deprecated", FutureWarning)
        return original(self, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def renamed(self, activation_checkpointing_kwargs=None):
        return original(self, gradient_checkpointing_kwargs=activation_checkpointing_kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "gradient_checkpointing_enable", deprecated)
    monkeypatch.setattr(LlamaForCausalLM, "activation_checkpointing_enable", renamed, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_causal_lm(cfg, gradient_checkpointing=True)
    assert checkpointing(model)
