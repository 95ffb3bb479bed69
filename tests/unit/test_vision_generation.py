"""What a vLLM engine gets of a vision-language policy (data/images.narrowed, generation/server.image_parts,
generation/vllm_engine.check_widened, base.vllm_sampling), what a weight sync leaves out of it (weight_sync.frozen_in,
vision.sync_note), and the refusals where vLLM cannot load one. The engines themselves run in
tests/integration/test_vision_vllm.py."""

from __future__ import annotations

import base64
import io
import sys
from types import SimpleNamespace

import pytest
from PIL import Image

from posttrain.algorithms import ALGORITHMS
from posttrain.config.load import load_recipe
from posttrain.config.schema import ModelConfig
from posttrain.data import RowImages, tokenize_prompts
from posttrain.data.images import ImageEncoder, narrowed
from posttrain.distributed.weight_sync import frozen_in, sync_units
from posttrain.errors import UserError
from posttrain.generation.base import SamplingParams, vllm_sampling
from posttrain.generation.server import image_parts
from posttrain.generation.vllm_engine import check_widened
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.models.vision import (PROJECTOR_NAMES, TOWER_NAMES, check_vision_recipe, load_processor, sync_note,
                                     vllm_vision_problem)
from tests.unit.test_data_images import DATA, image_file, sft_rows, user


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    model_cfg = ModelConfig(name_or_path=str(tiny_vlm_dir))
    return load_processor(model_cfg, load_tokenizer(model_cfg))


def prompt_with_images(tmp_path, processor, sizes):
    """One tokenised prompt with len(sizes) images of those sizes (widened, as the trainer holds it)."""
    names = [image_file(tmp_path / f"{k}.png", size, (40 * k, 90, 200)).name for k, size in enumerate(sizes)]
    dataset, source = sft_rows(tmp_path, [{"prompt": [user(len(sizes), "Which is red?")], "images": names}])
    examples, _ = tokenize_prompts(dataset, processor.tokenizer, DATA, "data.train",
                                   images=RowImages.of(dataset, processor, source, "data.train"))
    return examples[0]["prompt_ids"], examples[0]["images"]


def test_narrowing_gives_the_prompt_before_the_processor_widened_it(tmp_path, processor):
    """vLLM takes one placeholder per image and widens it itself: narrowed() gives the processor's input back."""
    ids, refs = prompt_with_images(tmp_path, processor, [(56, 84), (112, 56)])
    encoder = ImageEncoder(processor)
    narrow = encoder.narrow(ids, refs)
    image_id = encoder.image_token_id
    assert ids.count(image_id) == 6 + 8 and narrow.count(image_id) == 2
    text = processor.tokenizer.decode(narrow)
    images = [Image.open(tmp_path / f"{k}.png") for k in range(2)]
    assert processor(text=[text], images=images)["input_ids"][0] == ids  # widened again: the trainer's prompt
    with pytest.raises(ValueError, match="position .* are not image 0's 8 widened"):
        narrowed(ids, [refs[1], refs[1]], image_id)  # image 0 is 6 tokens wide, not 8
    with pytest.raises(ValueError, match="past its 1 images"):
        narrowed(ids, refs[:1], image_id)


