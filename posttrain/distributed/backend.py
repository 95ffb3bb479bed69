"""The one place that knows Accelerate, DeepSpeed, FSDP and torch.distributed.

The loop sees a `Backend`: prepare, backward, step (-> grad norm), accumulate (no_sync), all_reduce, gathered
parameters, full state dict, save/load state. The same code runs as a plain process, under `torchrun`, or under
`accelerate launch --config_file recipes/accelerate/zero3.yaml`; the launcher decides the engine, the recipe decides
the numbers (DeepSpeed "auto" values are filled from it, contradictions stop the run at start-up).

Loss scaling: algorithms return a loss already divided by the GLOBAL count of loss units of the step. Accelerate
(non-DeepSpeed) divides by the accumulation steps and DeepSpeed's engine does the same; DDP, FSDP and ZeRO average
gradients over ranks. `backward` multiplies by accumulation x world size so that, after both, the gradient is
exactly d(sum of unit losses / global count).
"""

from __future__ import annotations

import contextlib
import os
import resource
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from posttrain.config.schema import Recipe
from posttrain.errors import UserError


class Backend:
    def __init__(self, recipe: Recipe):
        t = recipe.train
        self.recipe = recipe
        use_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        launcher_mp = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if launcher_mp and launcher_mp != t.mixed_precision:
            raise UserError(
                f"the accelerate config sets mixed_precision={launcher_mp!r} but the recipe has "
                f"train.mixed_precision={t.mixed_precision!r}; make them agree (the recipe is the source of truth)"
            )
        if use_cpu and t.mixed_precision == "fp16":
            raise UserError("train.mixed_precision=fp16 needs a CUDA GPU; on CPU use bf16 or 'no'")
        pg = InitProcessGroupKwargs(backend="gloo" if use_cpu else "nccl", timeout=timedelta(seconds=t.ddp_timeout))
        self.accelerator = Accelerator(
            cpu=use_cpu,
            mixed_precision=t.mixed_precision,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            kwargs_handlers=[pg] if int(os.environ.get("WORLD_SIZE", "1")) > 1 else [],
            step_scheduler_with_optimizer=False,
        )
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process
        self.device = self.accelerator.device
        self.num_nodes = int(os.environ.get("NNODES", os.environ.get("PET_NNODES", "0")) or 0) or max(
            1, self.world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
        )
        if self.is_deepspeed:
            self._fill_deepspeed_config()

    # --- what is running -------------------------------------------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        return self.accelerator.distributed_type

    @property
    def is_deepspeed(self) -> bool:
        return self.distributed_type == DistributedType.DEEPSPEED

    @property
    def is_fsdp(self) -> bool:
        return self.distributed_type == DistributedType.FSDP

    @property
    def zero_stage(self) -> int:
        if not self.is_deepspeed:
            return 0
        return int(self.accelerator.state.deepspeed_plugin.zero_stage)

    def describe(self) -> dict[str, Any]:
        """The facts rank 0 prints at start: world, nodes, engine, stage, offload, precision."""
        engine = {DistributedType.NO: "single", DistributedType.MULTI_CPU: "ddp", DistributedType.MULTI_GPU: "ddp"}.get(
            self.distributed_type, self.distributed_type.value.lower()
        )
        offload = "none"
        if self.is_deepspeed:
            engine = f"deepspeed-zero{self.zero_stage}"
            zero = self.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            parts = [k for k in ("offload_optimizer", "offload_param") if zero.get(k, {}).get("device", "none") != "none"]
            offload = ",".join(parts) or "none"
        elif self.is_fsdp:
            engine = f"fsdp{getattr(self.accelerator.state.fsdp_plugin, 'fsdp_version', 1)}"
        return {
            "world_size": self.world_size,
            "nodes": self.num_nodes,
            "engine": engine,
            "offload": offload,
            "precision": self.recipe.train.mixed_precision,
            "device": str(self.device),
        }

    # --- DeepSpeed: the recipe is the one source of truth ----------------------------------------------------
    def _fill_deepspeed_config(self) -> None:
        t = self.recipe.train
        plugin = self.accelerator.state.deepspeed_plugin
        config = plugin.deepspeed_config
        wanted = {
            "train_micro_batch_size_per_gpu": ("train.per_device_train_batch_size", t.per_device_train_batch_size),
            "gradient_accumulation_steps": ("train.gradient_accumulation_steps", t.gradient_accumulation_steps),
            "gradient_clipping": ("train.max_grad_norm", t.max_grad_norm),
            "train_batch_size": (
                "per_device_train_batch_size x gradient_accumulation_steps x world size",
                t.per_device_train_batch_size * t.gradient_accumulation_steps * self.world_size,
            ),
        }
        for key, (recipe_key, value) in wanted.items():
            current = config.get(key, "auto")
            if current == "auto":
                config[key] = value
            elif float(current) != float(value):
                raise UserError(
                    f"the DeepSpeed config sets {key}={current} but the recipe gives {recipe_key}={value}; "
                    f"set {key} to \"auto\" in the DeepSpeed config (or change the recipe) so they agree"
                )
        for precision, enabled in (("bf16", t.mixed_precision == "bf16"), ("fp16", t.mixed_precision == "fp16")):
            section = config.setdefault(precision, {})
            current = section.get("enabled", "auto")
            if current == "auto":
                section["enabled"] = enabled
            elif bool(current) != enabled:
                raise UserError(
                    f"the DeepSpeed config sets {precision}.enabled={current} but the recipe has "
                    f"train.mixed_precision={t.mixed_precision!r}; make them agree (or use \"auto\")"
                )
        plugin.gradient_accumulation_steps = t.gradient_accumulation_steps

    # --- training --------------------------------------------------------------------------------------------
    def prepare(self, model, optimizer):
        return self.accelerator.prepare(model, optimizer)

    def prepare_frozen(self, model):
        """A model used only for no-grad forwards (reference policy). Under ZeRO-3 it is sharded for inference."""
        if self.is_deepspeed:
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": self.recipe.train.per_device_train_batch_size,
                "bf16": {"enabled": self.recipe.train.mixed_precision == "bf16"},
                "fp16": {"enabled": self.recipe.train.mixed_precision == "fp16"},
                "zero_optimization": {"stage": 3 if self.zero_stage == 3 else 0},
            }
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.eval()
            return engine
        model.to(self.device)
        model.eval()
        return model

    def accumulate(self, model) -> contextlib.AbstractContextManager:
        """Skips the gradient all-reduce on all but the last micro-batch of a step."""
        return self.accelerator.accumulate(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss * (self.recipe.train.gradient_accumulation_steps * self.world_size))

    def step(self, model, optimizer) -> torch.Tensor:
        """Clip, step, zero the gradients. Returns the global gradient norm (before clipping)."""
        max_norm = self.recipe.train.max_grad_norm
        if self.is_deepspeed:
            # the engine already clipped and stepped inside backward() at the accumulation boundary
            norm = self.accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()
            norm = torch.tensor(float(norm) if norm is not None else float("nan"))
        else:
            norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
            norm = torch.as_tensor(norm).detach().float().cpu()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def autocast(self):
        return self.accelerator.autocast()

    # --- collectives -----------------------------------------------------------------------------------------
    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        y = x.detach().to(self.device, torch.float64 if x.dtype == torch.float64 else torch.float32).clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y.to(x.device)

    def all_reduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(x) / self.world_size

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    # --- parameters and state --------------------------------------------------------------------------------
    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    @contextlib.contextmanager
    def gathered_parameters(self, model) -> Iterator[None]:
        """Full parameters on every rank for the duration (ZeRO-3 generation / export); a no-op elsewhere."""
        if self.is_deepspeed and self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                yield
        else:
            yield

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The whole model's weights (gathered from shards) on rank 0; other ranks may get an empty dict."""
        return self.accelerator.get_state_dict(model)

    def save_state(self, path: str) -> None:
        self.accelerator.save_state(path, safe_serialization=True)

    def load_state(self, path: str) -> None:
        self.accelerator.load_state(path)

    def peak_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def end(self) -> None:
        """Leave the process clean: trackers closed, process group destroyed, Accelerate's singletons reset (so a
        second run in the same process, as in tests and the demo, starts from scratch)."""
        from accelerate.state import AcceleratorState, GradientState

        self.accelerator.end_training()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def abort() -> None:
    """After an unrecoverable error on this rank: exit now, so peers waiting in a collective see the connection
    drop (and torchrun / accelerate launch stop the group) instead of hanging until the timeout."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        os._exit(1)
