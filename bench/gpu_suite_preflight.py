"""What bench/gpu_suite.py checks before it spends a lent GPU's minutes.

- first_check (`gpu_suite.py --check`, bench/gpu_suite.sh's first line, seconds): the device (torch imports, CUDA is
  there) and every piece of scripts/gpu_wheels.txt installed here or carried as a wheel: what is missing is named at
  once, before the wheels are installed or a row starts.
- preflight (before the rows): every module the rows import, imported in a child process (a broken install cannot
  take the suite with it), and the installed requirements of datasets, trl, deepspeed, transformers, accelerate.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS_FILE = ROOT / "scripts" / "gpu_wheels.txt"
CORE = ("torch", "transformers", "accelerate", "datasets", "safetensors", "yaml", "posttrain")
VERSIONS = ("torch", "transformers", "accelerate", "datasets", "trl", "deepspeed", "peft", "pyarrow", "tokenizers")
FIX = "build the wheels here with scripts/gpu_wheels.sh and carry .whl (docs/performance.md, GPU suite)"
PROBE_TIMEOUT_S = 90


def pins(path: Path = PINS_FILE) -> list[tuple[str, str]]:
    """(name, version) of every carried piece, from scripts/gpu_wheels.txt."""
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return [tuple(x.split("==", 1)) for x in lines]


def _wheel_name(name: str) -> str:
    """A distribution's name as wheel files spell it (PEP 427: runs of - _ . become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_pieces(wheel_dir: Path, wanted: list[tuple[str, str]]) -> list[str]:
    """The pieces neither installed here (any version) nor carried as a wheel in `wheel_dir`, each named with why."""
    from importlib import metadata

    carried = {_wheel_name(w.name.split("-")[0]) for w in wheel_dir.glob("*.whl")} if wheel_dir.is_dir() else set()
    missing = []
    for name, version in wanted:
        if _wheel_name(name) in carried:
            continue
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(f"{name}=={version}: not installed, and no wheel for it in {wheel_dir}/")
    return missing


def first_check(need_cuda: bool, wheel_dir: Path) -> tuple[bool, list[str]]:
    """(ok, lines to print): torch and its CUDA device, and every carried piece. Not ok when a piece is missing or
    CUDA is needed (the GPU shapes, not a dry run) and absent."""
    lines, ok = [], True
    try:
        import torch

        if torch.cuda.is_available():
            lines.append(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda}")
        else:
            lines.append(f"device: no CUDA device (torch {torch.__version__})"
                         + ("; the GPU rows need one: run this on a GPU machine, or --size tiny / --dry-run here"
                            if need_cuda else ""))
            ok = not need_cuda
    except Exception as e:  # noqa: BLE001 - any failing import of torch stops the suite here, named
        lines.append(f"missing torch: {type(e).__name__}: {e} (the machine's image should have it: use its python3)")
        ok = False
    for problem in missing_pieces(wheel_dir, pins()):
        lines.append(f"missing {problem}; {FIX}")
        ok = False
    return ok, lines


# ----------------------------------------------------------------------------------------------------- preflight
def probe(optional: list[str]) -> dict:
    """What is importable here of CORE and `optional` (in this process: run as `gpu_suite.py --probe NAME...` in a
    child of the suite), each distribution's unmet requirements, and the device."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found: dict = {}
    for name in CORE + tuple(optional):
        try:
            module = importlib.import_module(name)
            found[name] = {"ok": True, "version": getattr(module, "__version__", "?")}
        except BaseException as e:  # noqa: BLE001 - a broken install raises anything; say what it was
            found[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    unmet = {}
    for dist in ("datasets", "trl", "deepspeed", "transformers", "accelerate"):
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.setdefault(dist, []).append(f"{text} (installed: {have or 'none'})")
    device: dict = {"cuda": False}
    if found["torch"]["ok"]:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            device = {"cuda": True, "name": torch.cuda.get_device_name(0),
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "bf16": torch.cuda.is_bf16_supported(), "cuda_version": torch.version.cuda}
        else:
            device["name"] = f"CPU ({os.cpu_count()} cores, torch {torch.get_num_threads()} threads)"
    return {"modules": found, "unmet": unmet, "device": device}


def preflight(env: dict, optional: list[str], suite: Path) -> dict:
    """The probe, run in a child (`suite --probe`), with what is missing spelled out."""
    try:
        done = subprocess.run([sys.executable, str(suite), "--probe", *optional], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=PROBE_TIMEOUT_S)
        lines, failure = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")], done.stderr.strip()[-800:]
    except subprocess.TimeoutExpired:
        lines, failure = [], f"its imports took over {PROBE_TIMEOUT_S} s"
    if not lines:
        return {"modules": {}, "unmet": {}, "device": {"cuda": False, "name": "unknown"}, "missing": {},
                "missing_core": [f"the import probe failed: {failure}"]}
    found = json.loads(lines[-1][6:])
    found["missing_core"] = [f"{n}: {found['modules'][n]['error']}" for n in CORE if not found["modules"][n]["ok"]]
    found["missing"] = {n: f"{found['modules'][n]['error']}; {FIX}" for n in optional if not found["modules"][n]["ok"]}
    return found


def skip_reason(needs: tuple[str, ...], found: dict) -> str | None:
    """Why a row with these needs (cuda, bf16, deepspeed) cannot run here, or None."""
    if found["missing_core"]:
        return "posttrain cannot run here: " + "; ".join(found["missing_core"])
    device = found["device"]
    reasons = {"cuda": None if device["cuda"] else f"needs a CUDA device; this machine has none ({device.get('name')})",
               "bf16": None if device.get("bf16", not device["cuda"]) else f"needs bf16; {device.get('name')} has none",
               "deepspeed": (f"needs deepspeed: {found['missing']['deepspeed']}" if "deepspeed" in found["missing"]
                             else None)}
    return next((reasons[need] for need in needs if reasons[need]), None)


def environment(found: dict, commit: str | None) -> dict:
    """Device, versions, code version, commit and date: what the results were measured on."""
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:  # the doctor's code version: git commit, or a hash of the sources when edited or without git
        from posttrain.launch.doctor import _code_version

        code = _code_version()
    except ImportError as e:
        code = f"unknown (posttrain not importable: {e})"
    return {"device": found["device"], "versions": versions, "code": code, "commit": commit or code.split(" ", 1)[-1],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
