"""`posttrain plan`: will this recipe fit, under which engine, at which micro-batch? From config.json alone.

    posttrain plan --config recipes/dpo.yaml model.name_or_path=Qwen/Qwen2.5-1.5B --gpus 8 --gpu-memory 80GiB
    posttrain plan --command grpo --config recipes/grpo.yaml --gpus 1 --gpu-memory 80GiB --json

The arithmetic is in plan/estimate.py, the model's shape in plan/shape.py, the search in plan/recommend.py;
`estimate_for_run` is what a run logs at start next to the peak it then measures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Optional

import torch
import yaml

from posttrain.errors import UserError
from posttrain.models.vision import is_vision_model
from posttrain.plan.estimate import ENGINES, GIB, Breakdown, estimate, image_tokens_per_row
from posttrain.plan.recommend import format_table, launch_command, make_plan, to_json
from posttrain.plan.shape import config_and_source, model_shape, read_config, shape_from_config
from posttrain.plan.workload import algorithm_facts, workload_from_recipe

_UNITS = {"": GIB, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "kib": 2**10, "mib": 2**20,
          "gib": GIB, "tib": 2**40}


def parse_memory(text: str, what: str = "--gpu-memory") -> int:
    """'80GiB', '40GB', '24' (GiB) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"{what} '{text}' is not a memory size; write it like 80GiB, 40GB or 24 (GiB)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 1:
        raise UserError(f"{what} '{text}' is no memory at all; give the memory of one GPU, e.g. 80GiB")
    return size


def check_as_run(command: str, recipe, gpus: int) -> None:
    """What a run of the recipe refuses before any model loads, refused here too (plan/preflight.py, with --gpus as
    the world): else the plan recommends a command that exits 2."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.models.shared_prefix import resolve_shared_prefix
    from posttrain.plan.preflight import check_recipe

    algorithm = ALGORITHMS[command][1](recipe)
    check_recipe(recipe, algorithm, world=gpus)
    if recipe.train.shared_prefix is True:  # true where it cannot be exact is refused (auto: the plan counts it off)
        resolve_shared_prefix(recipe, algorithm)


def infer_algorithm(config: Optional[str], overrides: list[str]) -> str:
    """The algorithm whose algo config has every key the recipe's algo: section (and overrides) sets; sft if none."""
    from posttrain.algorithms import ALGORITHMS

    keys = set()
    if config:
        try:
            keys = set(((yaml.safe_load(open(config)) or {}).get("algo") or {}).keys())
        except (OSError, yaml.YAMLError, AttributeError) as e:
            raise UserError(f"could not read the recipe {config}: {e}") from None
    keys |= {o.split("=", 1)[0][5:] for o in overrides if o.startswith("algo.")}
    if not keys:
        return "sft"
    matches = [name for name, (cls, _) in ALGORITHMS.items() if keys <= {f.name for f in dataclasses.fields(cls)}]
    if len(matches) != 1:
        raise UserError(f"cannot tell the algorithm from the recipe's algo keys ({', '.join(sorted(keys))}): "
                        f"pass --algorithm ({', '.join(ALGORITHMS)})")
    return matches[0]


def detect_gpu_memory() -> Optional[int]:
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def engine_for(engine: str, offload: str = "none") -> str:
    """Backend.describe()'s engine / offload words -> the name in estimate.ENGINES."""
    name = {"single": "ddp", "ddp": "ddp", "deepspeed-zero1": "zero1", "deepspeed-zero2": "zero2",
            "deepspeed-zero3": "zero3", "fsdp2": "fsdp2", "fsdp1": "fsdp2"}.get(engine, "ddp")
    return f"{name}_offload" if offload != "none" and name in ("zero2", "zero3") else name


def estimate_for_run(command: str, recipe, engine: str, offload: str, world_size: int,
                     counts: Optional[tuple[int, int]] = None, mean_length: Optional[int] = None) -> Breakdown:
    """The estimate of this recipe as it is being launched (logged at start beside the measured peak). `counts`:
    the loaded model's (total, trainable) parameters, which spare building the model on the meta device;
    `mean_length`: the data's mean row length (None: every row full, the worst case)."""
    shape = (shape_from_config(read_config(recipe.model), *counts) if counts is not None
             else model_shape(recipe.model, algorithm_facts(command, recipe)["task"]))
    gpu_bytes = detect_gpu_memory()
    return estimate(shape, workload_from_recipe(command, recipe, on_gpu=gpu_bytes is not None, mean_length=mean_length),
                    ENGINES[engine_for(engine, offload)], world_size, gpu_bytes or 0)


