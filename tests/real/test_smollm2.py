"""A real model, SmolLM2-135M-Instruct, checks what the tiny random models cannot: its ChatML template with
pad == eos (<|im_end|> ends every assistant turn and must be trained while padding is not), bf16 weights loaded for
fp32 training, tied embeddings surviving export, the engine stopping at the ids its generation config names, and a
model that still stops at <|im_end|> after SFT. SFT, DPO and GRPO each run a few short steps (CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import posttrain.run  # noqa: F401 - imported before a test patches what it binds (models.load.load_causal_lm)
from posttrain.config import DataConfig
from posttrain.data import collate_padded, tokenize_sft
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import metrics, run_cli, run_overrides
from tests.unit.test_data_tokenizers import rows

IM_END = "<|im_end|>"
SHORT = ["data.max_length=64", "train.per_device_train_batch_size=2", "train.max_steps=1"]  # CI time: see the report


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=8, n_eval=2)


def test_chatml_with_pad_equal_to_eos_trains_each_turns_im_end_and_no_padding(tok):
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    for assistant_only in (True, False):
        examples, _ = tokenize_sft(rows({"messages": chat}, {"messages": chat[:2]}), tok,
                                   DataConfig(assistant_only_loss=assistant_only))
        batch = collate_padded(examples, tok.pad_token_id)
        ids_BT, mask_BT = batch.input_ids_BT, batch.completion_mask_BT
        short = len(examples[1]["input_ids"])
        assert (ids_BT[1, short:] == tok.pad_token_id).all() and not mask_BT[1, short:].any()  # padding: <|im_end|>s
        for row, example in enumerate(examples):
            ends = [t for t, i in enumerate(example["input_ids"]) if i == tok.eos_token_id]
            assistant_ends = [t for t in ends if tok.decode(example["input_ids"][t - 3 : t]).rstrip().endswith(
                ("Hello!", "4"))]
            assert assistant_ends and all(mask_BT[row, t] for t in assistant_ends)  # every turn's end is trained
        if assistant_only:
            trained = tok.decode(ids_BT[0][mask_BT[0]])
            assert trained == f"Hello!{IM_END}4{IM_END}"  # nothing of the system / user turns, no "\n" after


def test_tool_calls_under_its_plain_chatml_template_exit_2_naming_the_row(smollm2_dir, tmp_path, capsys, monkeypatch):
    """SmolLM2's template has no tool support: a row with tool_calls would train an empty assistant turn."""
    import posttrain.models.load as load

    monkeypatch.setattr(load, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Weather?"},
                                             {"role": "assistant", "content": "Let me look."}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Weather?"},
                                               {"role": "assistant", "content": "", "tool_calls": [call]}]}) + "\n")
    assert run_cli("sft", *run_overrides(smollm2_dir, path, tmp_path / "run", *SHORT)) == 2
    assert "data.train row 1: message 1 calls get_weather but the chat template drops" in capsys.readouterr().err


def test_bf16_weights_load_as_fp32_for_training(smollm2_dir):
    from posttrain.config.schema import ModelConfig
    from posttrain.models.load import load_causal_lm

    model = load_causal_lm(ModelConfig(name_or_path=str(smollm2_dir)))
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    assert all(torch.equal(params[k], v.float()) for k, v in stored.items())  # upcast exactly
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def sft_run(smollm2_dir, data, tmp_path_factory):
    """4 steps of 4 arithmetic answers ("146"): the model, which rambles on such questions before, learns to answer
    with the number and <|im_end|> (it would not stop if <|im_end|> were masked out as padding)."""
    out = tmp_path_factory.mktemp("sft") / "run"
    assert run_cli("sft", *run_overrides(smollm2_dir, data["sft_train"], out, *SHORT, "train.max_steps=4",
                                         "train.per_device_train_batch_size=4", learning_rate="1e-4")) == 0
    return out


def test_sft_exports_tied_fp32_weights_that_still_stop_at_im_end(sft_run, tok):
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics(sft_run) if "loss" in r)
    final = sft_run / "final"
    with safe_open(str(next(final.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32  # as trained
    assert "lm_head.weight" not in keys  # tied: stored once
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert GenerationConfig.from_pretrained(final).eos_token_id == tok.eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
    assert tok.eos_token_id in out, tok.decode(out)  # the answer ends with <|im_end|>, well before 16 tokens


def test_dpo_starts_at_log_2_with_policy_and_reference_alike(smollm2_dir, data, tmp_path):
    """Policy and reference are the same bf16 checkpoint loaded alike: the first step's loss is exactly ln 2."""
    out = tmp_path / "run"
    assert run_cli("dpo", *run_overrides(smollm2_dir, data["pref_train"], out, *SHORT, "train.save_final_model=false",
                                         learning_rate="1e-5")) == 0
    losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert losses[0] == pytest.approx(0.693147, abs=1e-5) and all(torch.isfinite(torch.tensor(losses)))


def test_grpo_generation_stops_at_the_generation_configs_eos(sft_run, data, tmp_path, monkeypatch):
    """From the SFT model (short answers), so a completion ends well inside the 16 tokens it may take."""
    from posttrain.generation.hf import HFEngine

    outputs = []
    generate = HFEngine.generate
    monkeypatch.setattr(HFEngine, "generate", lambda self, p, params: outputs.append(generate(self, p, params))
                        or outputs[-1])
    out = tmp_path / "run"
    assert run_cli("grpo", *run_overrides(sft_run / "final", data["prompts_train"], out, *SHORT,
                                          "algo.num_generations=2", "generation.max_completion_length=16",
                                          "rewards=[{name: exact_match}]", "train.save_final_model=false",
                                          learning_rate="1e-6")) == 0
    eos_ids = GenerationConfig.from_pretrained(sft_run / "final").eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    completions = [(ids, cut) for o in outputs for ids, cut in zip(o.completion_ids, o.truncated)]
    assert len(completions) == 2
    for ids, cut in completions:
        assert not eos_ids & set(ids[:-1])  # nothing after a stop id
        assert cut or ids[-1] in eos_ids
    assert not any(cut for _, cut in completions)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics(out) if "loss" in r)
