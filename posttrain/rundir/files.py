"""Checkpoint files that survive crashes and damage: a manifest (sizes, SHA-256), fsync before rename, verification.

    write_manifest(tmp)               # after every file of the checkpoint is written (rank 0)
    replace_dir(tmp, final)           # fsync, rename (an older `final` goes only once the new one is in place), fsync
    problem = verify(path)            # None, or what is wrong ("pytorch_model.bin: 812 bytes, 4096 expected")
    raise disk_full_error(e, tmp, previous)   # ENOSPC while saving: one clear message, the partial copy removed

A rename is atomic, but without fsync the renamed directory may hold files whose data never reached the disk (a
power cut or a VM kill after the rename). The manifest lets `resume_from_checkpoint: auto` tell a complete
checkpoint from one damaged afterwards (truncated, or a file lost) and fall back to the previous one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from posttrain.errors import RunStopped, UserError, warn

MANIFEST = "manifest.json"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(root: Path) -> None:
    listed = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in listed}
    (root / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify(root: Path) -> Optional[str]:
    """None when the manifest is well formed, names only files inside the checkpoint, and every file it lists is
    there with its size and checksum; else what is wrong. A checkpoint without a manifest cannot be verified: that
    is a problem too (`train.resume_strict=false` accepts one written before manifests existed)."""
    path = root / MANIFEST
    if not path.is_file():
        return f"it has no {MANIFEST} (every checkpoint posttrain writes has one)"
    try:
        files = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    problem = _manifest_shape(files)
    if problem:
        return f"{MANIFEST} is malformed ({problem})"
    inside = root.resolve()
    for name in files["files"]:  # every name first: nothing outside the checkpoint is read, not even its size
        if Path(name).is_absolute() or ".." in Path(name).parts or not (root / name).resolve().is_relative_to(inside):
            return f"{MANIFEST} names {name!r}, outside the checkpoint"
    for name, want in files["files"].items():
        p = root / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{name} holds {size} bytes, {want['size']} expected"
        if _sha256(p) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _manifest_shape(manifest) -> Optional[str]:
    """What is wrong with the manifest's structure: {"files": {relative path: {"size": int, "sha256": hex}}}."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"expected {{\"files\": {{path: {{size, sha256}}}}}}, got {type(manifest).__name__}"
    if not manifest["files"]:
        return "it lists no file"
    if "trainer_state.json" not in manifest["files"]:
        return "it does not list trainer_state.json"
    for name, want in manifest["files"].items():
        if not (isinstance(want, dict) and type(want.get("size")) is int and isinstance(want.get("sha256"), str)):
            return f"the entry for {name!r} is not {{size: int, sha256: str}}"
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file's data and every directory entry under `root` on disk."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(root)


def tree_bytes(root: Optional[Path]) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root is not None and root.is_dir() else 0


def is_disk_full(error: BaseException, directory: Path) -> bool:
    """ENOSPC / EDQUOT / EFBIG anywhere in the chain, or (torch.save reports a full disk as "iostream error", with no
    errno) a disk under `directory` with less than 1 MiB left."""
    try:
        if shutil.disk_usage(directory).free < 2**20:
            return True
    except OSError:
        pass
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return True
        if any(text in str(error) for text in ("No space left", "Disk quota exceeded", "File too large",
                                               "file write failed")):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def disk_full_error(error: OSError, partial: Path, previous: Optional[Path]) -> RunStopped:
    """Remove the partial checkpoint and say what happened, where, and how much room a checkpoint takes."""
    shutil.rmtree(partial, ignore_errors=True)
    free = shutil.disk_usage(partial.parent).free if partial.parent.exists() else 0
    need = tree_bytes(previous)
    size = f"a checkpoint takes about {need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free" if need else (
        f"{free / 2**20:.1f} MiB are free")
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return RunStopped(f"no space left while writing the checkpoint {partial}: {size}; "
                      f"the partial copy was removed and {kept}. Free space (or lower train.save_total_limit) and "
                      "continue with train.resume_from_checkpoint=auto", shared=False)


def warn_low_disk(output_dir: Path, checkpoint_bytes: int) -> None:
    """At start-up: say so when the disk under output_dir cannot hold one more checkpoint of this run."""
    where = next(p for p in (output_dir, *output_dir.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < checkpoint_bytes:
        warn(f"{where} has {free / 2**20:.1f} MiB free but a checkpoint of this run takes about "
             f"{checkpoint_bytes / 2**20:.1f} MiB: saving will fail. Free space or choose another output_dir")


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the complete directory `tmp` at `final` (a checkpoint, final/), durably: its data is on disk before the
    rename makes it visible, and the rename after. An older `final` of this run is renamed aside first and removed
    only once `tmp` is in place; a link is never followed."""
    if final.is_symlink():
        raise UserError(f"{final} is a symbolic link (to {os.readlink(final)}); posttrain does not write through "
                        "links: remove it and resume with train.resume_from_checkpoint=auto")
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)
