"""Vision-language models end to end on the tiny Qwen2-VL (CPU, fp32) with the shipped shapes image set: SFT with a
frozen vision tower (the tower bit-identical, the rest trained, final/ loads back with its processor), SFT's loss and
gradients equal to TRL 1.16's vision collator + transformers' loss on the same rows, DPO trains, and a bad image is
refused with exit 2 before any model loads."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from posttrain.algorithms import ALGORITHMS
from posttrain.config import DataConfig
from posttrain.config.schema import ModelConfig, Recipe
from posttrain.data import RowImages, collate_padded, load_rows, tokenize_sft, with_images
from posttrain.models.load import load_tokenizer
from posttrain.models.vision import load_processor
from tests.integration.helpers import (assert_accumulation_is_invisible, final_weights, max_weight_diff, metrics,
                                       run_cli, run_overrides, step_losses)


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_sft_with_a_frozen_tower_trains_the_rest_and_exports(vlm_dirs, shapes_dir, tmp_path, arch):
    """...and 4 rows with their images in one micro-batch give the update of 1 row x 4 accumulation steps (each
    micro-batch carries its own rows' pixels)."""
    tiny_vlm_dir = vlm_dirs[arch]
    assert_accumulation_is_invisible("sft", lambda out, *split: run_overrides(
        tiny_vlm_dir, shapes_dir / "sft_train.jsonl", out, "train.max_steps=3", *split, "data.max_length=128",
        "data.assistant_only_loss=true", "model.freeze_vision_tower=true"), tmp_path)
    out = tmp_path / "mb4"
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    initial, trained = load_file(str(tiny_vlm_dir / "model.safetensors")), final_weights(out)
    tower = [k for k in initial if k.startswith(("visual.", "vision_tower.")) and ".merger." not in k]  # hub names
    assert tower and all(torch.equal(initial[k], trained[k]) for k in tower)
    rest = [k for k in initial if k not in tower]
    assert [k for k in rest if torch.equal(initial[k], trained[k])] == []
    assert type(AutoModelForImageTextToText.from_pretrained(out / "final")) is type(
        AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir))
    final_cfg = ModelConfig(name_or_path=str(out / "final"))
    processor = load_processor(final_cfg, load_tokenizer(final_cfg))
    assert processor.image_processor.size == load_processor(ModelConfig(name_or_path=str(tiny_vlm_dir)),
                                                            processor.tokenizer).image_processor.size


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_sft_loss_and_gradients_equal_trls(vlm_dirs, shapes_dir, arch):
    """TRL 1.16's SFTTrainer feeds a vision model DataCollatorForVisionLanguageModeling's batch and minimises the
    model's own loss (mean cross-entropy over the labels not -100): ours on the same rows must be that loss, with
    the same gradient, so one optimiser step is the same."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    tiny_vlm_dir = vlm_dirs[arch]
    model_cfg = ModelConfig(name_or_path=str(tiny_vlm_dir))
    processor = load_processor(model_cfg, load_tokenizer(model_cfg))
    file = shapes_dir / "sft_train.jsonl"
    rows = [json.loads(line) for line in file.read_text().splitlines()[:4]]
    trl_batch = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)(
        [{"messages": r["messages"], "images": [Image.open(shapes_dir / p) for p in r["images"]]} for r in rows])
    dataset = load_rows(str(file)).select(range(4))
    examples, _ = tokenize_sft(dataset, processor.tokenizer, DataConfig(max_length=128, assistant_only_loss=True),
                               "data.train", images=RowImages.of(dataset, processor, str(file), "data.train"))
    batch = with_images(collate_padded(examples, processor.tokenizer.pad_token_id), [e["images"] for e in examples],
                        processor)
    assert torch.equal(batch.input_ids_BT, trl_batch["input_ids"])
    assert torch.equal(batch.vision.pixel_values, trl_batch["pixel_values"])
    assert torch.equal(batch.completion_mask_BT[:, 1:], trl_batch["labels"][:, 1:] != -100)

    def loss_and_grads(loss_of):
        model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
        loss = loss_of(model)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    sft = ALGORITHMS["sft"][1](Recipe())
    ours, our_grads = loss_and_grads(lambda model: sft.loss(model, batch, sft.count(batch))[0])
    theirs, their_grads = loss_and_grads(lambda model: model(**trl_batch).loss)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)
    for name, grad in their_grads.items():  # a layer neither forward uses (CLIP's last norm under LLaVA) has none
        assert (our_grads[name] is None) == (grad is None), name
        assert grad is None or torch.allclose(our_grads[name], grad, rtol=1e-4, atol=1e-7), name


def test_dpo_trains_with_images(tiny_vlm_dir, shapes_dir, tmp_path):
    out = tmp_path / "run"
    assert run_cli("dpo", *run_overrides(tiny_vlm_dir, shapes_dir / "dpo_train.jsonl", out, "train.max_steps=4",
                                         "train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=3",
                                         "data.max_length=128")) == 0
    losses = [r["loss"] for r in metrics(out)]  # every step is the whole set of 24 pairs
    assert abs(losses[0] - 0.6931) < 1e-3  # the policy is its reference at step 1: -log sigmoid(0)
    assert losses[-1] < losses[0] - 0.01, losses


def test_a_bad_image_exits_2_naming_the_row_before_any_model_loads(tiny_vlm_dir, shapes_dir, tmp_path, monkeypatch,
                                                                   capsys):
    import posttrain.run as run

    rows = (shapes_dir / "sft_train.jsonl").read_text().splitlines()
    broken = json.loads(rows[2])
    broken["images"] = ["images/missing.png"]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows[:2] + [json.dumps(broken)]) + "\n")
    (tmp_path / "images").symlink_to(shapes_dir / "images")
    monkeypatch.setattr(run, "load_policy", lambda *a: pytest.fail("a model loaded"))
    assert run_cli("sft", *run_overrides(tiny_vlm_dir, data, tmp_path / "out")) == 2
    assert "data.train row 2: images 0: image file" in capsys.readouterr().err


def test_grpo_generates_and_trains_with_the_images(tiny_vlm_dir, shapes_dir, tmp_path):
    """The hf engine samples with each prompt's images and the trainer scores the completions with the same images:
    their log-probs agree (sampler_logprob_gap ~ 0; either side without the pixels would be far off). samples.jsonl
    names each sample's images, and report.html shows them beside the completions."""
    out = tmp_path / "run"
    assert run_cli("grpo", *run_overrides(tiny_vlm_dir, shapes_dir / "grpo_train.jsonl", out, "train.max_steps=2",
                                         "train.per_device_train_batch_size=8", "algo.num_generations=4",
                                         "generation.max_completion_length=6", "data.max_length=64", "algo.beta=0.04",
                                         "rewards=[{name: format, kwargs: {pattern: '.*e.*'}}]",
                                         "train.report=true")) == 0
    rows = [json.loads(line) for line in (shapes_dir / "grpo_train.jsonl").read_text().splitlines()]
    question = lambda prompt: prompt[0]["content"][-1]["text"]  # noqa: E731
    images_of: dict[str, list] = {}  # a question's images, over the rows that ask it (3 questions, 24 images)
    for row in rows:
        images_of.setdefault(question(row["prompt"]), []).append([str((shapes_dir / name).resolve())
                                                                  for name in row["images"]])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4  # 2 logging steps x algo.log_samples prompts x 4 completions
    assert all(s["images"] in images_of[question(s["prompt"])] for s in samples)
    assert all(samples[i]["images"] == samples[i - i % 4]["images"] for i in range(len(samples)))  # per group
    report = (out / "report.html").read_text()
    assert report.count("<img class='thumb'") == 2 * 2  # each shown prompt's image, once beside its completions
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sampler_logprob_gap"] < 1e-4 for r in rows), rows
    assert any(r["reward/std"] > 0 for r in rows)
    initial, trained = load_file(str(tiny_vlm_dir / "model.safetensors")), final_weights(out)
    assert sum(not torch.equal(initial[k], trained[k]) for k in initial) > len(initial) // 2