def test_a_server_request_carries_the_narrowed_prompt_and_the_images(tmp_path, processor):
    ids, refs = prompt_with_images(tmp_path, processor, [(56, 56)])
    body = image_parts(ImageEncoder(processor), ids, refs)
    assert body["token_ids"] == ImageEncoder(processor).narrow(ids, refs)
    (part,) = body["content_parts"]
    assert part["type"] == "image_url" and part["url"].startswith("data:image/png;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
    assert sent.convert("RGB").tobytes() == refs[0].open().tobytes()


def test_the_engines_widening_must_equal_the_trainers():
    check_widened([[1, 5, 5, 2]], [[1, 5, 5, 2]])
    with pytest.raises(RuntimeError, match="prompt 1: vLLM widened its image placeholders to 3 prompt tokens, the "
                                           "policy's processor to 4"):
        check_widened([[1, 2], [1, 5, 5, 2]], [[1, 2], [1, 5, 2]])


def test_vllm_never_samples_the_image_placeholder():
    params = SamplingParams(max_new_tokens=4, seed=3)
    assert "logit_bias" not in vllm_sampling(params, (2,), 0)
    assert vllm_sampling(params, (2,), 0, never=635)["logit_bias"] == {635: -100.0}


@pytest.mark.parametrize("tower, projector, left_out, note", [
    (False, False, set(), "the vision tower and projector train: sent with every sync"),
    (True, False, {"tower"}, "the vision tower is frozen: sent with the first sync only; the projector trains"),
    (True, True, {"tower", "projector"}, "the vision tower and projector are frozen: sent with the first sync only"),
])
def test_a_sync_leaves_a_frozen_tower_out(tiny_vlm_dir, tower, projector, left_out, note):
    """After the first sync, the frozen vision tensors stay out (Qwen2-VL's merger sits inside `visual`: it goes with
    every sync unless the projector is frozen too); the language model always goes."""
    model = load_causal_lm(ModelConfig(name_or_path=str(tiny_vlm_dir), freeze_vision_tower=tower,
                                       freeze_projector=projector))
    units = sync_units(model)
    out = {u.name for u in frozen_in(units, TOWER_NAMES + PROJECTOR_NAMES)}
    merger = {u.name for u in units if ".merger." in u.name}
    tower_names = {u.name for u in units if ".visual." in u.name} - merger
    assert merger and tower_names
    assert out == (tower_names if "tower" in left_out else set()) | (merger if "projector" in left_out else set())
    assert sync_note(model).startswith(note)


def grpo_recipe(tiny_vlm_dir, *overrides):
    return load_recipe(None, [f"model.name_or_path={tiny_vlm_dir}", "data.train=x.jsonl",
                              "rewards=[{name: exact_match}]", *overrides], ALGORITHMS["grpo"][0])


def test_vllm_with_images_is_refused_where_vllm_cannot_load_a_vlm(tiny_vlm_dir, monkeypatch):
    """vLLM 0.32's Qwen2-VL / LLaVA code imports transformers' torchvision image processors: without a torchvision
    that imports, the recipe stops before anything loads, naming the cause (with one, it goes on)."""
    recipe = grpo_recipe(tiny_vlm_dir, "generation.engine=vllm")
    algorithm = ALGORITHMS["grpo"][1](recipe)
    vllm_vision_problem.cache_clear()
    monkeypatch.setitem(sys.modules, "torchvision", None)  # what a venv without torchvision answers
    with pytest.raises(UserError, match=r"generation.engine=vllm \(placement colocated\) with the vision-language "
                                        r"model .*torchvision does not import here \(ModuleNotFoundError"):
        check_vision_recipe(recipe, algorithm)
    monkeypatch.undo()
    vllm_vision_problem.cache_clear()
    if vllm_vision_problem() is None:
        assert check_vision_recipe(recipe, algorithm)


def test_posttrain_serve_refuses_a_vlm_without_torchvision(tiny_vlm_dir, monkeypatch):
    pytest.importorskip("vllm", reason="posttrain serve needs vLLM")
    from posttrain.generation.serve import check_serve_args

    vllm_vision_problem.cache_clear()
    monkeypatch.setitem(sys.modules, "torchvision", None)
    args = SimpleNamespace(model=str(tiny_vlm_dir), host="127.0.0.1", port=1, vllm_args=[], kv_cache_gb=None)
    with pytest.raises(UserError, match="is a vision-language model: vLLM's code for those imports"):
        check_serve_args(args)
    monkeypatch.undo()
    vllm_vision_problem.cache_clear()


def test_adapter_only_syncs_are_refused_for_a_vlm(tiny_vlm_dir):
    recipe = grpo_recipe(tiny_vlm_dir, "generation.engine=vllm", "generation.placement=servers",
                         "generation.servers=[http://127.0.0.1:1]", "model.lora.enabled=true",
                         "generation.lora_sync=adapter")
    with pytest.raises(UserError, match="generation.lora_sync=adapter with the vision-language model"):
        check_vision_recipe(recipe, ALGORITHMS["grpo"][1](recipe))
