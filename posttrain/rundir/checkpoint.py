"""Save, resume and export, through the backend.

    output_dir/checkpoints/step-N/   every trained model + its optimizer (engine format via Accelerate),
                                     trainer_state.json (where the run is, LR schedules, the algorithm's state),
                                     the source's own files (rollouts_in_flight_<rank>.json: train/in_flight.py)
    output_dir/final/                a Hugging Face directory (safetensors, config, tokenizer, generation config)
    output_dir/final-critic/         the same for a trained critic (PPO)

Every directory is written under a temporary name and renamed when complete, so a kill during a save never leaves
a broken newest checkpoint; `resume_from_checkpoint: auto` only ever sees complete ones. The data position is the
step number (see train/sources.py), so trainer_state.json + engine state is everything needed to continue exactly.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.rundir import files
from posttrain.config.schema import global_batch_size
from posttrain.distributed.backend import drop_tied_aliases
from posttrain.distributed.rng_files import rng_problem
from posttrain.rundir.resume import drop_converted, engine_resume_path, needs_conversion
from posttrain.distributed.wrappers import plain_class
from posttrain.errors import RunStopped, UserError
from posttrain.models.load import lora_adapter, merge_lora, merge_lora_state, save_lora_adapter
from posttrain.online import in_flight
from posttrain.train.guard import require_finite
from posttrain.train.state import TrainState

STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and STEP_DIR.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_resume(output_dir: str, resume: Optional[str], strict: bool = True) -> Optional[Path]:
    """`auto` -> newest checkpoint that can be continued exactly (or None: a fresh start); a path must be one.
    What "exactly" checks: resumable_problem (manifest, RNG state; `strict`, train.resume_strict)."""
    if resume is None:
        return None
    if resume == "auto":  # a damaged one is passed over, loudly; none usable among several is an error
        found = list_checkpoints(output_dir)
        for path in reversed(found):
            problem = resumable_problem(path, strict)
            if problem is None:
                return path
            files.warn(f"checkpoint {path} is damaged ({problem}); trying the one before it")
        if found:
            raise UserError(f"train.resume_from_checkpoint=auto: no checkpoint in {Path(output_dir) / 'checkpoints'} "
                            "can be resumed (see the warnings above); remove the damaged ones to start afresh")
        return None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        listed = [str(p) for p in list_checkpoints(output_dir)] or "the checkpoints/step-N directories"
        raise UserError(f"train.resume_from_checkpoint={resume}: not a checkpoint directory (no trainer_state.json); "
                        f"use 'auto' or one of {listed}")
    problem = resumable_problem(path, strict)
    if problem is not None:
        raise UserError(f"train.resume_from_checkpoint={resume}: {problem}")
    return path


def resumable_problem(root: Path, strict: bool = True) -> Optional[str]:
    """What keeps the checkpoint at `root` from being continued exactly, or None: `verify`, then the RNG state
    files. With strict=False a checkpoint without a manifest and RNG files that cannot be read are accepted with a
    warning (the resumed run is then not exact); damage a manifest records never is."""
    problem = files.verify(root)
    if problem is not None and (strict or (root / files.MANIFEST).exists()):
        return problem
    if problem is not None:
        files.warn(f"checkpoint {root} is not verified: {problem} (train.resume_strict=false)")
    try:
        world_size = int(json.loads((root / "trainer_state.json").read_text())["run"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"trainer_state.json is unreadable ({type(e).__name__}: {e})"
    state = state_problem(root) or in_flight.files_problem(root)
    if state is not None:
        return state
    rng = rng_problem(root, world_size)
    if rng is not None and strict:
        return (f"the random number generators' state cannot be restored ({rng}), so the resumed run would not "
                "continue exactly; set train.resume_strict=false to resume without it")
    if rng is not None:
        files.warn(f"checkpoint {root}: {rng}; resuming without the random number generators' state "
             "(train.resume_strict=false): the run is not an exact continuation")
    return None


def state_problem(root: Path) -> Optional[str]:
    """What is wrong with trainer_state.json's record of where the run was (a step of -5 would drop every metrics
    row on resume), or None."""
    try:
        state = json.loads((root / "trainer_state.json").read_text())["state"]
        TrainState(**state)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"trainer_state.json has no readable state ({type(e).__name__}: {e})"
    counts = {k: state.get(k, 0) for k in ("step", "tokens_seen", "samples_seen", "nonfinite_skips")}
    bad = [f"{k}={v!r:.40}" for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        return f"trainer_state.json records {', '.join(bad)}; each must be a whole number >= 0"
    named = STEP_DIR.match(root.name)
    if named and int(named.group(1)) != state["step"]:
        return f"trainer_state.json records step {state['step']}, but the checkpoint is {root.name}"
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())


class Checkpointer:
    def __init__(self, backend, output_dir: str, save_total_limit: Optional[int], run_facts: dict[str, Any],
                 source=None):
        self.backend = backend
        self.source = source  # save_state / load_state: files of its own (generation batches in flight)
        self.root = Path(output_dir) / "checkpoints"
        self.save_total_limit = save_total_limit
        self.run_facts = run_facts  # world size, global batch, engine: checked on resume
        self.last_saved_step = -1

    def save(self, state: TrainState, models, algorithm) -> Path:
        """`_save`, and a full disk said as such: the partial copy removed, the previous checkpoint named intact."""
        previous = (list_checkpoints(self.root.parent) or [None])[-1]
        try:
            return self._save(state, models, algorithm)
        except RunStopped:
            raise
        except Exception as e:
            if files.is_disk_full(e, self.root):
                raise files.disk_full_error(e, self.root / f".tmp-step-{state.step}", previous) from e
            raise

    def _save(self, state: TrainState, models, algorithm) -> Path:
        if state.step == self.last_saved_step:
            return self.root / f"step-{state.step}"
        # a NaN model never replaces a good checkpoint
        require_finite(self.backend, sum(role.nonfinite() for _, role in models.trained()), f"step {state.step}")
        final = self.root / f"step-{state.step}"
        tmp = self.root / f".tmp-step-{state.step}"
        if self.backend.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.backend.barrier()
        self.backend.save_state(str(tmp))
        for name, role in models.trained():  # what the backend's state does not hold (a role trained apart)
            role.save(str(tmp / name))
        if self.source is not None:
            self.source.save_state(tmp)
        self.backend.barrier()  # every rank has written its files (shards, RNG state) before the rename
        if self.backend.is_main:
            schedules = {name: s for name, role in models.trained() if (s := role.schedule_state()) is not None}
            payload = {"state": dataclasses.asdict(state), "scheduler": schedules.pop("policy"),
                       "role_schedulers": schedules, "algorithm": algorithm.state_dict(), "run": self.run_facts}
            (tmp / "trainer_state.json").write_text(json.dumps(payload, indent=2))
            files.write_manifest(tmp)  # sizes and checksums: `auto` tells a complete checkpoint from a damaged one
            files.replace_dir(tmp, final)  # durably; an older step-N of this run goes only once the new one is in place
            self._rotate()
        self.backend.barrier()
        self.last_saved_step = state.step
        return final

    def _rotate(self) -> None:
        if self.save_total_limit is None:
            return
        found = list_checkpoints(self.root.parent)
        for old in found[: max(0, len(found) - self.save_total_limit)]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, models, algorithm) -> TrainState:
        """Engine state of every trained model, their schedules, the algorithm's state and where the run was
        (`check_compatible` passed already: run.py calls it right after the backend starts, before any model loads)."""
        payload = read_trainer_state(path)
        self.backend.load_state(str(path))
        schedules = {"policy": payload["scheduler"], **payload.get("role_schedulers", {})}
        for name, role in models.trained():
            role.restore(str(path / name), schedules.get(name))
        algorithm.load_state_dict(payload.get("algorithm", {}))
        if self.source is not None:
            self.source.load_state(path)
        self.last_saved_step = payload["state"]["step"]
        drop_converted(self.backend, path)  # a copy converted for another process count: read, no longer needed
        return TrainState(**payload["state"])


def run_facts(backend, t) -> dict[str, Any]:
    """What a checkpoint records about the launch, and what resuming compares: world, engine, batch split."""
    return {"world_size": backend.world_size, "nodes": backend.num_nodes, "engine": backend.describe()["engine"],
            "global_batch": global_batch_size(t, backend.data_world_size),
            "per_device_train_batch_size": t.per_device_train_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps}


def check_compatible(path: Path, now: dict[str, Any]) -> bool:
    """Stop before training unless this launch can continue the checkpoint at `path` exactly: the data position is the
    step over a stream cut into global batches (train/sources.py), so the global batch must match (its split may
    change). True when its engine state must first be converted (distributed/resume.py says when and how)."""
    saved = read_trainer_state(path)["run"]
    if saved.get("global_batch") != now["global_batch"]:
        raise UserError(f"{path} was written with a global batch of {saved.get('global_batch')} "
                        f"({saved.get('world_size')} processes x per-device {saved.get('per_device_train_batch_size')} "
                        f"x accumulation {saved.get('gradient_accumulation_steps')}); this run has "
                        f"{now['global_batch']} ({now['world_size']} processes x per-device "
                        f"{now['per_device_train_batch_size']} x accumulation {now['gradient_accumulation_steps']}). "
                        "Change train.gradient_accumulation_steps (or the batch size) so the global batch matches, or "
                        "start a new output_dir")
    return needs_conversion(path, saved, now)


def resume_path(backend, path: Path, now: dict[str, Any], output_dir) -> Path:
    """The checkpoint directory this launch loads for `path` (checked by `check_compatible`), before any model is
    built: `path` itself, or a copy in the format this launch's engine reads."""
    check_compatible(path, now)
    return engine_resume_path(backend, path, read_trainer_state(path)["run"], now, output_dir)


