"""Every engine at the recipe's micro-batch, the fastest configuration that fits, and what would fit otherwise.

    result = make_plan(shape, lambda batch, length=None: workload_from_recipe("sft", recipe, batch, length),
                       per_device_batch=8, accumulation=2, gpus=8, gpu_bytes=40 * GIB)
    result.recommended            # Option(engine, per_device_batch, accumulation, breakdown) or None
    result.suggestions            # when nothing fits: more GPUs, LoRA, shorter sequences
    print(format_table(result))

An option fits when its peak is at most USABLE_FRACTION of the device's memory; engines are tried fastest first, each
at the largest micro-batch that keeps the global batch (docs/planning.md says why).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from dataclasses import dataclass
from typing import Callable, Optional

from posttrain.plan.estimate import ENGINES, GIB, Breakdown, Engine, ModelShape, Workload, estimate

USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Option:
    engine: Engine
    per_device_batch: int
    accumulation: int
    breakdown: Breakdown
    fits: bool


@dataclass(frozen=True)
class Plan:
    gpus: int
    nodes: int
    gpu_bytes: int
    at_recipe_batch: list[Option]
    recommended: Optional[Option]
    suggestions: list[str]


WorkloadFor = Callable[..., Workload]  # (per_device_batch, max_length=None) -> Workload


def splits(per_device_batch: int, accumulation: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs with the same product, largest micro-batch first."""
    product = per_device_batch * accumulation
    return [(b, product // b) for b in range(product, 0, -1) if product % b == 0]


def fits(breakdown: Breakdown, gpu_bytes: int) -> bool:
    return breakdown.peak_bytes <= USABLE_FRACTION * gpu_bytes


def best_option(shape: ModelShape, workload_for: WorkloadFor, engine: Engine, per_device_batch: int,
                accumulation: int, gpus: int, gpu_bytes: int) -> Optional[Option]:
    """The largest micro-batch that fits under `engine`, or None."""
    for batch, steps in splits(per_device_batch, accumulation):
        breakdown = estimate(shape, workload_for(batch), engine, gpus, gpu_bytes)
        if fits(breakdown, gpu_bytes):
            return Option(engine, batch, steps, breakdown, True)
    return None


def make_plan(shape: ModelShape, workload_for: WorkloadFor, per_device_batch: int, accumulation: int, gpus: int,
              gpu_bytes: int, nodes: int = 1, lora_shape: Optional[ModelShape] = None,
              max_length: Optional[int] = None) -> Plan:
    """Estimates at the recipe's batch for every engine, the recommendation, and suggestions if nothing fits."""
    breakdowns = {e: estimate(shape, workload_for(per_device_batch), e, gpus, gpu_bytes) for e in ENGINES.values()}
    table = [Option(e, per_device_batch, accumulation, b, fits(b, gpu_bytes)) for e, b in breakdowns.items()]
    options = (best_option(shape, workload_for, e, per_device_batch, accumulation, gpus, gpu_bytes)
               for e in ENGINES.values())
    recommended = next((o for o in options if o is not None), None)  # the fastest engine that fits
    ways = [] if recommended is not None else suggestions(shape, workload_for, gpus, gpu_bytes, lora_shape, max_length)
    return Plan(gpus, nodes, gpu_bytes, table, recommended, ways)


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
                   nodes: int, recipe_batch: tuple[int, int]) -> str:
    """The accelerate launch / torchrun / posttrain line that runs the recipe as recommended."""
    changes = []
    if (option.per_device_batch, option.accumulation) != recipe_batch:
        changes = [f"train.per_device_train_batch_size={option.per_device_batch}",
                   f"train.gradient_accumulation_steps={option.accumulation}"]
    keep = [absolute(o) for o in overrides if not o.startswith(("train.per_device_train_batch_size=",
                                                                 "train.gradient_accumulation_steps="))]
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
                "gradient_accumulation_steps": o.accumulation, "fits": o.fits, "peak_bytes": o.breakdown.peak_bytes,
                "breakdown": o.breakdown.parts()}

    return {"gpus": plan.gpus, "nodes": plan.nodes, "gpu_bytes": plan.gpu_bytes,
            "usable_fraction": USABLE_FRACTION, "engines": [option(o) for o in plan.at_recipe_batch],
            "recommended": option(plan.recommended) if plan.recommended else None, "command": command_line,
            "suggestions": plan.suggestions}