def test_dpo_sequence_logprobs_equal_trls(tiny_vlm_dir, shapes_dir):
    """TRL 1.16's DPOTrainer scores DataCollatorForVisionPreference's batch: prompt + chosen rows then prompt +
    rejected rows, each with the prompt's images, summing the completion tokens' log-probs. Ours on the same pairs: the
    same token ids and pixels, and the same chosen / rejected sums (the DPO loss on top is the text one)."""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from posttrain.data import collate_preference, tokenize_preference
    from posttrain.models.forward import policy_logprobs

    model_cfg = ModelConfig(name_or_path=str(tiny_vlm_dir))
    processor = load_processor(model_cfg, load_tokenizer(model_cfg))
    file = shapes_dir / "dpo_train.jsonl"
    rows = [json.loads(line) for line in file.read_text().splitlines()[:3]]
    trl_batch = DataCollatorForVisionPreference(processor)(
        [{**r, "images": [Image.open(shapes_dir / p) for p in r["images"]]} for r in rows])
    dataset = load_rows(str(file)).select(range(3))
    examples, _ = tokenize_preference(dataset, processor.tokenizer, DataConfig(max_length=128), "data.train",
                                      images=RowImages.of(dataset, processor, str(file), "data.train"))
    batch = with_images(collate_preference(examples, processor.tokenizer.pad_token_id),
                        [e["images"] for e in examples] * 2, processor)
    keep_BT = batch.attention_mask_BT.bool()
    width = keep_BT.shape[1]
    assert torch.equal(trl_batch["input_ids"][:, :width][keep_BT], batch.input_ids_BT[keep_BT])
    past_BT = trl_batch["completion_mask"].bool().clone()
    past_BT[:, :width] &= ~keep_BT
    newline = processor.tokenizer.convert_tokens_to_ids("Ċ")
    assert past_BT.sum(-1).tolist() == [1] * 6 and set(trl_batch["input_ids"][past_BT].tolist()) == {newline}
    assert torch.equal(trl_batch["pixel_values"], batch.vision.pixel_values)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    with torch.no_grad():
        ours_B = (policy_logprobs(model, batch) * batch.completion_mask_BT).sum(-1)
        inputs = {k: v for k, v in trl_batch.items() if k != "completion_mask"}
        logits_BTV = model(**inputs).logits[:, :-1]
        logprobs_BT = logits_BTV.log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
        theirs_B = (logprobs_BT * (trl_batch["completion_mask"].bool() & ~past_BT)[:, 1:]).sum(-1)
    assert torch.allclose(ours_B, theirs_B, rtol=1e-5, atol=1e-4), (ours_B, theirs_B)


