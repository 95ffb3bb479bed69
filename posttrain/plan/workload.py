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


def models_needed(command: str, recipe: Recipe):
    """What the algorithm of `command` holds while it trains (policy head, reference, critic, reward models, teacher,
    generation), asked of the algorithm itself (Algorithm.models_needed): constructors do no I/O, so this reads the
    recipe alone."""
    from posttrain.algorithms import ALGORITHMS

    return ALGORITHMS[command][1](recipe).models_needed()


def algorithm_facts(command: str, recipe: Recipe) -> dict:
    """What the algorithm keeps and feeds, as the estimate counts it: task, rows per batch unit, frozen copies at the
    policy's size (reference, reward models), the trained models, a teacher (counted at its own size), generation."""
    needed = models_needed(command, recipe)
    teacher = getattr(recipe.algo, "teacher_model_name_or_path", None) if needed.teacher else None
    return dict(task=needed.task, rows_per_unit=needed.rows_per_unit, frozen=needed.frozen - int(needed.teacher),
                generate=needed.generation, trained=needed.trained, teacher=teacher,
                samples_per_prompt=needed.samples_per_prompt, logprobs_only=needed.logprobs_only)


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
                         max_length: Optional[int] = None, on_gpu: bool = True, *, mean_length: Optional[int] = None,
                         sequence_parallel: Optional[int] = None, budget: Optional[int] = None,
                         image_tokens: Optional[int] = None) -> Workload:
    """The recipe's micro-batch (or `per_device_batch`) at its lengths (or `max_length`) as a Workload; `on_gpu`
    False for a run on CPU (its AdamW steps tensor by tensor). `mean_length`: the data's mean row length in tokens
    (None: every row as long as the recipe allows, the worst case); `sequence_parallel`: another SP degree than the
    recipe's; `budget`: a token budget to plan with packing on (the recommender's search; packing is off under
    sequence parallelism, which refuses it) instead of the recipe's own (train.max_tokens_per_microbatch), which
    applies at the recipe's lengths. `image_tokens`: a vision-language model's image tokens per row (None: the
    largest image its processor makes)."""
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
                        lm_head=facts["task"] == "causal_lm", logprobs_only=facts["logprobs_only"],
                        eager_attention=recipe.model.attn_implementation == "eager",
                        sequence_parallel=sequence_parallel or t.sequence_parallel_size, image_tokens=image_tokens)
    packed = workload.sequence_parallel == 1 and (d.packing or budget is not None)  # SP refuses packed rows
    # the recipe's budget cuts the step whatever its split into micro-batches, not at another max_length
    packing = (packed, budget) if budget is not None else (packed, t.max_tokens_per_microbatch if max_length is None
                                                           else None)
    if not facts["generate"]:
        return with_tokens(workload, facts["rows_per_unit"], mean_length, *packing)
    prompt_length = d.max_prompt_length or max(1, length - g.max_completion_length)
    if max_length is not None:
        prompt_length = max(1, min(prompt_length, max_length - g.max_completion_length))
    generations = facts["samples_per_prompt"]  # distillation samples one completion per prompt
    prompts = t.per_device_train_batch_size * t.gradient_accumulation_steps // generations  # kept by any split
    per_call = min(g.batch_size or prompts, prompts) or 1
    vllm = g.engine == "vllm" and g.placement in ("colocated", "node")  # its KV cache lives in its reserved share
    vllm_weight_bytes, kv_cache = vllm_on_cpu(recipe) if vllm and not on_gpu else (0, 0)
    # the fused head scores the completion rows only, and not under sequence parallelism (the logits are gathered)
    fused = workload.logprobs_only and workload.sequence_parallel == 1
    workload = dataclasses.replace(workload, sequence_length=prompt_length + g.max_completion_length,
                                   logprobs_only=fused,
                                   scored_tokens=workload.sequences * g.max_completion_length if fused else 0,
                                   generation_sequences=0 if vllm else per_call * generations,
                                   generation_length=prompt_length + g.max_completion_length,
                                   vllm_fraction=g.vllm.gpu_memory_utilization if vllm else 0.0,
                                   vllm_weight_bytes=vllm_weight_bytes, vllm_kv_cache_bytes=kv_cache)
    return with_tokens(workload, facts["rows_per_unit"], mean_length, *packing)


def with_tokens(workload: Workload, unit_rows: int, mean_length: Optional[int], packed: bool,
                budget: Optional[int]) -> Workload:
    """The tokens one micro-batch's forward really holds, from its rows, their longest length L and their mean m:
    - padded: rows x L (each micro-batch is as wide as its longest row, taken as L);
    - packed (data.packing): the rows' real tokens rows x m, laid first-fit-decreasing in rows of length L
      (Batch.model_inputs, data.collate_packed): ceil(rows x m / L) x L;
    - a token budget B (train.max_tokens_per_microbatch): the device's rows of a step (rows x accumulation x m real
      tokens) regrouped into ceil(step / B) micro-batches of at most B real tokens each: packed, ceil(B / L) x L
      tokens, whatever the data (a budget bounds memory for any lengths; at most the step's rows at full length);
      padded, whole units (a row, a preference pair) of m tokens, floor(B / (unit x m)) units padded to L.
    m defaults to L (every row full: the worst case, and the estimate of a run whose data the planner has not seen)."""
    length = workload.sequence_length
    mean = min(mean_length or length, length)
    rows, accumulation = workload.sequences, workload.accumulation
    if budget is not None:
        held = min(budget, rows * accumulation * length)  # what the budget lets in, whatever the data
        accumulation = max(1, -(-rows * accumulation * mean // budget))
        rows = min(rows * workload.accumulation, max(1, held // (unit_rows * mean)) * unit_rows)
        real = held if packed else rows * mean
    else:
        real = rows * mean
    tokens = -(-real // length) * length if packed else rows * length
    return dataclasses.replace(workload, sequences=rows, tokens=tokens, real_tokens=min(real, tokens),
                               accumulation=accumulation, token_budget=budget)
