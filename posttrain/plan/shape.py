"""A model's shape from its config.json alone: the model is built on the meta device, so no weight is read or
allocated (a 70B config counts in seconds).

    shape = model_shape(recipe.model, task="causal_lm")      # parameters, trainable (LoRA adapters), layer sizes
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import torch

from posttrain.models.forward import FUSED_HEAD_MODELS
from posttrain.models.hub import hub_unreachable, offline_by_choice
from posttrain.models.lean_activations import lean_kinds
from posttrain.models.load import lora_targets
from posttrain.config.schema import ALL_LINEAR, ModelConfig
from posttrain.errors import UserError
from posttrain.plan.estimate import ModelShape, VisionShape
from posttrain.plan.known_models import known_config, known_image_tokens, known_name


def read_config(model_cfg: ModelConfig):
    """transformers' AutoConfig for model.name_or_path: a local directory, a hub id in the cache, a model whose
    shape posttrain knows (plan/known_models.py), or else fetched from the hub once it answers (no retries against
    a hub that cannot be reached)."""
    return config_and_source(model_cfg)[0]


def config_and_source(model_cfg: ModelConfig) -> tuple:
    """(config, where it came from: 'config.json' or 'built-in shape'); see read_config."""
    from transformers import AutoConfig

    from posttrain.models.load import _resolve, check_model_source

    check_model_source(model_cfg)
    src = _resolve(model_cfg.name_or_path)
    kwargs = {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}
    try:
        try:  # a directory, or the cache
            return AutoConfig.from_pretrained(src, local_files_only=True, **kwargs), "config.json"
        except OSError:
            known = known_config(src)
            if known is not None:
                return known, f"built-in shape of {known_name(src)}, no download"
            if offline_by_choice() or hub_unreachable() is not None:
                raise UserError(f"model.name_or_path '{src}' is neither a local directory nor in the Hugging Face "
                                f"cache. {offline_advice()}") from None
            return AutoConfig.from_pretrained(src, **kwargs), "config.json"
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"could not read config.json of model.name_or_path '{src}': {type(e).__name__}: {e}. "
                        f"{offline_advice()}") from e


def offline_advice() -> str:
    """What to do about a model config that is neither local nor cached, true to why it could not be fetched."""
    if offline_by_choice():
        return "HF_HUB_OFFLINE is set: unset it to fetch config.json from the hub, or give a local model directory"
    return ("The hub could not be reached (no network?): give a local model directory (one with config.json), or "
            "run once where the hub is reachable to cache it (HF_ENDPOINT names a mirror)")


def lora_parameters(model, target_modules, r: int, exclude: Optional[str] = None) -> int:
    """Parameters peft adds: r x (in + out) for every linear layer whose name ends in one of target_modules (all-linear:
    every one but the output layer, as PEFT reads it), none whose name fully matches `exclude` (peft's
    exclude_modules: a VLM's vision tower and projector)."""
    heads = {"lm_head", "score", "classifier"}
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and (name.rsplit(".", 1)[-1] in target_modules or (
                   ALL_LINEAR in target_modules and name.rsplit(".", 1)[-1] not in heads))
               and not (exclude and re.fullmatch(exclude, name)))


