"""A recipe -> the Workload the estimator needs: rows per micro-batch, their length, dtypes, the copies kept.

    workload = workload_from_recipe("dpo", recipe)
    workload = workload_from_recipe("grpo", recipe, per_device_batch=8)   # the same recipe at another micro-batch
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from posttrain.config.schema import Recipe
from posttrain.data.token_budget import fewest_micro_batches
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
    if generations > 1 and workload.sequence_parallel == 1 and shares_prefixes(recipe):
        step_rows = t.per_device_train_batch_size * t.gradient_accumulation_steps
        shared = with_shared_prompts(workload, generations, step_rows, prompt_length, g.max_completion_length,
                                     mean_length, packing[1])
        if shared is not None:
            return shared
    return with_tokens(workload, facts["rows_per_unit"], mean_length, *packing)


def shares_prefixes(recipe: Recipe) -> bool:
    """Whether a run of the recipe computes its rows' shared prefixes once (train.shared_prefix, resolved as the run
    resolves it: models/shared_prefix.why_not_shared, from the same config.json)."""
    from posttrain.models.shared_prefix import why_not_shared

    return why_not_shared(recipe) is None


def prompt_groups(rows: int, generations: int, step_rows: int) -> list[int]:
    """Rows of each prompt's group in the micro-batch of `rows` that holds the most groups: the rollout source cuts a
    step's `step_rows` rows, `generations` a prompt in order, into consecutive micro-batches of `rows`
    (online/rollout_source.py), so a micro-batch can hold the tail of one group and the head of another."""
    most: list[int] = []
    for start in range(0, max(step_rows, rows), rows):
        stop = start + rows
        members = [min(stop, (g + 1) * generations) - max(start, g * generations)
                   for g in range(start // generations, -(-stop // generations))]
        most = members if len(members) > len(most) else most
    return most


def shared_layout(members: list[int], prompt: int, completion: int, fraction: float) -> tuple[int, int, int]:
    """(tokens computed, real tokens, mask entries) of a shared-prefix micro-batch whose prompt groups have `members`
    rows each: a group is one row [prompt | each member's completion] (ops/shared_prefix.prefix_layout), `fraction`
    of its full length (the data's mean row over the longest), and the groups are laid first-fit-decreasing in rows as
    wide as the longest group at full length; the mask is rows x width^2."""
    width = prompt + max(members) * completion
    sizes = [math.ceil((prompt + k * completion) * fraction) for k in members]
    rows = fewest_micro_batches(sizes, width)
    return rows * width, sum(sizes), rows * width * width


def with_shared_prompts(workload: Workload, generations: int, step_rows: int, prompt: int, completion: int,
                        mean_length: Optional[int], budget: Optional[int]) -> Optional[Workload]:
    """The micro-batch of a run that computes each prompt once per group (train.shared_prefix): a group of G rows
    forwards P + G x C tokens, not G x (P + C). Without a budget the micro-batch's rows are the source's (its groups
    from `prompt_groups`); a token budget B (which counts a group's real tokens, train/micro_batches.py) holds whole
    groups, or runs of k = (B - P) // C rows of one when a group is over B, as many as B takes. The rows' mean length
    m (default: full) scales prompt and completions alike. None where no two rows of a micro-batch share a prompt
    (the forward is then the plain one)."""
    fraction = min(mean_length or workload.sequence_length, workload.sequence_length) / workload.sequence_length
    rows, accumulation = workload.sequences, workload.accumulation
    if budget is None:
        members = prompt_groups(rows, generations, step_rows)
    else:
        per_unit = max(1, min(generations, (budget - prompt) // max(completion, 1)))
        chunks = [min(per_unit, generations - start) for start in range(0, generations, per_unit)]
        unit_real = [math.ceil((prompt + k * completion) * fraction) for k in chunks]
        # runs of the longest length, at most the step's: the micro-batch with the most rows
        units = max(1, min(budget // max(unit_real), len(chunks) * (step_rows // generations)))
        members = [per_unit] * units
        accumulation = max(1, -(-sum(unit_real) * (step_rows // generations) // budget))
    if max(members) < 2:
        return None
    tokens, real, mask = shared_layout(members, prompt, completion, fraction)
    rows = sum(members)
    return dataclasses.replace(workload, sequences=rows, tokens=tokens, real_tokens=real, mask_elements=mask,
                               scored_tokens=rows * completion if workload.scored_tokens else 0,
                               accumulation=accumulation, token_budget=budget)


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
