"""A recipe -> the Workload the estimator needs: rows per micro-batch, their length, dtypes, the copies kept.

    workload = workload_from_recipe("dpo", recipe)
    workload = workload_from_recipe("grpo", recipe, per_device_batch=8)   # the same recipe at another micro-batch
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from posttrain.config.schema import Recipe
from posttrain.distributed.precision import resolve_precision, trained_model_config
from posttrain.generation.cpu_memory import DTYPE_BYTES
from posttrain.plan.estimate import Workload

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    if command == "ppo":  # the critic trains beside the policy at about its size
        ref = getattr(algo, "kl_coef", 0.0) > 0 and not lora
        return dict(task="causal_lm", rows_per_unit=1, frozen=int(ref) + rm_copies, generate=True, trained=2)
    if command == "distill":  # the teacher (another size: its own count), generating on-policy with lmbda > 0
        return dict(task="causal_lm", rows_per_unit=1, frozen=0, generate=getattr(algo, "lmbda", 0.0) > 0,
                    teacher=getattr(algo, "teacher_model_name_or_path", None))
    if command == "rm":
        return dict(task="seq_cls", rows_per_unit=2, frozen=0, generate=False)
    return dict(task="causal_lm", rows_per_unit=1, frozen=0, generate=False)


def teacher_parameters(recipe: Recipe, teacher: Optional[str]) -> int:
    """A distillation teacher's parameter count from its config (0: none, or a teacher served elsewhere)."""
    if not teacher:
        return 0
    from posttrain.plan.shape import model_shape

    teacher_cfg = dataclasses.replace(recipe.model, name_or_path=teacher, tokenizer_name_or_path=None,
                                      revision=getattr(recipe.algo, "teacher_model_revision", None),
                                      lora=dataclasses.replace(recipe.model.lora, enabled=False))
    return model_shape(teacher_cfg).parameters


def vllm_on_cpu(recipe: Recipe) -> tuple[int, int]:
    """(bytes per weight, KV cache bytes) of an in-process vLLM engine on CPU: float32 weights unless
    generation.vllm.dtype says otherwise; generation.vllm.kv_cache_gb GiB of cache, else vLLM's own default, its
    gpu_memory_utilization share of the machine's RAM less what the process holds (counted here as the whole share)."""
    import psutil

    cfg = recipe.generation.vllm
    weight_bytes = DTYPE_BYTES.get(cfg.dtype, 4)  # auto is float32 on a CPU (generation/vllm_engine.py)
    if cfg.kv_cache_gb is not None:
        return weight_bytes, cfg.kv_cache_gb * 2**30
    return weight_bytes, int(cfg.gpu_memory_utilization * psutil.virtual_memory().total)


def workload_from_recipe(command: str, recipe: Recipe, per_device_batch: Optional[int] = None,
                         max_length: Optional[int] = None, on_gpu: bool = True) -> Workload:
    """The recipe's micro-batch (or `per_device_batch`) at its lengths (or `max_length`) as a Workload; `on_gpu`
    False for a run on CPU (its AdamW steps tensor by tensor)."""
    t, d, g = recipe.train, recipe.data, recipe.generation
    facts = algorithm_facts(command, recipe)
    batch = per_device_batch or t.per_device_train_batch_size
    length = max_length or d.max_length
    precision = resolve_precision(recipe.model, t)  # a 16-bit checkpoint: float32 master weights, 16-bit autocast
    mixed = precision.autocast in ("bf16", "fp16")
    weight_bytes = BYTES[trained_model_config(recipe.model, t).dtype]
    workload = Workload(algorithm=command, sequences=batch * facts["rows_per_unit"], sequence_length=length,
                        weight_bytes=weight_bytes, compute_bytes=2 if mixed else weight_bytes, mixed_precision=mixed,
                        frozen_weight_bytes=BYTES[precision.loaded], trained_copies=facts.get("trained", 1),
                        frozen_parameters=teacher_parameters(recipe, facts.get("teacher")),
                        teacher_logits=bool(facts.get("teacher")),
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
    generations = getattr(recipe.algo, "num_generations", 1)  # distillation samples one completion per prompt
    prompts = t.per_device_train_batch_size * t.gradient_accumulation_steps // generations  # kept by any split
    per_call = min(g.batch_size or prompts, prompts) or 1
    vllm = g.engine == "vllm" and g.placement in ("colocated", "node")  # its KV cache lives in its reserved share
    vllm_weight_bytes, kv_cache = vllm_on_cpu(recipe) if vllm and not on_gpu else (0, 0)
    workload = dataclasses.replace(workload, sequence_length=prompt_length + g.max_completion_length,
                                   generation_sequences=0 if vllm else per_call * generations,
                                   generation_length=prompt_length + g.max_completion_length,
                                   vllm_fraction=g.vllm.gpu_memory_utilization if vllm else 0.0,
                                   vllm_weight_bytes=vllm_weight_bytes, vllm_kv_cache_bytes=kv_cache)
    return within_budget(workload, t, per_device_batch, max_length)


def within_budget(workload: Workload, t, per_device_batch: Optional[int], max_length: Optional[int]) -> Workload:
    """train.max_tokens_per_microbatch: a micro-batch holds at most that many tokens, which its padding-free forward
    packs into rows of the longest row's length (the worst case: full rows of the recipe's length), and the step's
    rows at full length take ceil(tokens / budget) micro-batches. Not applied when the caller asks about another
    micro-batch shape (the recommender's alternatives)."""
    budget = t.max_tokens_per_microbatch
    if budget is None or per_device_batch is not None or max_length is not None:
        return workload
    step_tokens = workload.sequences * workload.sequence_length * workload.accumulation
    return dataclasses.replace(workload, sequences=max(1, min(budget, step_tokens) // workload.sequence_length),
                               accumulation=max(1, -(-step_tokens // budget)))
