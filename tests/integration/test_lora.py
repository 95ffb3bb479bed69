"""LoRA (peft, model.lora.*) through SFT, RM and DPO on the tiny model (CPU, fp32): only adapters (and the RM's score
head) train, checkpoints hold the adapters and resume exactly, final/ is a merged plain model that computes what the
adapted model computed, DPO's reference is the adapter-off policy (no second copy), and an RM export scores."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.integration.helpers import (BATCH_4, final_weights, max_weight_diff, metrics, run_cli, run_overrides,
                                      step_losses)

LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]


def base(tiny_model_dir, train, out, *extra):
    return run_overrides(tiny_model_dir, train, out, *BATCH_4, *LORA, *extra, learning_rate="1e-2")


def adapted_model(tiny_model_dir, checkpoint, task="causal_lm", seed=3):
    """The peft model as training left it: the base with adapters, loaded from a checkpoint's model.safetensors."""
    from transformers import set_seed

    from posttrain.config import LoraConfig, ModelConfig
    from posttrain.models.load import apply_lora, load_causal_lm, load_sequence_classifier

    set_seed(seed)
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    model = load_causal_lm(cfg) if task == "causal_lm" else load_sequence_classifier(cfg)
    model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8), task=task)
    state = load_file(str(checkpoint / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model.eval()


def test_sft_lora_trains_adapters_and_exports_a_merged_plain_model(tiny_model_dir, data, tmp_path, recwarn):
    out = tmp_path / "run"
    assert run_cli("sft", *base(tiny_model_dir, data["sft_train"], out, "train.max_steps=3",
                                "train.gradient_checkpointing=true", "train.save_final_checkpoint=true")) == 0
    checkpoint = out / "checkpoints" / "step-3"
    saved = load_file(str(checkpoint / "model.safetensors"))
    adapters = [k for k in saved if "lora_A" in k or "lora_B" in k]
    assert adapters and all(saved[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # B starts at 0: trained
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    for key, value in saved.items():  # the base weights inside the checkpoint are untouched
        if "lora_" not in key:
            plain = key.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(value, initial[plain]), key

    merged = final_weights(out)
    assert merged.keys() == initial.keys() and not any("lora" in k for k in merged)
    changed = [k for k in merged if not torch.equal(merged[k], initial[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)
    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()  # plain transformers, no peft
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        expected = adapted_model(tiny_model_dir, checkpoint)(input_ids=ids).logits
        assert torch.allclose(model(input_ids=ids).logits, expected, atol=1e-4)
        # the adapter alone, beside the merged model, as TRL saves it: peft loads it onto the base
        from peft import PeftModel

        base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        with_adapter = PeftModel.from_pretrained(base_model, out / "final" / "adapter").eval()
        assert torch.allclose(with_adapter(input_ids=ids).logits, expected, atol=1e-4)
    # a healthy run warns of nothing; ResourceWarnings are the garbage collector finding sockets that other tests on
    # this worker left (e.g. connections to the session's vLLM server), whenever it happens to run, not this run's
    ours = [w for w in recwarn.list if not issubclass(w.category, ResourceWarning)]
    assert not ours, [str(w.message) for w in ours]


def test_lora_resume_continues_exactly(tiny_model_dir, data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train.max_steps=4", "train.save_steps=2", "train.lr_scheduler_type=cosine"]
    assert run_cli("sft", *base(tiny_model_dir, data["sft_train"], full, *common)) == 0
    assert run_cli("sft", *base(tiny_model_dir, data["sft_train"], split, *common, "train.max_steps_per_run=2")) == 0
    assert run_cli("sft", *base(tiny_model_dir, data["sft_train"], split, *common,
                                "train.resume_from_checkpoint=auto")) == 0
    a, b = step_losses(full), step_losses(split)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    assert max_weight_diff(final_weights(full), final_weights(split)) < 1e-6


@pytest.mark.parametrize("precompute", [False, True], ids=["live", "precomputed"])
def test_dpo_lora_uses_the_adapter_off_base_as_reference(tiny_model_dir, data, tmp_path, reference_loads, precompute):
    out = tmp_path / "run"
    assert run_cli("dpo", *base(tiny_model_dir, data["pref_train"], out, "train.max_steps=3",
                                f"algo.precompute_ref_logprobs={str(precompute).lower()}")) == 0
    assert reference_loads == []  # no second copy
    rows = metrics(out)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # adapters start at B = 0: policy == base
    assert rows[-1]["rewards/margins"] != 0.0
    assert (out / "ref_logprobs.safetensors").exists() == precompute
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_dpo_lora_precomputed_matches_live(tiny_model_dir, data, tmp_path):
    for name, flag in (("live", "false"), ("cached", "true")):
        assert run_cli("dpo", *base(tiny_model_dir, data["pref_train"], tmp_path / name, "train.max_steps=3",
                                    f"algo.precompute_ref_logprobs={flag}", "train.save_final_model=false")) == 0
    a, b = step_losses(tmp_path / "live"), step_losses(tmp_path / "cached")
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)


def test_rm_lora_trains_the_head_and_the_merged_export_scores(tiny_model_dir, data, tmp_path):
    from posttrain.rewards.reward_model import RewardModelScorer

    out = tmp_path / "run"
    assert run_cli("rm", *base(tiny_model_dir, data["pref_train"], out, "train.max_steps=3",
                               "train.save_final_checkpoint=true")) == 0
    merged = final_weights(out)
    assert "score.weight" in merged and not any("lora" in k or "modules_to_save" in k for k in merged)
    checkpoint = out / "checkpoints" / "step-3"
    adapted = adapted_model(tiny_model_dir, checkpoint, task="seq_cls")
    trained_head = load_file(str(checkpoint / "model.safetensors"))
    head_keys = [k for k in trained_head if k.endswith("score.modules_to_save.default.weight")]
    assert head_keys and torch.equal(merged["score.weight"], trained_head[head_keys[0]])
    original = trained_head[head_keys[0].replace("modules_to_save.default", "original_module")]
    assert not torch.equal(original, merged["score.weight"])  # the head trained (in full, as peft's SEQ_CLS does)

    plain = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7], [8, 9, 10, 11, 12, 13, 2]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4)
    scorer = RewardModelScorer(str(out / "final"), device="cpu")
    scores = scorer([[{"role": "user", "content": "What is 2 + 3?"}]] * 2, ["5", "6"])
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores) and scores[0] != scores[1]
