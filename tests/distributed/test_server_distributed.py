"""GRPO under ZeRO-3 on 2 CPU processes with the server engine (the test session's one `posttrain serve` server):
both ranks gather every bucket of the partitioned policy, rank 0 alone sends it, both wait until it has landed, and
after the run the server holds exactly final/."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.generation.vllm_engine import vllm_available
from posttrain.demo.tasks import write_example_data
from tests.distributed.launch import launch
from tests.integration.helpers import run_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")]
REWARD = "tests.integration.test_grpo:length_reward"


def test_zero3_two_processes_sync_the_server_to_final(vllm_server, tmp_path):
    from posttrain.generation.server import call
    from posttrain.generation.server_worker import tensor_digest

    data = write_example_data(tmp_path / "data", n_train=32, n_eval=4)
    out = tmp_path / "run"
    result = launch(2, "grpo", run_overrides(
        vllm_server.model_dir, data["prompts_train"], out, "train.max_steps=3", "train.per_device_train_batch_size=4",
        "generation.max_completion_length=8", "algo.num_generations=4", f"rewards=[{{name: '{REWARD}'}}]",
        "generation.engine=server", f"generation.servers=[{vllm_server.url}]", "generation.sync_bucket_mb=1",
        learning_rate="1e-2"), accelerate_config="zero3", timeout=600)
    assert result.ok, result.output[-6000:]
    result.check_world(2)
    assert result.facts["engine"] == "deepspeed-zero3"
    rows = result.metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sampler_logprob_gap"] < 2e-3 for r in rows), [r["sampler_logprob_gap"] for r in rows]
    final = load_file(str(out / "final" / "model.safetensors"))
    held = call(vllm_server.url, "/collective_rpc", {"method": "posttrain_digests"})["results"][0]
    assert held == {name: tensor_digest(t) for name, t in final.items()}
    start = load_file(str(Path(vllm_server.model_dir) / "model.safetensors"))
    assert any(tensor_digest(start[name]) != held[name] for name in start)
