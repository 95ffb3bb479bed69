"""A recipe -> the Workload the estimator needs: rows per micro-batch, their length, dtypes, the copies kept.

    workload = workload_from_recipe("dpo", recipe)
    workload = workload_from_recipe("grpo", recipe, per_device_batch=8)   # the same recipe at another micro-batch
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from posttrain.algorithms.base import ModelsNeeded
from posttrain.config.schema import Recipe
from posttrain.plan.estimate import Workload

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
VLLM_DEFAULT_FRACTION = 0.3  # the share posttrain's colocated vLLM reserves unless told otherwise


def models_needed(command: str, recipe: Recipe) -> ModelsNeeded:
    """What the algorithm of `command` holds while it trains (policy head, reference, critic, reward models, teacher,
    generation), asked of the algorithm itself: constructors do no I/O, so this reads the recipe alone."""
    from posttrain.algorithms import ALGORITHMS

    return ALGORITHMS[command][1](recipe).models_needed()


def workload_from_recipe(command: str, recipe: Recipe, per_device_batch: Optional[int] = None,
                         max_length: Optional[int] = None, on_gpu: bool = True) -> Workload:
    """The recipe's micro-batch (or `per_device_batch`) at its lengths (or `max_length`) as a Workload; `on_gpu`
    False for a run on CPU (its AdamW steps tensor by tensor)."""
    t, d, g = recipe.train, recipe.data, recipe.generation
    needed = models_needed(command, recipe)
    batch = per_device_batch or t.per_device_train_batch_size
    length = max_length or d.max_length
    mixed = t.mixed_precision in ("bf16", "fp16")
    weight_bytes = BYTES.get(recipe.model.dtype, 4)
    workload = Workload(algorithm=command, sequences=batch * needed.rows_per_unit, sequence_length=length,
                        weight_bytes=weight_bytes, compute_bytes=2 if mixed else weight_bytes, mixed_precision=mixed,
                        foreach_optimizer=on_gpu and not t.fused_optimizer,  # the fused step makes no temporaries
                        accumulation=t.per_device_train_batch_size * t.gradient_accumulation_steps // batch,
                        gradient_checkpointing=t.gradient_checkpointing, frozen_copies=needed.frozen,
                        trained_models=needed.trained, lm_head=needed.task == "causal_lm",
                        logprobs_only=needed.logprobs_only, teacher_logits=needed.teacher,
                        eager_attention=recipe.model.attn_implementation == "eager")
    if not needed.generation:
        return workload
    prompt_length = d.max_prompt_length or max(1, length - g.max_completion_length)
    if max_length is not None:
        prompt_length = max(1, min(prompt_length, max_length - g.max_completion_length))
    generations = needed.samples_per_prompt
    prompts = t.per_device_train_batch_size * t.gradient_accumulation_steps // generations  # kept by any split
    per_call = min(g.batch_size or prompts, prompts) or 1
    vllm = g.engine == "vllm" and g.placement in ("colocated", "node")  # its KV cache lives in its reserved share
    return dataclasses.replace(workload, sequence_length=prompt_length + g.max_completion_length,
                               generation_sequences=0 if vllm else per_call * generations,
                               generation_length=prompt_length + g.max_completion_length,
                               vllm_fraction=VLLM_DEFAULT_FRACTION if vllm else 0.0)
