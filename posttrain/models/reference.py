"""The frozen reference model (DPO family, KL-regularised RL): loaded from the same source as the policy.

    reference = make_reference(recipe.model)              # eval mode, no gradients, same dtype and weights

With LoRA there is no need for a copy: `posttrain.models.load.disable_adapter(policy)` computes the base model.
"""

from __future__ import annotations

from posttrain.config.schema import ModelConfig
from posttrain.models.load import TASKS, load_causal_lm, load_sequence_classifier


def make_reference(model_cfg: ModelConfig, task: str = "causal_lm"):
    """A second, frozen copy of the model at `model_cfg` (causal_lm or seq_cls), in eval mode with requires_grad off.

    For seq_cls from a causal-LM checkpoint the score head is freshly initialised, so it matches the policy's only
    when both are loaded after the same seeding.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    load = load_causal_lm if task == "causal_lm" else load_sequence_classifier
    model = load(model_cfg, gradient_checkpointing=False)
    model.requires_grad_(False)
    return model.eval()