@functools.lru_cache(maxsize=8)  # plan asks for the same shape again (with and without LoRA, per engine)
def model_shape(model_cfg: ModelConfig, task: str = "causal_lm") -> ModelShape:
    """Parameter counts (tied weights once) and the sizes activations depend on, for the recipe's model. A
    vision-language model counts its vision tower and projector, trainable unless model.freeze_* says otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    from posttrain.models.vision import vision_modules_pattern, vision_parameters

    config = read_config(model_cfg)
    vision = task == "causal_lm" and getattr(config, "vision_config", None) is not None
    auto = (AutoModelForSequenceClassification if task == "seq_cls" else AutoModelForImageTextToText if vision
            else AutoModelForCausalLM)
    if task == "seq_cls":
        config.num_labels = 1
    try:
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    except (ValueError, KeyError) as e:
        raise UserError(f"model.name_or_path '{model_cfg.name_or_path}': transformers cannot build a {task} model "
                        f"from its config.json ({e})") from e
    parameters = sum(p.numel() for p in model.parameters())
    trainable = parameters
    encoder = None
    if vision:
        tower, projector = vision_parameters(model)
        sizes = dict((name, p.numel()) for name, p in model.named_parameters())
        frozen = (tower if model_cfg.freeze_vision_tower else []) + (projector if model_cfg.freeze_projector else [])
        trainable -= sum(sizes[name] for name in frozen)
        tower_trains = not (model_cfg.freeze_vision_tower or model_cfg.lora.enabled)  # LoRA: the LM's adapters only
        encoder = vision_shape(config.vision_config, trains=tower_trains,
                               largest_image=largest_image_tokens(model_cfg, config.vision_config))
    if model_cfg.lora.enabled:
        targets = lora_targets(model_cfg.lora.target_modules, getattr(config, "model_type", ""))
        trainable = lora_parameters(model, {targets} if isinstance(targets, str) else set(targets), model_cfg.lora.r,
                                    vision_modules_pattern(model))
        if not trainable:
            raise UserError(f"model.lora.target_modules {list(model_cfg.lora.target_modules)} match no linear layer "
                            f"of {model_cfg.name_or_path}")
        if task == "seq_cls":
            trainable += sum(p.numel() for n, p in model.named_parameters() if n.startswith("score."))
        parameters += trainable
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    largest = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    return dataclasses.replace(shape_from_config(config, parameters, trainable, largest), vision=encoder)


def vision_shape(config, trains: bool, largest_image: int) -> VisionShape:
    """The encoder's sizes from its vision_config (Qwen2-VL: embed_dim, mlp_ratio; Qwen2.5 / 3-VL: hidden_size,
    intermediate_size, depth; CLIP: num_hidden_layers), image tokens of spatial_merge_size^2 patches (CLIP's: 1)."""
    width = getattr(config, "embed_dim", None) or config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or int(getattr(config, "mlp_ratio", 4) * width)
    depth = getattr(config, "depth", None) or config.num_hidden_layers
    return VisionShape(width=width, intermediate=intermediate, depth=depth,
                       patches=getattr(config, "spatial_merge_size", 1) ** 2, trains=trains,
                       largest_image=largest_image)


def largest_image_tokens(model_cfg: ModelConfig, vision_config) -> int:
    """Image tokens of the largest image the model's processor makes: a built-in model's (known_models.py), else
    the saved image processor's max_pixels (or size.longest_edge) over (patch x merge)^2 pixels a token, or a
    fixed-size tower's (image_size / patch_size)^2; 0 when none says."""
    import json
    from pathlib import Path

    known = known_image_tokens(model_cfg.name_or_path)
    if known:
        return known
    side = vision_config.patch_size * getattr(vision_config, "spatial_merge_size", 1)
    folder = Path(model_cfg.name_or_path).expanduser()
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        path = folder / name
        if path.is_file():
            saved = json.loads(path.read_text())
            saved = saved.get(key, {}) if key else saved
            most = saved.get("max_pixels") or (saved.get("size") or {}).get("longest_edge")
            if isinstance(most, int) and "spatial_merge_size" in vision_config.to_dict():
                return most // side**2
    image_size = getattr(vision_config, "image_size", None)
    return (image_size // vision_config.patch_size) ** 2 if isinstance(image_size, int) else 0


def shape_from_config(config, parameters: int, trainable: int, largest_layer: int = 0) -> ModelShape:
    """The shape with counts already known (a run counts its loaded model; no meta build needed)."""
    text = config.get_text_config()
    hidden, heads = text.hidden_size, text.num_attention_heads
    return ModelShape(parameters=parameters, trainable=trainable, vocab_size=text.vocab_size, hidden_size=hidden,
                      num_layers=text.num_hidden_layers, num_heads=heads, largest_layer=largest_layer,
                      num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                      intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
                      fused_head=getattr(config, "model_type", None) in FUSED_HEAD_MODELS, lean=lean_kinds(config))
