"""What a launcher may say besides the recipe, checked against it: Accelerate's environment (the engine it asks for,
mixed precision, accumulation, clipping) and a user's DeepSpeed JSON, whose "auto" values are filled from the recipe.

    check_launcher_settings(recipe.train)                     # before anything starts
    fill_deepspeed_config(plugin.deepspeed_config, t, world)  # Backend, once Accelerate made the DeepSpeed plugin

The recipe is the source of truth: a value the launcher spells out must agree with it, or the run stops (exit 2)
naming both and how to fix it. Torch-free.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from posttrain.config.schema import TrainConfig
from posttrain.errors import UserError


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def launcher_engine() -> Optional[str]:
    """The engine the launcher asked for through Accelerate's environment: 'deepspeed', 'fsdp' or None."""
    return next((e for e in ("deepspeed", "fsdp") if env_flag(f"ACCELERATE_USE_{e.upper()}")), None)


def _disagree(value: Any, recipe_value: Any) -> bool:
    if isinstance(recipe_value, bool):
        return str(value).lower() not in (str(recipe_value).lower(), str(int(recipe_value)))
    if isinstance(recipe_value, (int, float)):
        try:
            return float(value) != float(recipe_value)
        except (TypeError, ValueError):
            return True
    return str(value) != str(recipe_value)


def _check_agrees(source: str, key: str, value: Any, recipe_key: str, recipe_value: Any, fix: str,
                  expected: Any = None) -> None:
    """`value` is what a launcher or DeepSpeed config says; None or "auto" leaves the choice to the recipe. Otherwise
    it must equal `expected` (by default the recipe's value itself), or the run stops naming both."""
    if value is None or value == "auto" or not _disagree(value, recipe_value if expected is None else expected):
        return
    raise UserError(f"{source} sets {key}={value!r} but the recipe has {recipe_key}={recipe_value!r}. The recipe is "
                    f"the source of truth: {fix}, or change {recipe_key}, so that they agree")


def check_launcher_settings(t: TrainConfig) -> None:
    """Numbers an `accelerate launch` config may also set, checked against the recipe before anything starts
    ('no' mixed precision is "not set": accelerate launch exports it whenever the config omits it)."""
    where = "the accelerate config"
    launcher_mp = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher_mp != "no":
        _check_agrees(where, "mixed_precision", launcher_mp, "train.mixed_precision", t.mixed_precision,
                      f"remove mixed_precision from {where}")
    for key in ("gradient_accumulation_steps", "gradient_clipping"):  # exported as ACCELERATE_<KEY>
        recipe_key, recipe_value = deepspeed_values(t, 1)[key]
        _check_agrees(f"{where} (deepspeed_config)", key, os.environ.get(f"ACCELERATE_{key.upper()}"), recipe_key,
                      recipe_value, f"remove {key} from {where} (or set it to auto)")


def deepspeed_values(t: TrainConfig, world_size: int) -> dict[str, tuple[str, Any]]:
    """The DeepSpeed config keys the recipe decides: key -> (where the recipe says it, value)."""
    batch, steps = t.per_device_train_batch_size, t.gradient_accumulation_steps
    return {"train_micro_batch_size_per_gpu": ("train.per_device_train_batch_size", batch),
            "gradient_accumulation_steps": ("train.gradient_accumulation_steps", steps),
            "gradient_clipping": ("train.max_grad_norm", t.max_grad_norm),
            "train_batch_size": (f"per_device_train_batch_size x gradient_accumulation_steps x {world_size} processes",
                                 batch * steps * world_size)}


def check_deepspeed_json(user: dict[str, Any], path: str, t: TrainConfig, world_size: int) -> None:
    """A user's DeepSpeed JSON may leave the recipe's numbers out or say "auto"; a value it spells out must agree.
    It must not define the optimizer or schedule either: those come from the recipe too."""
    for section in ("optimizer", "scheduler"):
        if section in user:
            raise UserError(f"the DeepSpeed config {path} defines an {section!r} section; posttrain builds AdamW and "
                            "the LR schedule from the recipe (train.learning_rate, train.lr_scheduler_type, ...): "
                            f"remove {section!r} from {path}")
    source = f"the DeepSpeed config {path}"
    for key, (recipe_key, value) in deepspeed_values(t, world_size).items():
        _check_agrees(source, key, user.get(key), recipe_key, value, f'set {key} to "auto" in {path}')
    for precision in ("bf16", "fp16"):
        _check_agrees(source, f"{precision}.enabled", (user.get(precision) or {}).get("enabled"),
                      "train.mixed_precision", t.mixed_precision, f'set {precision}.enabled to "auto" in {path}',
                      expected=t.mixed_precision == precision)


def fill_deepspeed_config(config: dict[str, Any], t: TrainConfig, world_size: int) -> None:
    """Every batch / accumulation / clipping / precision value of Accelerate's DeepSpeed config (`config`, changed
    in place) from the recipe; a user DeepSpeed JSON that says otherwise stops the run first, naming both."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        with open(path) as f:  # what the user wrote, before Accelerate added its defaults
            check_deepspeed_json(json.load(f), path, t, world_size)
    for key, (_, value) in deepspeed_values(t, world_size).items():
        config[key] = value
    for precision in ("bf16", "fp16"):
        config.setdefault(precision, {})["enabled"] = t.mixed_precision == precision
