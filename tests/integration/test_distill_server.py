"""posttrain distill with the teacher behind the test session's `posttrain serve` vLLM server (tests/conftest.py::
vllm_server; real vLLM on CPU): the loss over the teacher's top-k log-probs (prompt_logprobs) trains every parameter
of the student, on the data and on its own samples; a server that refuses the token is exit 2 naming
algo.teacher_server before any model loads. The session server's weights may have been synced by other tests (GRPO
with generation.placement=servers): any weights of the tiny vocabulary make a valid teacher here."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from posttrain.generation.vllm_engine import vllm_available
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import final_weights, metrics, run_cli, run_overrides

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=16, n_eval=4)


def test_top_k_from_the_server_trains_the_student(tiny_model_dir, vllm_server, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("distill", *run_overrides(
        tiny_model_dir, data["sft_train"], out, f"algo.teacher_server={vllm_server.url}", "algo.teacher_top_k=5",
        "algo.lmbda=0.5", "algo.beta=0.5", "train.max_steps=3", "train.per_device_train_batch_size=4",
        "generation.max_completion_length=6")) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and {r["on_policy"] for r in rows} == {0.0, 1.0}
    for r in rows:
        assert r["loss"] > 0 and torch.isfinite(torch.tensor(r["loss"])) and 0 <= r["top1_agreement"] <= 1, r
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    assert not [k for k in initial if torch.equal(initial[k], trained[k])]


def test_a_refused_token_is_exit_2_naming_the_teacher_server(tiny_model_dir, vllm_server, data, tmp_path, capsys,
                                                             monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SERVER_TOKEN", "not-the-token")
    out = tmp_path / "run"
    assert run_cli("distill", *run_overrides(tiny_model_dir, data["sft_train"], out,
                                             f"algo.teacher_server={vllm_server.url}", "train.max_steps=1")) == 2
    assert "algo.teacher_server" in capsys.readouterr().err and not out.exists()
