"""The one place that knows Accelerate, DeepSpeed, FSDP and torch.distributed.

The loop sees a `Backend`: prepare, backward, step (-> grad norm), accumulate (no_sync), all_reduce, gathered
parameters, full state dict, save/load state. The same code runs as a plain process, under `torchrun`, or under
`accelerate launch --config_file recipes/accelerate/zero3.yaml`; the launcher decides the engine, the recipe decides
the numbers (DeepSpeed "auto" values are filled from it and contradictions stop the run at start-up: launch_config.py).

Loss scaling: algorithms return a loss already divided by the GLOBAL count of loss units of the step. Accelerate
(non-DeepSpeed) divides by the accumulation steps and DeepSpeed's engine does the same; DDP, FSDP and ZeRO average
gradients over ranks. `backward` multiplies by accumulation x world size so that, after both, the gradient is
exactly d(sum of unit losses / global count). Both divisions are by constants, so this stays exact when a step holds
another number of micro-batches than `gradient_accumulation_steps` (train.max_tokens_per_microbatch): the loop marks
the step's last micro-batch itself (`accumulate(model, last)`).

CPU (tests, laptops): Accelerate only turns DeepSpeed / FSDP on for accelerator devices and, on CPU, only talks
over gloo when asked. So on CPU the process group is made here first (gloo, the recipe's timeout), and then the
engine the launcher asked for is switched on over it; see `accelerator_setup.make_accelerator`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import resource
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from posttrain.config.schema import Recipe
from posttrain.distributed import peers
from posttrain.distributed.accelerator_setup import make_accelerator, reset_accelerate_state
from posttrain.distributed.build_locks import announce_cpu_op_builds, clear_stale_build_locks
from posttrain.distributed.launch_config import (check_launcher_settings, env_flag, fill_deepspeed_config,
                                                 launcher_engine)
from posttrain.distributed.offload import Offloaded
from posttrain.distributed.precision import announce_precision, check_precision, resolve_precision
from posttrain.distributed.process_exit import settle_at_exit
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.distributed.weight_sync import adapter_units, frozen_in, sync_buckets, sync_units

# DeepSpeed still calls the torch collectives that torch 2.x deprecates; one warning per call buries the log.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor).*")


class Backend:
    def __init__(self, recipe: Recipe):
        use_cpu = not torch.cuda.is_available() or env_flag("ACCELERATE_USE_CPU")
        self.precision = resolve_precision(recipe.model, recipe.train)
        check_precision(self.precision, use_cpu, launcher_engine())
        # the recipe as it runs: train.mixed_precision is the autocast the run uses (a 16-bit model.dtype trains
        # float32 master weights under its own autocast: distributed/precision.py), for Accelerate, DeepSpeed and FSDP2
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train,
                                                                       mixed_precision=self.precision.autocast))
        t = recipe.train
        self.recipe = recipe
        check_launcher_settings(t)
        reset_accelerate_state()  # an earlier run in this process (tests, the demo) that stopped on an error
        if use_cpu and launcher_engine() == "deepspeed":  # before DeepSpeed loads (and JIT-checks) its CPU ops
            clear_stale_build_locks()
            announce_cpu_op_builds(os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE") in ("cpu", "nvme"))
        self.accelerator = make_accelerator(t, use_cpu)
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process
        self.device = self.accelerator.device
        # torchrun gives every worker the number of nodes (agents) as GROUP_WORLD_SIZE
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.num_nodes = int(os.environ.get("GROUP_WORLD_SIZE", 0)) or max(1, self.world_size // max(1, local_world))
        if self.is_deepspeed:  # every batch / accumulation / clipping / precision value comes from the recipe
            plugin = self.accelerator.state.deepspeed_plugin
            fill_deepspeed_config(plugin.deepspeed_config, t, self.world_size)
            plugin.gradient_accumulation_steps = t.gradient_accumulation_steps
        if self.is_main:
            announce_precision(self.precision, on_cpu=self.device.type == "cpu")
        if self.world_size > 1:  # who is where, so a rank whose peer dies can say which
            peers.record(self.all_gather_object(peers.me()))
        # train.sequence_parallel_size: groups of consecutive ranks share rows (distributed/sequence_parallel.py)
        self.sequence_parallel = None
        if t.sequence_parallel_size > 1:
            self.sequence_parallel = SequenceParallel.start(t.sequence_parallel_size, recipe.model.attn_implementation)
        self.sequence_parallel_size = t.sequence_parallel_size
        self.data_rank = self.rank // self.sequence_parallel_size
        self.data_world_size = self.world_size // self.sequence_parallel_size

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
    def can_skip_steps(self) -> bool:
        """A step's update can still be dropped after backward (train.nonfinite=skip); DeepSpeed's is already done."""
        return not self.is_deepspeed

    @property
    def full_weights_in_place(self) -> bool:
        """`gathered_parameters` makes each parameter whole in place (one process, DDP, ZeRO); FSDP2's stay DTensor
        shards, whose whole values come from `full_state_dict`."""
        return not self.is_fsdp

    @property
    def zero_stage(self) -> int:
        return int(self.accelerator.state.deepspeed_plugin.zero_stage) if self.is_deepspeed else 0

    def describe(self) -> dict[str, Any]:
        """The facts rank 0 prints at start: world, nodes, engine, stage, offload, precision."""
        engine = {DistributedType.NO: "single", DistributedType.MULTI_CPU: "ddp", DistributedType.MULTI_GPU: "ddp"}.get(
            self.distributed_type, self.distributed_type.value.lower())
        offload = "none"
        if self.is_deepspeed:
            engine = f"deepspeed-zero{self.zero_stage}"
            zero = self.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            parts = [k.replace("offload_", "") for k in ("offload_optimizer", "offload_param")
                     if (zero.get(k) or {}).get("device", "none") not in ("none", None)]
            offload = ",".join(parts) or "none"
        elif self.is_fsdp:
            plugin = self.accelerator.state.fsdp_plugin
            engine = f"fsdp{getattr(plugin, 'fsdp_version', 1)}"
            policy = getattr(plugin, "cpu_offload", None)  # FSDP1's CPUOffload, FSDP2's OffloadPolicy
            offloads = bool(getattr(policy, "offload_params", False)) or type(policy).__name__ == "CPUOffloadPolicy"
            offload = "param,optimizer" if offloads else "none"
        return {"world_size": self.world_size, "nodes": self.num_nodes, "engine": engine, "offload": offload,
                "precision": self.recipe.train.mixed_precision, "device": str(self.device)}

    # --- DeepSpeed's universal checkpoint format -----------------------------------------------------------
    @staticmethod
    def convert_to_universal(engine_dir: Path, target_dir: Path) -> None:
        """One DeepSpeed engine checkpoint (the per-rank shards under engine_dir) rewritten in DeepSpeed's universal
        format under target_dir: each parameter's weights and optimiser state whole. Called on one rank."""
        from deepspeed.checkpoint.ds_to_universal import main as convert

        args = argparse.Namespace(input_folder=str(engine_dir), output_folder=str(target_dir), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        with contextlib.redirect_stdout(io.StringIO()):  # the converter prints every stage
            convert(args)

    def load_universal(self) -> None:
        """The DeepSpeed engine built by `prepare` reads checkpoints in the universal format."""
        self.accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True

    # --- training --------------------------------------------------------------------------------------------
    def prepare(self, model, optimizer, leaf_modules: Sequence[type] = ()):
        """leaf_modules: classes ZeRO-3 gathers as one unit (models/moe.sparse_block_classes)."""
        self._zero3_leaves(model, leaf_modules)
        return self.accelerator.prepare(model, optimizer)

    def _zero3_leaves(self, model, leaf_modules: Sequence[type]) -> None:
        """ZeRO-3 gathers a mixture-of-experts block (router and experts) as one unit: gathering per expert module,
        a rank whose tokens route no token to some expert would skip its gather while the others wait in it."""
        if self.zero_stage == 3 and leaf_modules:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, list(leaf_modules))

    def prepare_frozen(self, model, offload: bool = False, leaf_modules: Sequence[type] = ()):
        """A no-grad model (reference, reward model): partitioned like the trained ones under ZeRO-3. offload: its
        weights stay in CPU memory between forwards (ZeRO-3: DeepSpeed's parameter offload; else Offloaded)."""
        zero3 = self.zero_stage == 3
        precision = self.recipe.train.mixed_precision
        if zero3 or (self.is_deepspeed and not offload):
            import deepspeed

            zero = {"stage": 3 if zero3 else 0}
            launcher = self.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            if zero3 and (offload or (launcher.get("offload_param") or {}).get("device") not in ("none", None)):
                zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
            config = {"train_micro_batch_size_per_gpu": self.recipe.train.per_device_train_batch_size,
                      "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
                      "zero_optimization": zero}
            self._zero3_leaves(model, leaf_modules)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.eval()
            return engine
        model.eval()
        if offload:
            if self.is_deepspeed and precision in ("bf16", "fp16"):  # as DeepSpeed's engine would hold it
                model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
            return Offloaded(model, self.device)
        return model.to(self.device)

    @contextlib.contextmanager
    def accumulate(self, model, last: bool) -> Iterator[None]:
        """One micro-batch's forward + backward; `last`: it ends the step, so its backward reduces the gradients
        across ranks (DDP no_sync, FSDP2 requires-gradient-sync and DeepSpeed's accumulation boundary stand aside
        for it) and the optimizer may step. The loop says which micro-batch is last, rather than Accelerate counting
        `gradient_accumulation_steps` of them, so a step may hold any number (token-budget micro-batches) as long as
        every rank runs the same number."""
        self.accelerator.gradient_state._set_sync_gradients(last)  # read by backward and Accelerate's optimizer
        with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
            yield

    def backward(self, loss: torch.Tensor, model=None) -> None:
        """Backward of `model`'s loss (the policy's when None). Under DeepSpeed each trained model is its own engine,
        stepped at the accumulation boundary only, as Accelerate's DeepSpeedEngineWrapper does for one."""
        loss = loss * (self.recipe.train.gradient_accumulation_steps * self.world_size)
        if self.is_deepspeed and model is not None:
            boundary = self.accelerator.sync_gradients
            model.set_gradient_accumulation_boundary(is_boundary=boundary)
            model.backward(loss)
            if boundary:
                model.step()
        else:
            self.accelerator.backward(loss)

    def step(self, model, optimizer, skip_nonfinite: bool = False) -> torch.Tensor:
        """Clip, step, zero the gradients; returns the global norm before clipping. skip_nonfinite: a NaN/inf norm
        drops the update on every rank (not under DeepSpeed, whose engine already stepped)."""
        max_norm = self.recipe.train.max_grad_norm
        if self.is_deepspeed:
            # the engine already clipped and stepped inside backward() at the accumulation boundary
            norm = model.get_global_grad_norm()
            norm = torch.tensor(float(norm) if norm is not None else float("nan"))
        else:
            norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
            norm = torch.as_tensor(norm).detach().float().cpu()
        if not skip_nonfinite or torch.isfinite(norm):
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

    @property
    def data_weight(self) -> float:
        """1 on the first rank of each sequence-parallel group, 0 on the others (which hold the same rows)."""
        return float(self.rank % self.sequence_parallel_size == 0)

    def data_all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks of a figure of the rows (a count, a reward): the ranks of a sequence-parallel
        group hold the same rows, so only the group's first counts. Exact: each term is multiplied by 1 or 0."""
        return self.all_reduce_sum(x * self.data_weight)

    def data_all_gather_object(self, obj: Any) -> list[Any]:
        """Every data rank's `obj` (the first rank's of each sequence-parallel group), in data-rank order."""
        return self.all_gather_object(obj)[:: self.sequence_parallel_size]

    def same_rows(self, obj: Any) -> Any:
        """The rows of the sequence-parallel group's first rank on every rank of it (generated rows may differ)."""
        return obj if self.sequence_parallel is None else self.sequence_parallel.broadcast(obj)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [obj] if self.world_size == 1 else [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    # --- parameters and state --------------------------------------------------------------------------------
    def unwrap(self, model):  # with nothing wrapping it, accelerate would import DeepSpeed just to check
        return model if self.distributed_type == DistributedType.NO else self.accelerator.unwrap_model(model)

    @contextlib.contextmanager
    def gathered_parameters(self, model) -> Iterator[None]:
        """Full parameters on every rank for the duration (generation, export), gathered once: no forward inside
        makes a collective call, so ranks may run different numbers of forwards. A no-op where nothing is sharded."""
        if self.zero_stage == 3:
            with _zero3_gathered(list(model.parameters())):
                yield
        elif self.is_fsdp:
            from torch.distributed.fsdp import FSDPModule

            sharded = [m for m in self.unwrap(model).modules() if isinstance(m, FSDPModule)]
            for module in sharded:  # every rank, same order
                module.set_reshard_after_forward(False, recurse=False)
                module.unshard()
            try:
                yield
            finally:
                after_forward = self.accelerator.state.fsdp_plugin.reshard_after_forward
                for module in sharded:
                    module.reshard()
                    module.set_reshard_after_forward(bool(after_forward), recurse=False)
        else:
            yield

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0, tied weights once; {} elsewhere. A collective: every rank calls it."""
        state = self._gather_zero3(model) if self.zero_stage == 3 else self.accelerator.get_state_dict(model)
        return drop_tied_aliases(self.unwrap(model), state) if self.is_main else {}

    def weight_buckets(self, model, bucket_mb: float, adapter: bool = False, frozen_out: tuple[str, ...] = ()
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The policy's full parameters for a weight sync in ~`bucket_mb` MiB buckets, named as the plain model names
        them (LoRA folded in, a tied weight once); with `adapter`, a LoRA model's adapter tensors alone, named as peft
        saves them; without the frozen tensors of the modules named in `frozen_out` (weight_sync.frozen_in). Every
        rank iterates to the end (each bucket is a collective under ZeRO-3 / FSDP2); a bucket's tensors are valid
        until the next one is asked for."""
        zero3 = self.zero_stage == 3
        units = (adapter_units if adapter else sync_units)(self.unwrap(model))
        left_out = {id(u) for u in frozen_in(units, frozen_out)}
        for units in sync_buckets([u for u in units if id(u) not in left_out], bucket_mb):
            params = [p for u in units for p in u.params]
            with _zero3_gathered(params) if zero3 else contextlib.nullcontext(), torch.no_grad():
                # an FSDP2 parameter is a DTensor shard: full_tensor() gathers it
                full = {id(p): (p.full_tensor() if hasattr(p, "full_tensor") else p.data) for p in params}
                tensors = (u.compute([full[id(p)] for p in u.params]) for u in units)
                yield [(u.name, t.clone() if zero3 else t) for u, t in zip(units, tensors)]  # ZeRO-3 frees its gather

    def _gather_zero3(self, model) -> dict[str, torch.Tensor]:
        """ZeRO-3: one parameter at a time (no rank holds two full copies) into rank 0's CPU memory."""
        unwrapped = self.unwrap(model)
        state = unwrapped.state_dict() if self.is_main else {}  # buffers; parameter entries are replaced below
        for name, param in unwrapped.named_parameters():
            with _zero3_gathered([param]):
                if self.is_main:
                    state[name] = param.detach().to("cpu", copy=True)
        return state

    def nonfinite_parameters(self, model) -> int:
        """How many of this rank's parameter tensors (its shards under ZeRO-3 / FSDP2) hold NaN or inf."""
        def local(param):  # ZeRO-3: the parameter is an empty placeholder beside its shard; FSDP2: a DTensor
            shard = getattr(param, "ds_tensor", None)
            if shard is None:
                return param.to_local() if hasattr(param, "to_local") else param
            # the last ranks' shards are padded past the parameter's end with never-initialised memory (any bits,
            # NaN included): only the elements this rank owns count
            start = dist.get_rank(group=getattr(param, "ds_process_group", None)) * shard.numel()
            return shard.narrow(0, 0, max(0, min(shard.numel(), param.ds_numel - start)))

        return sum(int(not bool(torch.isfinite(local(p).detach()).all())) for p in model.parameters())

    def save_state(self, path: str) -> None:
        self.accelerator.save_state(path, safe_serialization=True)

    def load_state(self, path: str) -> None:
        self.accelerator.load_state(path)

    def peak_memory_bytes(self) -> int:
        """Peak CUDA memory allocated on GPU; peak resident set size of this process on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def end(self) -> None:
        """Trackers closed, process group destroyed, Accelerate's singletons reset (a second run in this process
        starts from scratch)."""
        self.accelerator.end_training()
        if self.sequence_parallel is not None:
            self.sequence_parallel.stop()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        settle_at_exit()  # also when an in-process vLLM engine destroyed the group it adopted (its gloo threads)
        reset_accelerate_state()


def _zero3_gathered(params) -> contextlib.AbstractContextManager:
    """DeepSpeed's ZeRO-3 gathering: `params` whole on every rank inside the block (deepspeed imported when used)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def drop_tied_aliases(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tied weight (lm_head = embed_tokens) under one name: gathered copies no longer share storage, so
    save_pretrained cannot see the tie by itself."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and first[id(param)] in state:
            state.pop(name, None)
        else:
            first.setdefault(id(param), name)
    return state
