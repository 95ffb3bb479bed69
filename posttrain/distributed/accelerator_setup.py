"""How the Accelerator of a run is built: the launcher decides the engine (DDP, DeepSpeed, FSDP2), and on CPU the
gloo process group is made first, then the engine the launcher asked for is switched on over it.

Accelerate only turns DeepSpeed / FSDP on for accelerator devices and, on CPU, only talks over gloo when asked; a
launcher's choice that Accelerate did not honour stops the run instead of falling back to plain data parallelism.
"""

from __future__ import annotations

import os
from datetime import timedelta

from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

from posttrain.config.schema import TrainConfig
from posttrain.distributed.launch_config import env_flag, launcher_engine
from posttrain.errors import UserError


def _check_not_a_lone_cpu_process() -> None:
    """`accelerate launch --cpu --num_processes 2` starts ONE process that expects mpirun to start the others."""
    launched = any(k in os.environ for k in ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))
    if env_flag("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and not launched:
        raise UserError("accelerate launch --cpu with several processes starts only one here (it expects mpirun). "
                        "Use `torchrun --nproc_per_node N -m posttrain ...`, or `accelerate launch --config_file "
                        "recipes/accelerate/ddp.yaml --num_processes N -m posttrain ...` (without --cpu: with no GPU, "
                        "posttrain runs every process on the CPU over gloo)")


def make_accelerator(t: TrainConfig, use_cpu: bool) -> Accelerator:
    timeout = timedelta(seconds=t.ddp_timeout)
    engine = launcher_engine()
    _check_not_a_lone_cpu_process()
    if use_cpu and engine is not None:
        if "LOCAL_RANK" not in os.environ:  # torchrun / accelerate launch set it, a plain `posttrain` does not
            raise UserError(f"ACCELERATE_USE_{engine.upper()}=true asks for {engine}, which needs a launcher: run "
                            "through `torchrun --nproc_per_node N -m posttrain ...` or `accelerate launch "
                            "--config_file ... -m posttrain ...`")
        # the gloo group first, with the right world size; the engine is then enabled over it (cpu=False below)
        PartialState(cpu=True, backend="gloo", timeout=timeout)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = [InitProcessGroupKwargs(backend="gloo" if use_cpu else "nccl", timeout=timeout)] if world > 1 else []
    try:
        accelerator = Accelerator(cpu=use_cpu and engine is None, mixed_precision=t.mixed_precision,
                                  gradient_accumulation_steps=t.gradient_accumulation_steps, kwargs_handlers=handlers,
                                  step_scheduler_with_optimizer=False)
    except ValueError as e:  # Accelerate's own checks of the launcher configuration
        raise UserError(f"the launcher configuration does not work: {e}") from e
    if use_cpu and engine == "fsdp" and accelerator.distributed_type == DistributedType.MULTI_CPU:
        _enable_fsdp_on_cpu(t.mixed_precision)
    running = {DistributedType.DEEPSPEED: "deepspeed", DistributedType.FSDP: "fsdp"}.get(accelerator.distributed_type)
    if engine is not None and running != engine:  # never a silent fallback to plain data parallelism
        why = ("ACCELERATE_USE_CPU=true (accelerate launch --cpu) turns engines off: drop it, posttrain runs on the "
               "CPU by itself when there is no GPU") if env_flag("ACCELERATE_USE_CPU") else (
               "start the processes with torchrun or accelerate launch")
        raise UserError(f"the launcher asked for {engine} but Accelerate started "
                        f"{accelerator.distributed_type.value}: {why}")
    return accelerator


def _enable_fsdp_on_cpu(mixed_precision: str) -> None:
    """Accelerate switches to FSDP only for GPU-like devices; FSDP2's fully_shard itself runs on CPU over gloo
    (FSDP1 does not), so the state Accelerate would have built is set here."""
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise UserError("FSDP on CPU needs FSDP2: set fsdp_version: 2 in the accelerate config (or FSDP_VERSION=2); "
                        "FSDP1 runs only on GPUs")
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    state = AcceleratorState()
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def reset_accelerate_state() -> None:
    """Accelerate keeps its state in process-wide singletons; a new Backend starts from none."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
