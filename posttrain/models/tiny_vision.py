"""A tiny random vision-language model with a working processor: for tests, the vision recipes and the docs.

    from posttrain.models.tiny_vision import make_tiny_vlm
    make_tiny_vlm("tiny-vl/")            # Qwen2-VL: 2 vision blocks of 32, 2 text layers of 64, ~0.2M parameters

The directory holds what a hub Qwen2-VL checkpoint holds: config.json, model.safetensors, generation_config.json, the
tokenizer (tiny.py's locally trained byte-level BPE plus Qwen2-VL's vision tokens), a chat template that renders
TRL's content lists ({"type": "image"} -> <|vision_start|><|image_pad|><|vision_end|>), and processor_config.json
(Qwen2VLProcessor with its image processor, as Qwen2VLProcessor.save_pretrained writes it; no video processor, which
transformers builds only with torchvision). It loads with AutoModelForImageTextToText; the processor with
models/vision.load_processor (AutoProcessor, or the same class images-only where the video half cannot be built). The image processor
sizes every image to between 1 and 16 image tokens (28 x 28 pixels each), so a test image costs a few tokens.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.models.tiny import IM_END, IM_START, train_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_ARCHS = ("qwen2_vl",)
PATCH, MERGE = 14, 2
"""Qwen2-VL's vision patch (pixels) and the merger's window: one image token covers (PATCH * MERGE)^2 pixels."""

# ChatML whose contents may be TRL's lists of parts: an image part renders as Qwen2-VL's placeholder (the processor
# widens <|image_pad|> to the image's token count), a text part as its text. The assistant turn sits inside
# {% generation %} like tiny.py's template, for assistant-only loss.
_CONTENT = ("{%- if content is string %}{{- content }}{%- else %}{%- for part in content %}"
            "{%- if part['type'] == 'image' %}{{- '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
            "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}")
VISION_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- set content = message['content'] if message['content'] is not none else '' %}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}" + _CONTENT + "{{- '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}" + _CONTENT + "{{- '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tiny_vlm(out_dir, arch: str = "qwen2_vl", seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                  num_heads: int = 2, vision_width: int = 32, vision_depth: int = 2,
                  max_position_embeddings: int = 1024) -> Path:
    """Write a random-init Qwen2-VL (float32, tied embeddings), its tokenizer, chat template and image processor to
    out_dir. head_dim is hidden_size / num_heads; the 3-D rope splits its half into (t, h, w) sections."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig, Qwen2VLConfig, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from posttrain.errors import UserError
    from posttrain.models.vision import images_only

    if arch not in VISION_ARCHS:
        raise UserError(f"make_tiny_vlm: arch must be one of {', '.join(VISION_ARCHS)}, got '{arch}'")
    half = hidden_size // num_heads // 2
    if hidden_size % num_heads or half < 3:
        raise UserError(f"make_tiny_vlm: hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) into heads "
                        "of at least 6")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, VISION_START, VISION_END, IMAGE_PAD,
                                                                VIDEO_PAD]})
    tokenizer.chat_template = VISION_CHATML_TEMPLATE
    tokenizer.model_max_length = max_position_embeddings
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("image", IMAGE_PAD), ("video", VIDEO_PAD), ("start", VISION_START), ("end", VISION_END),
            ("eos", IM_END), ("pad", tokenizer.pad_token))}
    mrope = [half - 2 * (half // 3)] + [half // 3] * 2  # (t, h, w) rotary sections, summing to head_dim / 2
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
                max_position_embeddings=max_position_embeddings, eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                bos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": mrope,
                                                    "rope_theta": 10000.0})
    vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image"],
                           video_token_id=ids["video"], vision_start_token_id=ids["start"],
                           vision_end_token_id=ids["end"], tie_word_embeddings=True, eos_token_id=ids["eos"],
                           pad_token_id=ids["pad"], bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    side = PATCH * MERGE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=16 * side * side, patch_size=PATCH,
                                               merge_size=MERGE, temporal_patch_size=2)
    images_only(Qwen2VLProcessor)(image_processor, tokenizer, chat_template=VISION_CHATML_TEMPLATE).save_pretrained(out)
    return out
