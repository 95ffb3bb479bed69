"""Tiny random vision-language models with working processors: for tests, the vision recipes and the docs.

    from posttrain.models.tiny_vision import make_tiny_vlm
    make_tiny_vlm("tiny-vl/")                  # Qwen2-VL: 2 vision blocks of 32, 2 text layers of 64, ~0.2M parameters
    make_tiny_vlm("tiny-llava/", arch="llava") # LLaVA: a 2-layer CLIP tower of 32, a projector, a 2-layer Llama of 64

Each directory holds what a hub checkpoint of its family holds: config.json, model.safetensors,
generation_config.json, the tokenizer (tiny.py's locally trained byte-level BPE plus the family's image tokens), a
chat template that renders TRL's content lists ({"type": "image"} -> the family's placeholder: Qwen2-VL's
<|vision_start|><|image_pad|><|vision_end|>, LLaVA's <image>) and processor_config.json, as the processor's
save_pretrained writes it. Both load with AutoModelForImageTextToText. LLaVA's processor loads with AutoProcessor;
Qwen2-VL's processor_config.json also holds a video processor (as a hub checkpoint's), which transformers builds
only with torchvision: it loads with models/vision.load_processor, which builds the same class images-only where the
video half cannot be built (vLLM, which builds the full processor, needs torchvision: docs/vision.md).
Qwen2-VL sizes every image to between 1 and 16 image tokens (28 x 28 pixels each); the tiny LLaVA resizes every image
to 28 x 28 pixels, 4 image tokens.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.models.tiny import IM_END, IM_START, train_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_ARCHS = ("qwen2_vl", "llava")
LLAVA_IMAGE = "<image>"
PATCH, MERGE = 14, 2
"""Qwen2-VL's vision patch (pixels) and the merger's window: one image token covers (PATCH * MERGE)^2 pixels."""

# ChatML whose contents may be TRL's lists of parts: an image part renders as Qwen2-VL's placeholder (the processor
# widens <|image_pad|> to the image's token count), a text part as its text. The assistant turn sits inside
# {% generation %} like tiny.py's template, for assistant-only loss.
def vision_chatml(placeholder: str) -> str:
    """ChatML whose image parts render as `placeholder`."""
    content = ("{%- if content is string %}{{- content }}{%- else %}{%- for part in content %}"
               "{%- if part['type'] == 'image' %}{{- '" + placeholder + "' }}"
               "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}")
    return ("{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- set content = message['content'] if message['content'] is not none else '' %}"
            "{%- if message['role'] == 'assistant' %}"
            "{% generation %}" + content + "{{- '<|im_end|>' }}{% endgeneration %}"
            "{%- else %}" + content + "{{- '<|im_end|>' }}{%- endif %}"
            "{{- '\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


VISION_CHATML_TEMPLATE = vision_chatml(VISION_START + IMAGE_PAD + VISION_END)


def make_tiny_vlm(out_dir, arch: str = "qwen2_vl", seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                  num_heads: int = 2, vision_width: int = 32, vision_depth: int = 2,
                  max_position_embeddings: int = 1024) -> Path:
    """Write a random-init `arch` (qwen2_vl or llava) model (float32, tied embeddings), its tokenizer, chat template
    and processor to out_dir. head_dim is hidden_size / num_heads (Qwen2-VL's 3-D rope splits its half into (t, h,
    w) sections)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from posttrain.errors import UserError

    if arch not in VISION_ARCHS:
        raise UserError(f"make_tiny_vlm: arch must be one of {', '.join(VISION_ARCHS)}, got '{arch}'")
    if hidden_size % num_heads or hidden_size // num_heads < 6:
        raise UserError(f"make_tiny_vlm: hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) into heads "
                        "of at least 6")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.model_max_length = max_position_embeddings
    text = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=1, max_position_embeddings=max_position_embeddings,
                bos_token_id=None)
    build = _qwen2_vl if arch == "qwen2_vl" else _llava
    config, processor = build(tokenizer, text, vision_width, vision_depth)
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id
    config.text_config.update(dict(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad))
    config.update(dict(tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=None))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    if arch == "qwen2_vl":
        _add_video_processor(out / "processor_config.json")
    return out


def _add_video_processor(path: Path) -> None:
    """Put a video processor beside the image processor in processor_config.json, as a hub Qwen2-VL checkpoint has:
    transformers builds the full processor from it wherever torchvision is installed, and vLLM (which always builds
    the full processor) needs it to load the model. Written by hand: transformers builds the class only with
    torchvision. Its sizes are the image processor's; posttrain never sends videos."""
    import json

    config = json.loads(path.read_text())
    image = config["image_processor"]
    config["video_processor"] = {
        **{k: image[k] for k in ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean",
                                 "image_std", "merge_size", "patch_size", "resample", "rescale_factor", "size",
                                 "temporal_patch_size")},
        "do_sample_frames": False, "max_frames": 768, "max_video_tokens": 128000, "min_frames": 4,
        "return_metadata": False, "video_processor_type": "Qwen2VLVideoProcessor"}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _qwen2_vl(tokenizer, text: dict, vision_width: int, vision_depth: int):
    """(config, processor) of the tiny Qwen2-VL; adds its vision tokens and template to `tokenizer`."""
    from transformers import Qwen2VLConfig, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from posttrain.models.vision import images_only

    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, VISION_START, VISION_END, IMAGE_PAD,
                                                                VIDEO_PAD]})
    tokenizer.chat_template = VISION_CHATML_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("image", IMAGE_PAD), ("video", VIDEO_PAD), ("start", VISION_START), ("end", VISION_END))}
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    mrope = [half - 2 * (half // 3)] + [half // 3] * 2  # (t, h, w) rotary sections, summing to head_dim / 2
    config = Qwen2VLConfig(
        text_config={**text, "vocab_size": len(tokenizer),
                     "rope_parameters": {"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0}},
        vision_config=dict(depth=vision_depth, embed_dim=vision_width, hidden_size=text["hidden_size"], num_heads=2,
                           mlp_ratio=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"])
    side = PATCH * MERGE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=16 * side * side, patch_size=PATCH,
                                               merge_size=MERGE, temporal_patch_size=2)
    return config, images_only(Qwen2VLProcessor)(image_processor, tokenizer, chat_template=VISION_CHATML_TEMPLATE)


def _llava(tokenizer, text: dict, vision_width: int, vision_depth: int):
    """(config, processor) of the tiny LLaVA: a CLIP tower on 28 x 28 images (2 x 2 patches of 14: 4 image tokens,
    its CLS feature dropped as LLaVA's default strategy does), a 2-layer projector, a Llama."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, LLAVA_IMAGE]})
    template = vision_chatml(LLAVA_IMAGE)
    tokenizer.chat_template = template
    side = 2 * PATCH
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=vision_width, intermediate_size=2 * vision_width,
                                       num_hidden_layers=vision_depth, num_attention_heads=2, image_size=side,
                                       patch_size=PATCH, projection_dim=vision_width),
        text_config=LlamaConfig(**text, vocab_size=len(tokenizer)),
        image_token_id=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE), vision_feature_select_strategy="default",
        vision_feature_layer=-1)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return config, LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                                  vision_feature_select_strategy="default", image_token=LLAVA_IMAGE,
                                  num_additional_image_tokens=1, chat_template=template)
