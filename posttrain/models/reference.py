"""The frozen reference model (DPO family, KL-regularised RL): loaded from the same source as the policy.

    reference = make_reference(recipe.model)              # eval mode, no gradients, same dtype and weights

With LoRA there is no need for a copy: `posttrain.models.load.disable_adapter(policy)` computes the base model.
"""

from __future__ import annotations

from posttrain.config.schema import ModelConfig
from posttrain.models.load import TASKS, load_causal_lm, load_sequence_classifier


def make_reference(model_cfg: ModelConfig, task: str = "causal_lm"):
    """A second, frozen copy (eval mode, requires_grad off) of the model at `model_cfg` as `task` (causal_lm or
    seq_cls). A seq_cls head fresh from a causal-LM checkpoint matches the policy's only after the same seeding."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    load = load_causal_lm if task == "causal_lm" else load_sequence_classifier
    return load(model_cfg, gradient_checkpointing=False).requires_grad_(False).eval()
