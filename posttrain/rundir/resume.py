"""What a resume needs to know about the engine a checkpoint was written by (the rest of checkpoint.py does not).

    path = engine_resume_path(backend, path, saved_run_facts, now_run_facts, output_dir)   # before models are built
    ...  backend.load_state(path) ...
    drop_converted(backend, path)                                                           # after the load

One process, DDP and FSDP2 checkpoints load into any process count. DeepSpeed shards per rank, so one resumed on
another process count is first converted to its universal format under output_dir/.universal/step-N (rank 0
converts), read once and removed. The engine itself must stay the same.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from posttrain.errors import UserError

UNIVERSAL_DIR = ".universal"  # converted DeepSpeed checkpoints, read once on resume and removed
DEEPSPEED_TAG = "pytorch_model"  # the tag Accelerate saves the DeepSpeed engine under


def needs_conversion(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Stop unless this launch's engine can continue the checkpoint at `path`; True when it must first be converted
    to DeepSpeed's universal format. `saved`, `now`: the run facts (engine, world_size) of both launches."""
    sharded = any(str(e).startswith(("deepspeed", "fsdp")) for e in (saved.get("engine", ""), now["engine"]))
    if sharded and saved.get("engine") != now["engine"]:
        raise UserError(f"{path} holds {saved.get('engine')} state sharded over {saved.get('world_size')} processes; "
                        f"this run is {now['engine']} on {now['world_size']}. Resume with the same launcher config "
                        "(any process count), or start a new run from a model exported with the old launch (final/)")
    return str(now["engine"]).startswith("deepspeed") and saved.get("world_size") != now["world_size"]


def engine_resume_path(backend, path: Path, saved: dict[str, Any], now: dict[str, Any], output_dir) -> Path:
    """The checkpoint directory this launch loads: `path`, or its universal-format copy (the engine is told to read
    that format before it is built)."""
    if not needs_conversion(path, saved, now):
        return path
    target = Path(output_dir) / UNIVERSAL_DIR / path.name
    if backend.is_main:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for state in path.glob("*.json"):  # trainer_state.json, the batches in flight; the manifest lists `path`
            if state.name != "manifest.json":
                shutil.copy2(state, target / state.name)
        backend.convert_to_universal(path / DEEPSPEED_TAG, target / DEEPSPEED_TAG)
    backend.barrier()
    backend.load_universal()
    return target


def drop_converted(backend, path: Path) -> None:
    """After the load: a converted copy is no longer needed."""
    if path.parent.name == UNIVERSAL_DIR:
        backend.barrier()
        if backend.is_main:
            shutil.rmtree(path.parent, ignore_errors=True)
