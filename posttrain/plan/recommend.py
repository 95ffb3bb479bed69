"""Every engine at the recipe's micro-batch, the fastest configuration that fits, and what would fit otherwise.

    result = make_plan(shape, functools.partial(workload_from_recipe, "sft", recipe), per_device_batch=8,
                       accumulation=2, gpus=8, gpu_bytes=40 * GIB, shortest_budget=recipe.data.max_length)
    result.recommended            # Option(engine, per_device_batch, accumulation, breakdown, sequence_parallel)
    result.token_budget           # the largest train.max_tokens_per_microbatch that fits packed, or None
    result.suggestions            # when nothing fits: more GPUs, LoRA, shorter sequences
    print(format_table(result))

An option fits when its peak is at most USABLE_FRACTION of the device's memory; engines are tried fastest first, each
at the largest micro-batch that keeps the global batch, and when none fits with the recipe's sequence parallelism,
the smallest sequence-parallel degree that fits (docs/planning.md says why).
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from dataclasses import dataclass
from typing import Callable, Optional

from posttrain.plan.estimate import ENGINES, GIB, Breakdown, Engine, ModelShape, Workload, estimate
from posttrain.models.limits import SEQUENCE_PARALLEL_ALGORITHMS

USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Option:
    engine: Engine
    per_device_batch: int
    accumulation: int
    breakdown: Breakdown
    fits: bool
    sequence_parallel: int = 1
    """train.sequence_parallel_size of this option."""


@dataclass(frozen=True)
class Plan:
    gpus: int
    nodes: int
    gpu_bytes: int
    at_recipe_batch: list[Option]
    recommended: Optional[Option]
    suggestions: list[str]
    token_budget: Optional[tuple[int, Breakdown]] = None
    """The largest train.max_tokens_per_microbatch (with data.packing) that fits the recommended option, and its
    estimate; None when no budget of whole units fits."""
    checkpointed: Optional[Option] = None
    """Where sequence parallelism is recommended: what fits without it under gradient checkpointing, if anything."""


WorkloadFor = Callable[..., Workload]  # (per_device_batch, max_length=None, *, sequence_parallel, budget) -> Workload


def splits(per_device_batch: int, accumulation: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs with the same product, largest micro-batch first."""
    product = per_device_batch * accumulation
    return [(b, product // b) for b in range(product, 0, -1) if product % b == 0]


def fits(breakdown: Breakdown, gpu_bytes: int) -> bool:
    return breakdown.peak_bytes <= USABLE_FRACTION * gpu_bytes


def best_option(shape: ModelShape, workload_for: WorkloadFor, engine: Engine, per_device_batch: int,
                accumulation: int, gpus: int, gpu_bytes: int, sequence_parallel: int = 0) -> Optional[Option]:
    """The largest micro-batch that fits under `engine` (at `sequence_parallel`; 0: the recipe's), or None. Under a
    token budget the recipe's split is kept: the budget cuts the micro-batches, whatever the split."""
    pairs = splits(per_device_batch, accumulation)
    if workload_for(per_device_batch, sequence_parallel=sequence_parallel or None).token_budget is not None:
        pairs = [(per_device_batch, accumulation)]
    for batch, steps in pairs:
        w = workload_for(batch, sequence_parallel=sequence_parallel or None)
        breakdown = estimate(shape, w, engine, gpus, gpu_bytes)
        if fits(breakdown, gpu_bytes):
            return Option(engine, batch, steps, breakdown, True, w.sequence_parallel)
    return None


def sequence_parallel_degrees(shape: ModelShape, gpus: int) -> list[int]:
    """SP degrees above 1 that Ulysses can run here, smallest first: N divides the GPUs (world = data x sequence
    ranks) and the attention heads (each rank attends with heads / N), and the key/value heads divide by N or N by
    them (DeepSpeed replicates them then)."""
    return [n for n in range(2, gpus + 1) if gpus % n == 0 and shape.num_heads % n == 0
            and (shape.num_kv_heads % n == 0 or n % shape.num_kv_heads == 0)]


def make_plan(shape: ModelShape, workload_for: WorkloadFor, per_device_batch: int, accumulation: int, gpus: int,
              gpu_bytes: int, nodes: int = 1, lora_shape: Optional[ModelShape] = None,
              max_length: Optional[int] = None, shortest_budget: Optional[int] = None) -> Plan:
    """Estimates at the recipe's batch for every engine, the recommendation (with a sequence-parallel degree when
    the recipe's does not fit), the largest token budget (`shortest_budget`: the longest unit, below which no budget
    works; None: none is sought), and suggestions if nothing fits."""
    breakdowns = {e: estimate(shape, workload_for(per_device_batch), e, gpus, gpu_bytes) for e in ENGINES.values()}
    recipe = workload_for(per_device_batch)
    runs_here = lambda engine, n: n == 1 or engine.sequence_parallel  # noqa: E731 - FSDP does not run SP
    table = [Option(e, per_device_batch, accumulation, b, fits(b, gpu_bytes) and runs_here(e, recipe.sequence_parallel),
                    recipe.sequence_parallel) for e, b in breakdowns.items()]
    degrees = [0]  # the recipe's, then more where this algorithm and attention run Ulysses (sdpa / flash)
    if recipe.algorithm in SEQUENCE_PARALLEL_ALGORITHMS and not recipe.eager_attention:
        degrees += [n for n in sequence_parallel_degrees(shape, gpus) if n > recipe.sequence_parallel]
    # the fastest engine that fits, least SP first; offload last: it moves optimizer state over PCIe every step,
    # which costs more than Ulysses' all-to-alls inside the node
    runs = [(n, e) for n in degrees for e in ENGINES.values() if runs_here(e, n or recipe.sequence_parallel)]
    order = [(n, e) for n, e in runs if not e.offload_optimizer] + [(n, e) for n, e in runs if e.offload_optimizer]
    options = (best_option(shape, workload_for, e, per_device_batch, accumulation, gpus, gpu_bytes, n)
               for n, e in order)
    recommended = next((o for o in options if o is not None), None)
    ways = [] if recommended is not None else suggestions(shape, workload_for, gpus, gpu_bytes, lora_shape, max_length)
    budget = None
    if recommended is not None and shortest_budget:
        budget = largest_budget(shape, workload_for, recommended, per_device_batch, gpus, gpu_bytes, shortest_budget)
    checkpointed = None
    if recommended is not None and recommended.sequence_parallel > recipe.sequence_parallel and \
            not recipe.gradient_checkpointing:  # the other way to fit a long sequence: recompute the forward
        checkpointed = with_checkpointing(shape, workload_for, per_device_batch, accumulation, gpus, gpu_bytes)
    return Plan(gpus, nodes, gpu_bytes, table, recommended, ways, budget, checkpointed)


def with_checkpointing(shape: ModelShape, workload_for: WorkloadFor, per_device_batch: int, accumulation: int,
                       gpus: int, gpu_bytes: int) -> Optional[Option]:
    """The fastest engine that fits the recipe's SP degree under gradient checkpointing, or None."""
    def recomputed(batch, *args, **kwargs):
        return dataclasses.replace(workload_for(batch, *args, **kwargs), gradient_checkpointing=True)

    options = (best_option(shape, recomputed, e, per_device_batch, accumulation, gpus, gpu_bytes)
               for e in ENGINES.values())
    return next((o for o in options if o is not None), None)


def largest_budget(shape: ModelShape, workload_for: WorkloadFor, option: Option, per_device_batch: int, gpus: int,
                   gpu_bytes: int, shortest: int) -> Optional[tuple[int, Breakdown]]:
    """The largest token budget (at least `shortest`, at most the device's tokens of a step) whose micro-batches fit
    under `option`'s engine and SP degree (packed; padded under SP): activations grow with the budget, so a
    bisection finds it. None when not even `shortest` fits."""
    def at(budget: int) -> Breakdown:
        w = workload_for(per_device_batch, sequence_parallel=option.sequence_parallel, budget=budget)
        return estimate(shape, w, option.engine, gpus, gpu_bytes)

    # one micro-batch a step: a budget above every row of the step at full length
    most = max(shortest, workload_for(per_device_batch, sequence_parallel=option.sequence_parallel,
                                      budget=2**62).tokens)
    if not fits(at(shortest), gpu_bytes):
        return None
    if fits(at(most), gpu_bytes):
        return most, at(most)
    low, high = shortest, most  # fits at low, not at high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(at(middle), gpu_bytes) else (low, middle)
    # padded, a budget holds whole rows: name the tokens they really hold (a budget between two rows' worth is moot)
    held = workload_for(per_device_batch, sequence_parallel=option.sequence_parallel, budget=low).real_tokens
    best = max(shortest, min(low, held))
    return best, at(best)


def suggestions(shape: ModelShape, workload_for: WorkloadFor, gpus: int, gpu_bytes: int,
                lora_shape: Optional[ModelShape], max_length: Optional[int]) -> list[str]:
    """What would fit at micro-batch 1: more GPUs (ZeRO-3 shards everything), LoRA, shorter sequences."""
    out = []
    zero3, offload = ENGINES["zero3"], ENGINES["zero3_offload"]
    one = workload_for(1)
    for more in (2**k for k in range(1, 11)):
        n = gpus * more
        engine = next((e for e in (zero3, offload) if fits(estimate(shape, one, e, n, gpu_bytes), gpu_bytes)), None)
        if engine is not None:
            out.append(f"{n} GPUs of this size with {engine.name} at per_device_train_batch_size=1")
            break
    if lora_shape is not None:
        for engine in ENGINES.values():
            if fits(estimate(lora_shape, one, engine, gpus, gpu_bytes), gpu_bytes):
                out.append(f"LoRA (model.lora.enabled=true) with {engine.name} on these {gpus} GPUs")
                break
    if max_length:
        length = max_length // 2
        while length >= 64:
            shorter = workload_for(1, length)
            if any(fits(estimate(shape, shorter, e, gpus, gpu_bytes), gpu_bytes) for e in ENGINES.values()):
                out.append(f"data.max_length={length} (from {max_length}) at per_device_train_batch_size=1")
                break
            length //= 2
    if not out:
        out.append("nothing tried fits: use GPUs with more memory or a smaller model")
    return out


def launch_command(option: Option, command: str, config: Optional[str], overrides: list[str], gpus: int,
                   nodes: int, recipe_batch: tuple[int, int], recipe_sp: int = 1, packing: bool = False) -> str:
    """The accelerate launch / torchrun / posttrain line that runs the recipe as recommended (`packing`: the
    recipe's data.packing, turned off where the option adds sequence parallelism, which refuses it)."""
    changes = []
    if (option.per_device_batch, option.accumulation) != recipe_batch:
        changes = [f"train.per_device_train_batch_size={option.per_device_batch}",
                   f"train.gradient_accumulation_steps={option.accumulation}"]
    if option.sequence_parallel != recipe_sp:
        changes.append(f"train.sequence_parallel_size={option.sequence_parallel}")
        changes += ["data.packing=false"] if packing and option.sequence_parallel > 1 else []
    replaced = tuple(change.split("=")[0] + "=" for change in changes)
    keep = [absolute(o) for o in overrides if not o.startswith(replaced)]
    program = f"-m posttrain {command}" + (f" --config {shlex.quote(str(Path(config).resolve()))}" if config else "")
    tail = " ".join([program] + [shlex.quote(o) for o in keep] + changes)
    engine = option.engine
    if engine.accelerate_config is None:
        if gpus == 1:
            return tail.replace("-m posttrain", "posttrain", 1)
        multi = f" --nnodes {nodes} --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port 29500" \
            if nodes > 1 else ""
        return f"torchrun --nproc_per_node {gpus // nodes}{multi} {tail}"
    multi = f" --num_machines {nodes} --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR " \
            f"--main_process_port 29500" if nodes > 1 else ""
    return (f"accelerate launch --config_file {shlex.quote(accelerate_config(engine.accelerate_config))} "
            f"--num_processes {gpus}{multi} {tail}")


def accelerate_config(name: str) -> str:
    """recipes/accelerate/<name>.yaml as an absolute path (a launch may start elsewhere); relative where posttrain
    was installed without its recipes/ (then it is the file of that name in a posttrain checkout)."""
    path = Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / f"{name}.yaml"
    return str(path) if path.is_file() else f"recipes/accelerate/{name}.yaml"


def absolute(override: str) -> str:
    """key=value with a relative path that exists here made absolute (data.train=data/x.jsonl), so the printed
    command runs from any directory; other values as given."""
    key, _, value = override.partition("=")
    if value and not value.startswith(("/", "~")) and ("/" in value or "." in value) and Path(value).exists():
        return f"{key}={Path(value).resolve()}"
    return override


COLUMNS = ("parameters", "gradients", "gradient_buffers", "optimizer", "frozen_copies", "activations", "logits", "gathered",
           "generation", "vllm")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_table(plan: Plan) -> str:
    head = ["engine", "fits", "peak", *(c.replace("_copies", "").replace("gradient_", "grad_") for c in COLUMNS), "cpu"]
    rows = [head]
    for option in plan.at_recipe_batch:
        b = option.breakdown
        rows.append([option.engine.name, "yes" if option.fits else "no", _gib(b.peak_bytes)]
                    + [_gib(getattr(b, c)) for c in COLUMNS] + [_gib(b.cpu_bytes)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def to_json(plan: Plan, command_line: Optional[str]) -> dict:
    def option(o: Option) -> dict:
        return {"engine": o.engine.name, "per_device_train_batch_size": o.per_device_batch,
                "gradient_accumulation_steps": o.accumulation, "sequence_parallel_size": o.sequence_parallel,
                "fits": o.fits, "peak_bytes": o.breakdown.peak_bytes, "breakdown": o.breakdown.parts()}

    budget = None
    if plan.token_budget is not None:
        budget = {"max_tokens_per_microbatch": plan.token_budget[0],
                  "packing": plan.recommended.sequence_parallel == 1,
                  "peak_bytes": plan.token_budget[1].peak_bytes}
    return {"gpus": plan.gpus, "nodes": plan.nodes, "gpu_bytes": plan.gpu_bytes,
            "usable_fraction": USABLE_FRACTION, "engines": [option(o) for o in plan.at_recipe_batch],
            "recommended": option(plan.recommended) if plan.recommended else None, "command": command_line,
            "token_budget": budget, "suggestions": plan.suggestions,
            "gradient_checkpointing_instead": option(plan.checkpointed) if plan.checkpointed else None}
