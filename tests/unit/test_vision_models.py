"""Vision-language models (models/vision.py, models/tiny_vision.py): the tiny Qwen2-VL loads with transformers' own
classes, its vision tower and projector freeze apart, what posttrain cannot do with one yet is refused, and the
images reach the model (a row's loss moves with its image)."""

from __future__ import annotations

import dataclasses
import json

import datasets
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, LlavaProcessor, Qwen2VLProcessor

from posttrain.algorithms import ALGORITHMS
from posttrain.config.schema import ModelConfig, Recipe
from posttrain.config import DataConfig
from posttrain.data import RowImages, collate_padded, tokenize_sft, with_images
from posttrain.errors import UserError
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.models.vision import check_vision_recipe, freeze_vision, is_vision_model, load_processor


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    model_cfg = ModelConfig(name_or_path=str(tiny_vlm_dir))
    tokenizer = load_tokenizer(model_cfg)
    return model_cfg, load_processor(model_cfg, tokenizer), load_causal_lm(model_cfg)


@pytest.mark.parametrize("arch, model_class, processor_class", [
    ("qwen2_vl", "Qwen2VLForConditionalGeneration", Qwen2VLProcessor),
    ("llava", "LlavaForConditionalGeneration", LlavaProcessor),
])
def test_the_tiny_vlms_load_with_transformers_classes(vlm_dirs, arch, model_class, processor_class):
    model_cfg = ModelConfig(name_or_path=str(vlm_dirs[arch]))
    processor, model = load_processor(model_cfg, load_tokenizer(model_cfg)), load_causal_lm(model_cfg)
    assert is_vision_model(model_cfg) and type(model).__name__ == model_class
    assert type(AutoModelForImageTextToText.from_pretrained(vlm_dirs[arch])) is type(model)
    assert isinstance(processor, processor_class)
    assert model.config.get_text_config().vocab_size == len(processor.tokenizer)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert not is_vision_model(dataclasses.replace(model_cfg, name_or_path=str(vlm_dirs[arch].parent / "nothing")))


@pytest.mark.parametrize("arch, tower_name, projector_name", [("qwen2_vl", ".visual.", ".merger."),
                                                              ("llava", ".vision_tower.", ".multi_modal_projector.")])
def test_tower_and_projector_freeze_apart(vlm_dirs, arch, tower_name, projector_name):
    model = AutoModelForImageTextToText.from_pretrained(vlm_dirs[arch])
    tower = freeze_vision(model, tower=True, projector=False)
    assert tower and all(tower_name in n and projector_name not in n for n in tower)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(projector_name in n for n in trainable) and any("language_model" in n for n in trainable)
    assert not trainable & set(tower)
    projector = freeze_vision(model, tower=False, projector=True)
    assert projector and all(projector_name in n for n in projector)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable - set(projector)


def test_freezing_a_text_model_is_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(UserError, match="model.freeze_vision_tower: LlamaForCausalLM has no vision tower"):
        freeze_vision(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tower=True, projector=False)
    recipe = Recipe(model=ModelConfig(name_or_path=str(tiny_model_dir), freeze_projector=True))
    with pytest.raises(UserError, match="model.freeze_projector: .* is a text model"):
        check_vision_recipe(recipe, ALGORITHMS["sft"][1](recipe))


@pytest.mark.parametrize("command, override, message", [
    ("sft", "data.packing=true", "data.packing=true with the vision-language model"),
    ("sft", "train.max_tokens_per_microbatch=64", "train.max_tokens_per_microbatch with"),
    ("sft", "train.sequence_parallel_size=2", "train.sequence_parallel_size > 1 with"),
    ("rm", "seed=1", "posttrain rm with the vision-language model"),
    ("ppo", "seed=1 rewards=[{name: exact_match}]", "posttrain ppo with the vision-language model"),
    ("distill", "algo.teacher_model_name_or_path=teacher/", "posttrain distill with the vision-language model"),
    ("grpo", "agent.tools=[posttrain.demo.tools:calculator] rewards=[{name: exact_match}]",
     "agent.[*] with the vision-language model .*multi-turn agents on text prompts only"),
])
def test_what_is_not_done_is_refused(tiny_vlm_dir, command, override, message):
    from posttrain.config.load import load_recipe

    recipe = load_recipe(None, [f"model.name_or_path={tiny_vlm_dir}", "data.train=x.jsonl", *override.split(" ", 1)],
                         ALGORITHMS[command][0])
    with pytest.raises(UserError, match=message):
        check_vision_recipe(recipe, ALGORITHMS[command][1](recipe))


