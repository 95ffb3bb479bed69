"""Vision-language models: which recipes name one, their processor, and which of their parameters see images.

    if is_vision_model(recipe.model):                       # config.json has a vision_config
        processor = load_processor(recipe.model, tokenizer)   # the model's AutoProcessor, around our tokenizer
    frozen = freeze_vision(model, tower=True, projector=False)  # names of the parameters now frozen

A processor of the Qwen-VL family also holds a video processor, which transformers builds only with torchvision;
without torchvision `load_processor` builds the same processor class minus its video half (images only), since
posttrain trains on images and never on videos. The result answers `processor(text=..., images=...)` exactly as the
full processor does (tests/unit/test_vision_models.py checks it against the image processor's own grid).
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Optional

from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError

TOWER_NAMES = ("visual", "vision_tower", "vision_model")
"""Module names of the vision encoder (Qwen-VL, LLaVA / Gemma 3, Idefics3 / SmolVLM)."""
PROJECTOR_NAMES = ("merger", "deepstack_merger_list", "multi_modal_projector", "connector")
"""Module names of the layers that map image features into the language model's space (Qwen-VL keeps its merger
inside the vision module: freezing the tower leaves it to `model.freeze_projector`)."""


# vision-language models: hub id -> (model_type, text_config, vision_config, image tokens of the largest image the
# model's processor makes: its max_pixels / (patch_size x spatial_merge_size)^2 = 16384 for both)
VISION_MODELS: dict[str, tuple[str, dict, dict, int]] = {
    "Qwen/Qwen2.5-VL-7B-Instruct": (
        "qwen2_5_vl",
        dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
             rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
        dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
             hidden_act="silu"),
        12845056 // 28**2),
    "Qwen/Qwen3-VL-8B-Instruct": (
        "qwen3_vl",
        dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "mrope_section": [24, 20, 20],
                                                         "mrope_interleaved": True, "rope_theta": 5e6}),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096, patch_size=16,
             spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
             deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
        16777216 // 32**2),
}


def built_in_config(name: str):
    """transformers' config of a VISION_MODELS entry (exact hub id), built without a download."""
    from transformers import AutoConfig

    model_type, text, vision, _ = VISION_MODELS[name]
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=False)


def _local_config(model_cfg: ModelConfig) -> Optional[dict]:
    path = Path(model_cfg.name_or_path).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def is_vision_model(model_cfg: ModelConfig) -> bool:
    """True when the recipe's model is a vision-language model (its config has a vision_config): read from the local
    config.json, or the hub config otherwise."""
    config = _local_config(model_cfg)
    if config is None:
        config = _hub_config(model_cfg.name_or_path, model_cfg.revision)
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


@functools.lru_cache(maxsize=8)
def _hub_config(name: str, revision: Optional[str]) -> Optional[dict]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, revision=revision).to_dict()
    except (OSError, ValueError):
        known = {k.lower(): k for k in VISION_MODELS}.get(name.lower())  # offline: the built-in shapes
        return built_in_config(known).to_dict() if known else None


def load_processor(model_cfg: ModelConfig, tokenizer):
    """The model's processor, holding `tokenizer` (load_tokenizer's: pad token, chat template override). Where
    transformers cannot build its video processor (no torchvision, or no video processor saved), the same class
    images-only."""
    from transformers import AutoImageProcessor, AutoProcessor

    src = str(Path(model_cfg.name_or_path).expanduser()) if _local_config(model_cfg) else model_cfg.name_or_path
    kwargs = dict(revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code)
    try:
        processor = AutoProcessor.from_pretrained(src, **kwargs)
    except (ImportError, OSError, ValueError) as e:
        cls = _processor_class(src, kwargs)
        if cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
            raise UserError(f"could not load the processor of '{src}': {type(e).__name__}: {e}") from e
        processor = images_only(cls)(AutoImageProcessor.from_pretrained(src, **kwargs), tokenizer,
                                      chat_template=tokenizer.chat_template)
    processor.tokenizer = tokenizer
    if getattr(processor, "image_token", None) is None:
        raise UserError(f"the processor of '{src}' ({type(processor).__name__}) names no image token; posttrain "
                        "trains processors that mark each image with one")
    return processor


def _processor_class(src: str, kwargs: dict):
    """The processor class a model directory names (processor_config.json, else preprocessor_config.json), or None."""
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.processing_utils import ProcessorMixin

    try:
        name = ProcessorMixin.get_processor_dict(src, **kwargs)[0].get("processor_class")
        name = name or ImageProcessingMixin.get_image_processor_dict(src, **kwargs)[0].get("processor_class")
    except (OSError, ValueError):
        return None
    return processor_class_from_name(name) if name else None


@functools.lru_cache(maxsize=None)
def images_only(cls):
    """`cls` (a processor class taking image_processor, tokenizer, video_processor) without its video processor:
    transformers asks for the sub-processors its __init__ names, so this __init__ names only the first two."""
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": f"{cls.__name__} for images only."})


def vision_parameters(model) -> tuple[list[str], list[str]]:
    """(names of the vision encoder's parameters, names of the projector's), the projector's out of the first."""
    tower, projector = [], []
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if any(part in PROJECTOR_NAMES for part in parts):
            projector.append(name)
        elif any(part in TOWER_NAMES for part in parts):
            tower.append(name)
    return tower, projector


