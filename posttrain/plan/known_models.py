"""Built-in shapes of the model families people plan for, so `posttrain plan` needs no download.

The numbers are the published config.json values of each hub model (the fields that set the parameter count and
activation sizes). `posttrain plan` uses them only when the model is neither a local directory nor in the Hugging
Face cache; tests/unit/test_plan_known_models.py builds each on the meta device and checks a handful against the
parameter counts their model cards publish. Instruct / chat / -it / -pt variants share their base model's shape.
Vision-language models (models/vision.VISION_MODELS, which is_vision_model reads offline too) have a text and a
vision config, and the image tokens of the largest image their processor makes, which the planner takes as a row's
image tokens unless told (`posttrain plan --image-tokens`).
"""

from __future__ import annotations

from typing import Optional

from posttrain.models.vision import VISION_MODELS, built_in_config

# hub id: (model_type, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
#          head_dim, vocab_size, tie_word_embeddings)
KNOWN_MODELS: dict[str, tuple[str, int, int, int, int, int, int, int, bool]] = {
    "Qwen/Qwen2.5-0.5B": ("qwen2", 896, 4864, 24, 14, 2, 64, 151936, True),
    "Qwen/Qwen2.5-1.5B": ("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True),
    "Qwen/Qwen2.5-3B": ("qwen2", 2048, 11008, 36, 16, 2, 128, 151936, True),
    "Qwen/Qwen2.5-7B": ("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False),
    "Qwen/Qwen2.5-14B": ("qwen2", 5120, 13824, 48, 40, 8, 128, 152064, False),
    "Qwen/Qwen2.5-32B": ("qwen2", 5120, 27648, 64, 40, 8, 128, 152064, False),
    "Qwen/Qwen2.5-72B": ("qwen2", 8192, 29568, 80, 64, 8, 128, 152064, False),
    "Qwen/Qwen3-0.6B": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-1.7B": ("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-4B": ("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True),
    "Qwen/Qwen3-8B": ("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False),
    "Qwen/Qwen3-14B": ("qwen3", 5120, 17408, 40, 40, 8, 128, 151936, False),
    "Qwen/Qwen3-32B": ("qwen3", 5120, 25600, 64, 64, 8, 128, 151936, False),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", 2048, 6144, 48, 32, 4, 128, 151936, False),
    "Qwen/Qwen3-235B-A22B": ("qwen3_moe", 4096, 12288, 94, 64, 4, 128, 151936, False),
    "meta-llama/Llama-3.2-1B": ("llama", 2048, 8192, 16, 32, 8, 64, 128256, True),
    "meta-llama/Llama-3.2-3B": ("llama", 3072, 8192, 28, 24, 8, 128, 128256, True),
    "meta-llama/Llama-3.1-8B": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
    "meta-llama/Llama-3.1-70B": ("llama", 8192, 28672, 80, 64, 8, 128, 128256, False),
    "mistralai/Mistral-7B-v0.1": ("mistral", 4096, 14336, 32, 32, 8, 128, 32000, False),
    "mistralai/Mistral-7B-v0.3": ("mistral", 4096, 14336, 32, 32, 8, 128, 32768, False),
    "mistralai/Mistral-Nemo-Base-2407": ("mistral", 5120, 14336, 40, 32, 8, 128, 131072, False),
    "mistralai/Mistral-Small-24B-Base-2501": ("mistral", 5120, 32768, 40, 32, 8, 128, 131072, False),
    "mistralai/Mixtral-8x7B-v0.1": ("mixtral", 4096, 14336, 32, 32, 8, 128, 32000, False),
    "mistralai/Mixtral-8x22B-v0.1": ("mixtral", 6144, 16384, 56, 48, 8, 128, 32000, False),
    "google/gemma-2-2b": ("gemma2", 2304, 9216, 26, 8, 4, 256, 256000, True),
    "google/gemma-2-9b": ("gemma2", 3584, 14336, 42, 16, 8, 256, 256000, True),
    "google/gemma-2-27b": ("gemma2", 4608, 36864, 46, 32, 16, 128, 256000, True),
    "google/gemma-3-1b-pt": ("gemma3_text", 1152, 6912, 26, 4, 1, 256, 262144, True),
    "google/gemma-3-4b-pt": ("gemma3_text", 2560, 10240, 34, 8, 4, 256, 262208, True),  # the language model of each
    "google/gemma-3-12b-pt": ("gemma3_text", 3840, 15360, 48, 16, 8, 256, 262208, True),  # multimodal Gemma-3 (its
    "google/gemma-3-27b-pt": ("gemma3_text", 5376, 21504, 62, 32, 16, 128, 262208, True),  # vision tower: ~0.4B more)
    "microsoft/phi-4": ("phi3", 5120, 17920, 40, 40, 10, 128, 100352, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": ("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": ("qwen2", 5120, 13824, 48, 40, 8, 128, 152064, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": ("qwen2", 5120, 27648, 64, 40, 8, 128, 152064, False),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": ("llama", 8192, 28672, 80, 64, 8, 128, 128256, False),
}
# mixture-of-experts fields: experts per layer, experts per token, each expert's intermediate size
EXPERTS: dict[str, dict[str, int]] = {
    "Qwen/Qwen3-30B-A3B": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "Qwen/Qwen3-235B-A22B": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536},
    "mistralai/Mixtral-8x7B-v0.1": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "mistralai/Mixtral-8x22B-v0.1": {"num_local_experts": 8, "num_experts_per_tok": 2},
}
# other hub names of the same shapes
ALIASES = {
    "meta-llama/Meta-Llama-3-8B": "meta-llama/Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3-70B": "meta-llama/Llama-3.1-70B",
    "meta-llama/Meta-Llama-3.1-70B": "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.3-70B": "meta-llama/Llama-3.1-70B",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistralai/Mistral-7B-v0.1",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistralai/Mistral-7B-v0.1",
    "mistralai/Mistral-7B-Instruct-v0.3": "mistralai/Mistral-7B-v0.3",
    "mistralai/Mistral-Nemo-Instruct-2407": "mistralai/Mistral-Nemo-Base-2407",
    "mistralai/Mistral-Small-24B-Instruct-2501": "mistralai/Mistral-Small-24B-Base-2501",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mistralai/Mixtral-8x7B-v0.1",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Thinking-2507": "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-235B-A22B-Instruct-2507": "Qwen/Qwen3-235B-A22B",
    "Qwen/Qwen3-235B-A22B-Thinking-2507": "Qwen/Qwen3-235B-A22B",
    "Qwen/Qwen3-VL-8B-Thinking": "Qwen/Qwen3-VL-8B-Instruct",
}
VARIANT_SUFFIXES = ("-instruct", "-base", "-chat", "-it", "-pt")  # -it/-pt: Gemma's names for instruct/pretrained


def known_name(name: str) -> Optional[str]:
    """The table's hub id for `name` (any case; an instruct, chat or base variant of a listed model), or None."""
    by_lower = {k.lower(): k for k in (*KNOWN_MODELS, *VISION_MODELS, *ALIASES)}
    wanted = name.strip().rstrip("/").lower()
    found = by_lower.get(wanted)
    if found is None:
        for suffix in VARIANT_SUFFIXES:  # Qwen2.5-7B-Instruct -> Qwen2.5-7B, gemma-3-1b-it -> gemma-3-1b-pt
            stem = wanted.removesuffix(suffix)
            found = by_lower.get(stem) or by_lower.get(stem + "-pt") or by_lower.get(stem + "-base")
            if stem != wanted and found:
                break
            found = None
    return ALIASES.get(found, found) if found else None


def known_image_tokens(name: str) -> Optional[int]:
    """Image tokens of the largest image a built-in vision-language model's processor makes, or None."""
    key = known_name(name)
    return VISION_MODELS[key][3] if key in VISION_MODELS else None


def known_config(name: str):
    """A transformers config with the published shape of `name`, or None when the table does not list it."""
    from transformers import AutoConfig

    key = known_name(name)
    if key is None:
        return None
    if key in VISION_MODELS:
        return built_in_config(key)
    model_type, hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied = KNOWN_MODELS[key]
    return AutoConfig.for_model(model_type, hidden_size=hidden, intermediate_size=intermediate,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied, **EXPERTS.get(key, {}))