@pytest.mark.parametrize("command, data, extra", [
    ("rm", "dpo_train.jsonl", ()), ("ppo", "grpo_train.jsonl", ("rewards=[{name: exact_match}]",)),
    ("distill", "grpo_train.jsonl", ("algo.teacher_model_name_or_path={model}",)),
])
def test_a_refused_algorithm_exits_2_before_any_model_loads(tiny_vlm_dir, shapes_dir, tmp_path, monkeypatch, capsys,
                                                            command, data, extra):
    """The refusal is one message from the recipe checks (plan/preflight.RECIPE_CHECKS), ahead of every load (PPO's
    own checks read the model's vocabulary first: a VLM's is its language model's)."""
    import posttrain.run as run
    from tests.integration.helpers import run_cli, run_overrides

    monkeypatch.setattr(run, "load_policy", lambda *a: pytest.fail("a model loaded"))
    monkeypatch.setattr(run, "load_tokenizer", lambda *a: pytest.fail("a tokenizer loaded"))
    assert run_cli(command, *run_overrides(tiny_vlm_dir, shapes_dir / data, tmp_path / "out",
                                           *(e.replace("{model}", str(tiny_vlm_dir)) for e in extra))) == 2
    err = capsys.readouterr().err
    assert f"posttrain {command} with the vision-language model" in err and "sft, dpo, grpo only so far" in err


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_lora_goes_to_the_language_model_only(vlm_dirs, arch):
    """Qwen2-VL's tower names its layers qkv / fc1, LLaVA's CLIP tower q_proj / v_proj / fc1: none gets an adapter."""
    from posttrain.config.schema import LoraConfig
    from posttrain.models.load import apply_lora

    model = apply_lora(AutoModelForImageTextToText.from_pretrained(vlm_dirs[arch]),
                       LoraConfig(enabled=True, target_modules=("q_proj", "v_proj", "qkv", "fc1")))
    adapted = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert adapted and all(".language_model." in n for n in adapted)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapted


def sft_loss(model, batch):
    algorithm = ALGORITHMS["sft"][1](Recipe())
    return algorithm.loss(model, batch, algorithm.count(batch))[0]


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_a_rows_image_changes_its_loss(tmp_path, vlm_dirs, arch):
    """The images reach the model: the same text with another image scores differently; the same image the same."""
    model_cfg = ModelConfig(name_or_path=str(vlm_dirs[arch]))
    processor, model = load_processor(model_cfg, load_tokenizer(model_cfg)), load_causal_lm(model_cfg)
    for name, colour in (("red", (255, 0, 0)), ("red2", (255, 0, 0)), ("blue", (0, 0, 255))):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"{name}.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    file = tmp_path / "d.jsonl"
    file.write_text("".join(json.dumps({"messages": messages, "images": [f"{n}.png"]}) + "\n"
                            for n in ("red", "red2", "blue")))
    dataset = datasets.Dataset.from_json(str(file))
    examples, _ = tokenize_sft(dataset, processor.tokenizer, DataConfig(max_length=64), "data.train",
                               images=RowImages.of(dataset, processor, str(file), "data.train"))
    with torch.no_grad():
        losses = [sft_loss(model, with_images(collate_padded([e], 0), [e["images"]], processor)).item()
                  for e in examples]
    assert losses[0] == losses[1] and abs(losses[0] - losses[2]) > 1e-4


def test_the_hf_engine_generates_from_the_images_and_never_samples_a_placeholder(tmp_path, vlm):
    from posttrain.data.images import ImageEncoder, ImageRef
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.hf import HFEngine

    _, processor, model = vlm
    refs = []
    for name, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"{name}.png")
        refs.append(ImageRef(path=str(tmp_path / f"{name}.png"), tokens=4))
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    prompt = processor.tokenizer("<|im_start|>user\n<|vision_start|>" + processor.image_token * 4 +
                                 "<|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    engine = HFEngine(model, processor.tokenizer)
    engine.take_images(ImageEncoder(processor))
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    red, blue = (engine.generate([prompt], greedy, images=[[ref]]) for ref in refs)
    assert red.logprobs[0][0] != blue.logprobs[0][0]
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))  # make the placeholder likeliest
    with torch.no_grad():
        model.lm_head.bias[image_id] = 100.0
    try:
        sampled = engine.generate([prompt], SamplingParams(max_new_tokens=4, seed=0), images=[[refs[0]]])
    finally:
        model.lm_head.bias = None
    assert image_id not in sampled.completion_ids[0]


def test_plan_counts_the_vision_tower_and_never_suggests_packing(tiny_vlm_dir, vlm):
    from posttrain.config.load import load_recipe
    from posttrain.models.vision import vision_parameters
    from posttrain.plan import run_plan
    from posttrain.plan.shape import model_shape

    _, _, model = vlm
    tower, _ = vision_parameters(model)
    sizes = dict((name, p.numel()) for name, p in model.named_parameters())
    full = model_shape(ModelConfig(name_or_path=str(tiny_vlm_dir)))
    frozen = model_shape(ModelConfig(name_or_path=str(tiny_vlm_dir), freeze_vision_tower=True))
    assert full.parameters == full.trainable == sum(sizes.values())  # tied embeddings once, as named_parameters
    assert full.trainable - frozen.trainable == sum(sizes[name] for name in tower)
    recipe = load_recipe(None, [f"model.name_or_path={tiny_vlm_dir}", "data.train=x.jsonl"], ALGORITHMS["sft"][0])
    text = run_plan("sft", recipe, None, [], 1, 1, "80GiB", as_json=False)
    assert "recommended:" in text and "max_tokens_per_microbatch" not in text


def test_plan_counts_lora_in_the_language_model_only(tiny_llava_dir):
    """LLaVA's CLIP tower names layers q_proj / v_proj like the Llama: the plan counts the adapters peft makes."""
    from posttrain.config.schema import LoraConfig
    from posttrain.models.load import apply_lora
    from posttrain.plan.shape import model_shape

    lora = LoraConfig(enabled=True, r=4, target_modules=("q_proj", "v_proj"))
    adapted = apply_lora(AutoModelForImageTextToText.from_pretrained(tiny_llava_dir), lora)
    made = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
    assert model_shape(ModelConfig(name_or_path=str(tiny_llava_dir), lora=lora)).trainable == made