def export_final(backend, model, tokenizer, output_dir: str, name: str = "final",
                 dtype: Optional[str] = None) -> Optional[Path]:
    """Write output_dir/<name> (final; final-critic for PPO's critic) as a Hugging Face directory that from_pretrained
    (and vLLM, for the policy) can load, a LoRA adapter merged into its base weights and also saved alone in
    <name>/adapter/ (PeftModel.from_pretrained(base, that folder)). Every rank calls it: the full
    weights are gathered from the shards (ZeRO-3, FSDP) and rank 0 writes them. dtype: the merged weights' dtype on
    disk (train.export_dtype; None: as trained), which config.json then names."""
    require_finite(backend, backend.nonfinite_parameters(model), "exporting final/")
    unwrapped = backend.unwrap(model)
    adapter = None  # a LoRA model's adapter, saved beside the merged weights in <name>/adapter/ (as TRL saves it)
    if hasattr(unwrapped, "merge_and_unload"):
        if not backend.full_weights_in_place:
            # sharded parameters (FSDP2's DTensors): gather the LoRA model's state to rank 0 and merge a CPU copy there
            state_dict = backend.full_state_dict(model)
            if backend.is_main:
                adapter = lora_adapter(unwrapped, state_dict)
                unwrapped = merge_lora_state(unwrapped, state_dict, plain_class(unwrapped.get_base_model()))
                state_dict = dict(unwrapped.state_dict())
        else:
            # merging needs the whole base weights: under ZeRO-3 every rank gathers them and merges the same way
            with backend.gathered_parameters(model):
                adapter = lora_adapter(unwrapped) if backend.is_main else None
                unwrapped = merge_lora(unwrapped)
                state_dict = ({k: v.detach().to("cpu", copy=True) for k, v in unwrapped.state_dict().items()}
                              if backend.is_main else {})
        state_dict = drop_tied_aliases(unwrapped, state_dict)
    else:
        state_dict = backend.full_state_dict(model)
    final = Path(output_dir) / name
    tmp = Path(output_dir) / f".tmp-{name}"
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        if dtype is not None:
            check_castable(state_dict, dtype, name)
            state_dict = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in state_dict.items()}
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if dtype is not None:  # save_pretrained names the live model's dtype
            set_config_dtype(tmp / "config.json", dtype)
        tokenizer.save_pretrained(tmp)
        if getattr(unwrapped, "generation_config", None) is not None:
            unwrapped.generation_config.save_pretrained(tmp)
        if adapter is not None:
            save_lora_adapter(tmp / "adapter", *adapter)
        files.replace_dir(tmp, final)
    backend.barrier()
    return final if backend.is_main else None


def check_castable(state_dict: dict, dtype: str, name: str = "final") -> None:
    """train.export_dtype=float16 on weights beyond float16's range (+-65504; bfloat16 has float32's): the cast
    turned them into inf and final/ was written with rc 0. Stops before writing anything, naming the tensor."""
    limit = torch.finfo(getattr(torch, dtype)).max
    for key, value in state_dict.items():
        if value.is_floating_point() and value.numel() and (largest := value.abs().max().item()) > limit:
            raise RunStopped(f"train.export_dtype={dtype}: {key} holds {largest:.4g}, beyond {dtype}'s largest value "
                             f"({limit:.6g}), so {name}/ would hold inf; nothing was written to {name}/. Export in "
                             "bfloat16 or float32 (train.export_dtype)", shared=False)


def set_config_dtype(config_file: Path, dtype: str) -> None:
    """config.json names `dtype` as the weights' dtype (transformers 5's key, and torch_dtype where present), so that
    `dtype=auto` loads (from_pretrained, vLLM) read the weights as written."""
    config = json.loads(config_file.read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