def sync_note(model) -> str:
    """What weight syncs carry of a vision-language model's tower and projector: frozen ones go with the first sync
    only (online/engine_link.py), trained ones with every sync."""
    tower, projector = vision_parameters(model)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    parts = [(what, bool(set(names) & trains)) for what, names in (("vision tower", tower), ("projector", projector))
             if names]
    frozen = [what for what, trained in parts if not trained]
    trained = [what for what, trained in parts if trained]
    said = []
    if frozen:
        said.append(f"the {' and '.join(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen: sent with the first "
                    "sync only")
    if trained:
        said.append(f"the {' and '.join(trained)} {'trains' if len(trained) == 1 else 'train'}: sent with every sync")
    return "; ".join(said) or "the model has no vision tower or projector"


def vision_modules_pattern(model) -> Optional[str]:
    """A regex (peft's exclude_modules) matching every module inside the vision tower or the projector; None for a
    model without them."""
    tower, projector = vision_parameters(model)
    if not tower and not projector:
        return None
    names = "|".join(TOWER_NAMES + PROJECTOR_NAMES)
    return rf"(.*\.)?({names})(\..*)?"


def freeze_vision(model, tower: bool, projector: bool) -> list[str]:
    """Turn off gradients of the vision encoder (`tower`) and / or the projector; returns the names frozen. A model
    with none of them (a text model) raises UserError naming the option."""
    tower_names, projector_names = vision_parameters(model)
    chosen = (tower_names if tower else []) + (projector_names if projector else [])
    for option, on, names in (("model.freeze_vision_tower", tower, tower_names),
                              ("model.freeze_projector", projector, projector_names)):
        if on and not names:
            raise UserError(f"{option}: {type(model).__name__} has no {option.split('_', 1)[1].replace('_', ' ')} "
                            f"(no module named {' / '.join(TOWER_NAMES if 'tower' in option else PROJECTOR_NAMES)})")
    parameters = dict(model.named_parameters())
    for name in chosen:
        parameters[name].requires_grad_(False)
    return chosen


@functools.lru_cache(maxsize=1)
def vllm_vision_problem() -> Optional[str]:
    """Why vLLM cannot load a vision-language model in this environment, or None. vLLM 0.32's model code for them
    imports transformers' image processors that need torchvision, which posttrain's CPU installs go without
    (scripts/setup.sh: PyPI has no torchvision built for torch's CPU wheels)."""
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception as e:  # a torchvision built for another torch fails with RuntimeError, not ImportError
        return f"{type(e).__name__}: {e}"
    return None


VISION_ALGORITHMS = ("sft", "dpo", "grpo")
"""What trains a vision-language model with images today; the others are refused before anything loads."""


def check_vision_recipe(recipe, algorithm) -> bool:
    """Whether the recipe trains a vision-language model; a UserError for what posttrain cannot do with one yet (or
    freeze options on a text model), before anything loads."""
    model = recipe.model
    if not is_vision_model(model):
        for option in ("freeze_vision_tower", "freeze_projector"):
            if getattr(model, option):
                raise UserError(f"model.{option}: {model.name_or_path} is a text model (its config.json has no "
                                "vision_config); drop the option")
        return False
    gen = recipe.generation
    local_vllm = algorithm.source_kind == "rollout" and gen.engine == "vllm" and gen.placement in ("colocated", "node")
    vllm_problem = vllm_vision_problem() if local_vllm else None  # servers elsewhere: posttrain serve checks there
    refusals = (
        (algorithm.name not in VISION_ALGORITHMS, f"posttrain {algorithm.name}",
         f"posttrain trains vision-language models with {', '.join(VISION_ALGORITHMS)} only so far"),
        (recipe.data.packing, "data.packing=true",
         "packed rows restart their position ids per sequence, which would drop each row's own 3-D rotary positions "
         "(Qwen2-VL's mrope places image tokens on a (t, h, w) grid); set data.packing=false"),
        (recipe.train.max_tokens_per_microbatch is not None, "train.max_tokens_per_microbatch",
         "it regroups rows padding-free (packed), which would drop each row's 3-D rotary positions; leave it unset"),
        (recipe.train.sequence_parallel_size > 1, "train.sequence_parallel_size > 1",
         "it would split image tokens from their pixels across ranks; set it to 1"),
        (vllm_problem is not None, f"generation.engine=vllm (placement {recipe.generation.placement})",
         f"vLLM's code for vision-language models imports transformers' image processors, which need torchvision, and "
         f"torchvision does not import here ({vllm_problem}); install the torchvision built for this torch, or set "
         "generation.engine=hf"),
        (algorithm.source_kind == "rollout" and gen.lora_sync == "adapter", "generation.lora_sync=adapter",
         "adapter-only syncs into vLLM are not tested on a vision-language model; set generation.lora_sync=merged"),
        (recipe.agent.enabled, "agent.*", "posttrain runs multi-turn agents on text prompts only so far"),
        (gen.partial_rollouts, "generation.partial_rollouts=true",
         "a chunk continues from the prompt's tokens alone, without its images; set generation.partial_rollouts=false"),
    )
    for refused, what, why in refusals:
        if refused:
            raise UserError(f"{what} with the vision-language model {model.name_or_path}: {why}")
    return True