def estimated_peak_mb(command: str, recipe, described: dict, counts: tuple[int, int]) -> Optional[float]:
    """The run's estimated peak per device in MiB from Backend.describe()'s facts and the loaded model's (total,
    trainable) parameter counts; None when the model's config cannot be read as a decoder (a custom architecture):
    the estimate is a diagnostic and never stops a run."""
    try:
        breakdown = estimate_for_run(command, recipe, described["engine"], described["offload"],
                                     described["world_size"], counts)
    except Exception:  # noqa: BLE001 - see above
        return None
    return round(breakdown.peak_bytes / 2**20, 1)


def precision(recipe, shape) -> str:
    """The dtypes the estimate assumes, and how to change them where float32 weights make a big model look huge."""
    autocast = recipe.train.mixed_precision if recipe.train.mixed_precision in ("bf16", "fp16") else "none"
    said = f"weights in {recipe.model.dtype} (model.dtype), autocast {autocast} (train.mixed_precision)"
    if recipe.model.dtype == "float32" and shape.parameters >= 1e9:
        said += " [--dtype bfloat16 plans bf16 weights" + (", --bf16 bf16 autocast]" if autocast == "none" else "]")
    return said


def shortest_budget(command: str, recipe) -> int:
    """The smallest train.max_tokens_per_microbatch the run accepts: its longest unit (train/micro_batches.py)."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.train.micro_batches import longest_unit

    return longest_unit(recipe, ALGORITHMS[command][1](recipe))[0]


def micro_batch_words(command: str, recipe, mean_length: Optional[int]) -> str:
    """How the table's micro-batch holds its tokens, in the recipe's keys."""
    w = workload_from_recipe(command, recipe, mean_length=mean_length)
    how = "packed" if recipe.data.packing else "padded"
    budget = recipe.train.max_tokens_per_microbatch
    said = (f"{how}{f' within {budget} tokens' if budget else ''}: {w.sequences} row(s) of up to {w.sequence_length} "
            f"tokens, mean {min(mean_length or w.sequence_length, w.sequence_length)}: {w.tokens} tokens a micro-batch, "
            f"{w.real_tokens} of them data")
    said += ", each prompt forwarded once for its group (train.shared_prefix)" if w.mask_elements else ""
    return said + (f" over {w.sequence_parallel} SP ranks" if w.sequence_parallel > 1 else "")


def image_words(shape, workload, told: Optional[int]) -> str:
    """What the plan counts of a vision-language model's images."""
    v = shape.vision
    per_row = image_tokens_per_row(shape, workload)
    why = "--image-tokens" if told is not None else (
        f"the largest image the processor makes is {v.largest_image}" if v.largest_image else "none said")
    return (f"images: {per_row} image tokens per row ({why}; at most the row), each {v.patches} patch(es) through "
            f"the vision tower's {v.depth} blocks of {v.width}, which "
            + ("trains: its activations are kept" if v.trains else "is frozen: its activations are not kept"))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def run_plan(command: str, recipe, config: Optional[str], overrides: list[str], gpus: int, nodes: int,
             gpu_memory: Optional[str], as_json: bool, mean_length: Optional[int] = None,
             image_tokens: Optional[int] = None) -> str:
    """The text (or JSON) `posttrain plan` prints. `mean_length`: the data's mean tokens per row (None: every row
    as long as the recipe allows); `image_tokens`: a vision-language model's image tokens per row (None: the largest
    image its processor makes)."""
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise UserError(f"--gpus ({gpus}) must be a positive multiple of --nodes ({nodes})")
    if mean_length is not None and mean_length < 1:
        raise UserError(f"--mean-length ({mean_length}) must be a positive number of tokens")
    if image_tokens is not None and (image_tokens < 0 or not is_vision_model(recipe.model)):
        raise UserError(f"--image-tokens ({image_tokens}) needs a vision-language model and a count >= 0")
    sp = recipe.train.sequence_parallel_size
    if gpus % sp:
        raise UserError(f"train.sequence_parallel_size={sp} must divide --gpus ({gpus}): world = data x sequence ranks")
    check_as_run(command, recipe, gpus)
    gpu_bytes = parse_memory(gpu_memory) if gpu_memory else detect_gpu_memory()
    if gpu_bytes is None:
        raise UserError("no GPU here to read the memory of: pass --gpu-memory (e.g. --gpu-memory 80GiB)")
    t = recipe.train
    task = algorithm_facts(command, recipe)["task"]
    shape = model_shape(recipe.model, task)
    longest_row = workload_from_recipe(command, recipe).sequence_length
    if mean_length is not None and mean_length > longest_row:
        raise UserError(f"--mean-length ({mean_length}) is above the longest row this recipe makes ({longest_row} "
                        "tokens, data.max_length or the prompt + completion limits), and rows are cut to it: give the "
                        f"data's mean tokens per row, at most {longest_row}")
    with_lora = dataclasses.replace(recipe.model, lora=dataclasses.replace(recipe.model.lora, enabled=True))
    # what LoRA would need (its frozen copies are counted as without it: an upper bound)
    lora_shape = None if recipe.model.lora.enabled else model_shape(with_lora, task)
    # (batch, length=None, *, sequence_parallel=None, budget=None) -> Workload
    workload_for = functools.partial(workload_from_recipe, command, recipe, mean_length=mean_length,
                                     image_tokens=image_tokens)
    plan = make_plan(shape, workload_for, t.per_device_train_batch_size, t.gradient_accumulation_steps, gpus,
                     gpu_bytes, nodes, lora_shape, recipe.data.max_length, shortest_budget(command, recipe))
    if is_vision_model(recipe.model):  # a token budget packs rows, which a vision-language model refuses
        plan = dataclasses.replace(plan, token_budget=None)
    line = (launch_command(plan.recommended, command, config, overrides, gpus, nodes,
                           (t.per_device_train_batch_size, t.gradient_accumulation_steps), sp, recipe.data.packing)
            if plan.recommended is not None else None)
    if as_json:
        return json.dumps({"command": command, "model": recipe.model.name_or_path, "parameters": shape.parameters,
                           "trainable": shape.trainable, **to_json(plan, line)}, indent=2)
    lines = [f"posttrain plan: {command}, {recipe.model.name_or_path} ({config_and_source(recipe.model)[1]}): "
             f"{_count(shape.parameters)} parameters ({_count(shape.trainable)} trainable), {precision(recipe, shape)}; "
             f"{gpus} GPU(s) of {gpu_bytes / GIB:.1f} GiB on {nodes} node(s)",
             f"per device at the recipe's batch (per_device_train_batch_size={t.per_device_train_batch_size}, "
             f"gradient_accumulation_steps={t.gradient_accumulation_steps}; {micro_batch_words(command, recipe, mean_length)}"
             f"), GiB; fits = peak <= 90% of the GPU:",
             format_table(plan)]
    if shape.vision is not None:
        lines.insert(1, image_words(shape, workload_for(t.per_device_train_batch_size), image_tokens))
    if plan.recommended is not None:
        r = plan.recommended
        parallel = f", train.sequence_parallel_size={r.sequence_parallel}" if r.sequence_parallel > 1 else ""
        lines += [f"recommended: {r.engine.name}, per_device_train_batch_size={r.per_device_batch} x "
                  f"gradient_accumulation_steps={r.accumulation}{parallel} (peak {r.breakdown.peak_bytes / GIB:.2f} "
                  f"GiB per GPU, {r.breakdown.cpu_bytes / GIB:.2f} GiB CPU RAM per GPU)", f"  {line}"]
        if r.sequence_parallel != sp:
            lines.append(f"  one sequence's activations do not fit one GPU at sequence_parallel_size={sp}: "
                         f"{r.sequence_parallel} ranks each hold 1/{r.sequence_parallel} of every sequence "
                         f"({gpus // r.sequence_parallel} data-parallel group(s) of {r.sequence_parallel})")
        if plan.checkpointed is not None:
            c = plan.checkpointed
            keep = "without sequence parallelism" if c.sequence_parallel == 1 else \
                f"at sequence_parallel_size={c.sequence_parallel}"
            lines.append(f"  or {keep}: train.gradient_checkpointing=true with {c.engine.name}, "
                         f"per_device_train_batch_size={c.per_device_batch} (peak {c.breakdown.peak_bytes / GIB:.2f} "
                         f"GiB per GPU; the backward recomputes each layer's forward, about 1/3 more compute)")
        if plan.token_budget is not None:
            budget, b = plan.token_budget
            how = ("data.packing=true ", "packed") if r.sequence_parallel == 1 else ("", "padded (SP refuses packing)")
            lines.append(f"token budget: {how[0]}train.max_tokens_per_microbatch={budget} (the most {how[1]} tokens "
                         f"a micro-batch may hold here: peak {b.peak_bytes / GIB:.2f} GiB per GPU)")
    else:
        lines += ["nothing fits on these GPUs; what would:"] + [f"  - {s}" for s in plan.suggestions]
    lines.append("estimates are within about 15% of measured peaks where docs/planning.md says they were checked")
    return "\n".join(lines)