def test_lora_dpo_adapts_the_language_model_and_merges(tiny_vlm_dir, shapes_dir, tmp_path):
    """LoRA on a VLM: adapters on the language model only, the reference is the adapter-off policy; final/ holds the
    merged weights (vision tower and projector exactly as loaded) and the adapter alone."""
    out = tmp_path / "run"
    assert run_cli("dpo", *run_overrides(tiny_vlm_dir, shapes_dir / "dpo_train.jsonl", out, "train.max_steps=2",
                                         "train.per_device_train_batch_size=4", "data.max_length=128",
                                         "model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8")) == 0
    assert abs(metrics(out)[0]["loss"] - 0.6931) < 1e-3
    initial, merged = load_file(str(tiny_vlm_dir / "model.safetensors")), final_weights(out)
    assert merged.keys() == initial.keys()
    vision = [k for k in initial if "visual." in k]
    assert vision and all(torch.equal(initial[k], merged[k]) for k in vision)
    assert any(not torch.equal(initial[k], merged[k]) for k in initial if k.endswith("q_proj.weight"))
    assert (out / "final" / "adapter" / "adapter_model.safetensors").is_file()


def test_dpo_with_images_resumes_exactly(tiny_vlm_dir, shapes_dir, tmp_path):
    """A run stopped at a checkpoint and resumed gives the uninterrupted run's losses and weights (the images of each
    step's rows are read again from the data position alone)."""
    full, split = tmp_path / "full", tmp_path / "split"
    common = [*run_overrides(tiny_vlm_dir, shapes_dir / "dpo_train.jsonl", full, "train.max_steps=4",
                             "train.per_device_train_batch_size=4", "train.save_steps=2", "data.max_length=128",
                             "model.freeze_vision_tower=true")]
    assert run_cli("dpo", *common) == 0
    common = [o if not o.startswith("output_dir=") else f"output_dir={split}" for o in common]
    assert run_cli("dpo", *common, "train.max_steps_per_run=2") == 0
    assert not (split / "final").exists() and (split / "checkpoints" / "step-2").exists()
    assert run_cli("dpo", *common, "train.resume_from_checkpoint=auto") == 0
    a, b = step_losses(full), step_losses(split)
    assert sorted(b) == [1, 2, 3, 4] and all(b[s] == pytest.approx(a[s], abs=1e-6) for s in a), (a, b)
    assert max_weight_diff(final_weights(full), final_weights(split)) < 1e-6
