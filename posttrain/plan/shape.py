"""A model's shape from its config.json alone: the model is built on the meta device, so no weight is read or
allocated (a 70B config counts in seconds).

    shape = model_shape(recipe.model, task="causal_lm")      # parameters, trainable (LoRA adapters), layer sizes
"""

from __future__ import annotations

import functools

from posttrain.models.forward import FUSED_HEAD_MODELS
from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError
from posttrain.plan.estimate import ModelShape


def read_config(model_cfg: ModelConfig):
    """transformers' AutoConfig for model.name_or_path (a local directory, or a hub id already in the cache)."""
    from transformers import AutoConfig

    from posttrain.models.load import _resolve, check_model_source

    check_model_source(model_cfg)
    src = _resolve(model_cfg.name_or_path)
    try:
        return AutoConfig.from_pretrained(src, revision=model_cfg.revision,
                                          trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"could not read config.json of model.name_or_path '{src}': {type(e).__name__}: {e}. "
                        "Give a local model directory or a hub id (set HF_HUB_OFFLINE=0 to fetch its config)") from e


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def lora_parameters(model, target_modules, r: int) -> int:
    """Parameters peft adds: r x (in + out) for every linear layer whose name ends in one of target_modules."""
    import torch

    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules:
            total += r * (module.in_features + module.out_features)
    return total


@functools.lru_cache(maxsize=8)  # plan asks for the same shape again (with and without LoRA, per engine)
def model_shape(model_cfg: ModelConfig, task: str = "causal_lm") -> ModelShape:
    """Parameter counts (tied weights once) and the sizes activations depend on, for the recipe's model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = read_config(model_cfg)
    auto = AutoModelForSequenceClassification if task == "seq_cls" else AutoModelForCausalLM
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
    if model_cfg.lora.enabled:
        trainable = lora_parameters(model, set(model_cfg.lora.target_modules), model_cfg.lora.r)
        if not trainable:
            raise UserError(f"model.lora.target_modules {list(model_cfg.lora.target_modules)} match no linear layer "
                            f"of {model_cfg.name_or_path}")
        if task == "seq_cls":
            trainable += sum(p.numel() for n, p in model.named_parameters() if n.startswith("score."))
        parameters += trainable
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    largest = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    return shape_from_config(config, parameters, trainable, largest)


def shape_from_config(config, parameters: int, trainable: int, largest_layer: int = 0) -> ModelShape:
    """The shape with counts already known (a run counts its loaded model; no meta build needed)."""
    text = _text_config(config)
    hidden = text.hidden_size
    heads = text.num_attention_heads
    return ModelShape(
        parameters=parameters,
        trainable=trainable,
        vocab_size=text.vocab_size,
        hidden_size=hidden,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
        largest_layer=largest_layer,
        fused_head=getattr(config, "model_type", None) in FUSED_HEAD_MODELS,
    )
