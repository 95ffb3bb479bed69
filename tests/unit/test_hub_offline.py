"""A hub model id with HF_HUB_OFFLINE unset and a hub that cannot be reached (here: HF_ENDPOINT on a port nothing
listens on, so the test means the same on a machine with network): refused in seconds naming the model and how to
get it when it is not cached, read from the cache when it is. huggingface_hub alone retried each file 5 times
(1 + 2 + 4 + 8 + 8 s) first: about a minute before the quickstart's Qwen example failed offline."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOAD = """
import json, sys, time
from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError
from posttrain.models.load import load_causal_lm, load_tokenizer
import huggingface_hub, transformers  # noqa: F401 - imported before the clock starts (slow on a busy machine)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
started = time.monotonic()
try:
    load_tokenizer(ModelConfig(name_or_path=sys.argv[1]))
    load_causal_lm(ModelConfig(name_or_path=sys.argv[1]))
    error = None
except UserError as e:
    error = str(e)
import os
print(json.dumps({"seconds": time.monotonic() - started, "error": error, "offline": os.environ.get("HF_HUB_OFFLINE")}))
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections to it are refused


def load(model_id: str, cache: Path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent),
               PYTHONPATH=str(ROOT))
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        env.pop(proxy, None)
    done = subprocess.run([sys.executable, "-c", LOAD, model_id], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_an_uncached_hub_model_is_refused_at_once_saying_how_to_get_it(tmp_path):
    got, _ = load("nobody/no-such-model", tmp_path / "hub")
    assert got["error"] and "model.name_or_path: nobody/no-such-model is not in the Hugging Face cache" in got["error"]
    assert "the hub cannot be reached" in got["error"] and "hf download nobody/no-such-model" in got["error"]
    assert got["seconds"] < 10, got  # the probe is bounded at 5 s; huggingface_hub's retries sleep 23 s per file


def test_a_cached_hub_model_is_read_from_the_cache_at_once(tmp_path, tiny_model_dir):
    """The Hugging Face cache's own layout (models--org--name/refs/main -> snapshots/<commit>/)."""
    repo = tmp_path / "hub" / "models--posttrain--tiny"
    commit = "0" * 40
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    got, stderr = load("posttrain/tiny", tmp_path / "hub")
    assert got["error"] is None and got["offline"] == "1", (got, stderr[-2000:])
    assert "the hub cannot be reached" in stderr and "posttrain/tiny is read from the Hugging Face cache" in stderr
    assert got["seconds"] < 10, got
