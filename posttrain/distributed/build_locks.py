"""Torch JIT build locks a killed process left behind, which would make every later start wait forever.

DeepSpeed builds (or checks) its CPU ops under TORCH_EXTENSIONS_DIR at every start; the Backend clears stale locks
before DeepSpeed loads on a CPU.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

from torch.utils.cpp_extension import get_default_build_root

STALE_BUILD_LOCK_SECONDS = 600  # DeepSpeed's CPU op builds take ~40-70 s; nothing in a live build sits still this long


def clear_stale_build_locks(root: Optional[str] = None, now: Optional[float] = None) -> list[Path]:
    """Remove `<op>/lock` files older, with every file of their op directory, than STALE_BUILD_LOCK_SECONDS (a live
    build keeps writing there). Returns the removed paths (each said on stderr)."""
    root = build_root(root)
    now = time.time() if now is None else now
    removed = []
    for lock in Path(root).glob("**/lock"):
        try:
            newest = max(f.stat().st_mtime for f in lock.parent.iterdir())
            if now - newest < STALE_BUILD_LOCK_SECONDS:
                continue
            lock.unlink()
        except FileNotFoundError:  # another rank removed it, or the build finished meanwhile
            continue
        removed.append(lock)
        print(f"posttrain: warning: removed {lock}, a build lock untouched for {(now - newest) / 60:.0f} min (left by "
              "a process killed while building or checking DeepSpeed's ops; torch would wait on it forever)",
              file=sys.stderr, flush=True)
    return removed


def build_root(root: Optional[str] = None) -> str:
    """Where torch JIT-builds extensions (DeepSpeed's CPU ops among them)."""
    return root if root is not None else os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def announce_cpu_op_builds(offload: bool, root: Optional[str] = None) -> list[str]:
    """One line (from each node's first process) before DeepSpeed spends minutes silently compiling the CPU ops this
    run loads and that are not built yet. Returns those ops."""
    root = build_root(root)
    ops = ("deepspeed_shm_comm",) + (("cpu_adam",) if offload else ())
    unbuilt = [op for op in ops if not any(Path(root).glob(f"**/{op}/{op}*.so"))]
    if unbuilt and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"posttrain: DeepSpeed compiles its CPU ops on first use ({', '.join(unbuilt)} not built yet under "
              f"{root}): this start can take a few minutes, once per machine; later runs reuse them",
              file=sys.stderr, flush=True)
    return unbuilt
