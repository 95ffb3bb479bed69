"""A recipe -> the Workload the estimator needs: rows per micro-batch, their length, dtypes, the copies kept.

    workload = workload_from_recipe("dpo", recipe)
    workload = workload_from_recipe("grpo", recipe, per_device_batch=8)   # the same recipe at another micro-batch
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from posttrain.config.schema import Recipe
from posttrain.plan.estimate import Workload

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
VLLM_DEFAULT_FRACTION = 0.3  # the share posttrain's colocated vLLM reserves unless told otherwise


def algorithm_facts(command: str, recipe: Recipe) -> dict:
    """What the algorithm keeps and feeds: task, rows per batch unit, frozen copies, generation."""
    algo = recipe.algo
    lora = recipe.model.lora.enabled
    rm_copies = sum(1 for r in recipe.rewards if r.name == "reward_model")
    if command == "dpo":
        ref = not (lora or getattr(algo, "loss_type", "") == "simpo" or getattr(algo, "precompute_ref_logprobs", False))
        return dict(task="causal_lm", rows_per_unit=2, frozen=int(ref), generate=False)
    if command == "grpo":
        ref = getattr(algo, "beta", 0.0) > 0 and not lora
        return dict(task="causal_lm", rows_per_unit=1, frozen=int(ref) + rm_copies, generate=True)
    if command == "rm":
        return dict(task="seq_cls", rows_per_unit=2, frozen=0, generate=False)
    return dict(task="causal_lm", rows_per_unit=1, frozen=0, generate=False)


def workload_from_recipe(command: str, recipe: Recipe, per_device_batch: Optional[int] = None,
                         max_length: Optional[int] = None, on_gpu: bool = True) -> Workload:
    """The recipe's micro-batch (or `per_device_batch`) at its lengths (or `max_length`) as a Workload; `on_gpu`
    False for a run on CPU (its AdamW steps tensor by tensor)."""
    t, d, g = recipe.train, recipe.data, recipe.generation
    facts = algorithm_facts(command, recipe)
    batch = per_device_batch or t.per_device_train_batch_size
    length = max_length or d.max_length
    mixed = t.mixed_precision in ("bf16", "fp16")
    weight_bytes = BYTES.get(recipe.model.dtype, 4)
    workload = Workload(algorithm=command, sequences=batch * facts["rows_per_unit"], sequence_length=length,
                        weight_bytes=weight_bytes, compute_bytes=2 if mixed else weight_bytes, mixed_precision=mixed,
                        foreach_optimizer=on_gpu and not t.fused_optimizer,  # the fused step makes no temporaries
                        accumulation=t.per_device_train_batch_size * t.gradient_accumulation_steps // batch,
                        gradient_checkpointing=t.gradient_checkpointing, frozen_copies=facts["frozen"],
                        lm_head=facts["task"] == "causal_lm", logprobs_only=command in ("sft", "dpo"),
                        eager_attention=recipe.model.attn_implementation == "eager")
    if not facts["generate"]:
        return within_budget(workload, t, per_device_batch, max_length)
    prompt_length = d.max_prompt_length or max(1, length - g.max_completion_length)
    if max_length is not None:
        prompt_length = max(1, min(prompt_length, max_length - g.max_completion_length))
    generations = recipe.algo.num_generations
    prompts = t.per_device_train_batch_size * t.gradient_accumulation_steps // generations  # kept by any split
    per_call = min(g.batch_size or prompts, prompts) or 1
    vllm = g.engine == "vllm" and g.placement in ("colocated", "node")  # its KV cache lives in its reserved share
    workload = dataclasses.replace(workload, sequence_length=prompt_length + g.max_completion_length,
                                   generation_sequences=0 if vllm else per_call * generations,
                                   generation_length=prompt_length + g.max_completion_length,
                                   vllm_fraction=VLLM_DEFAULT_FRACTION if vllm else 0.0)
    return within_budget(workload, t, per_device_batch, max_length)


def within_budget(workload: Workload, t, per_device_batch: Optional[int], max_length: Optional[int]) -> Workload:
    """train.max_tokens_per_microbatch: a micro-batch is at most that many tokens, packed into one row (the worst
    case: one full micro-batch), and the step's rows at full length take ceil(tokens / budget) of them. Not applied
    when the caller asks about another micro-batch shape (the recommender's alternatives)."""
    budget = t.max_tokens_per_microbatch
    if budget is None or per_device_batch is not None or max_length is not None:
        return workload
    step_tokens = workload.sequences * workload.sequence_length * workload.accumulation
    return dataclasses.replace(workload, sequences=1, sequence_length=min(budget, step_tokens),
                               accumulation=max(1, -(-step_tokens // budget)))
