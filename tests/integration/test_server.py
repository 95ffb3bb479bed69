"""GRPO with `generation.placement: servers`: the test session's one `posttrain serve` server (real vLLM on CPU, fp32,
tests/conftest.py::vllm_server). The token guards every control endpoint; a 3-step run from the shipped recipe
leaves the server holding exactly final/; LoRA synced as merged weights and as the adapter alone (the server then
samples what final/ does; a corrupted adapter stops the run); a server that dies mid-run stops the run with its name; bad
`generation.servers` entries exit 2 before any model is loaded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.generation.vllm_engine import vllm_available
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import assert_same_final_weights, metrics, run_cli, run_overrides, unclocked_metrics

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")]
ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "grpo_server.yaml")
REWARD = "rewards=[{name: 'tests.integration.test_grpo:length_reward'}]"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=6)


def overrides(server_url, model_dir, data, out, *extra) -> list[str]:
    return run_overrides(model_dir, data["prompts_train"], out, "data.eval=null", "train.max_steps=3",
                         "train.per_device_train_batch_size=8", "generation.max_completion_length=8",
                         "algo.num_generations=4", REWARD, f"generation.servers=[{server_url}]", *extra,
                         learning_rate="1e-2")


def start_grpo(args, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "posttrain", "grpo", "--config", RECIPE, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, **kwargs)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_endpoint_but_health_needs_the_token(vllm_server):
    from posttrain.generation.server import ServerUnavailable, call

    assert call(vllm_server.url, "/health", token="") is None
    for token in ("", "wrong-token"):
        for path, body in (("/v1/models", None), ("/collective_rpc", {"method": "posttrain_describe"}),
                           ("/update_weight_version", {"new_version": "x"}), ("/inference/v1/generate", {})):
            with pytest.raises(ServerUnavailable) as refused:
                call(vllm_server.url, path, body, token=token)
            assert refused.value.status == 401, (path, str(refused.value))
    assert call(vllm_server.url, "/collective_rpc", {"method": "posttrain_describe"})["results"][0]["vocab_size"] > 0


def test_grpo_leaves_the_server_holding_final(vllm_server, data, tmp_path):
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.hf import HFEngine
    from posttrain.generation.server import call
    from posttrain.generation.server_worker import tensor_digest

    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, tmp_path / "run"))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sampler_logprob_gap"] < 2e-3 for r in rows), [r["sampler_logprob_gap"] for r in rows]
    assert all(r["time/sync"] > 0 for r in rows) and all(r["policy_lag"] == 0 for r in rows)

    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    start = load_file(str(Path(vllm_server.model_dir) / "model.safetensors"))
    held = call(vllm_server.url, "/collective_rpc", {"method": "posttrain_digests"})["results"][0]
    assert held == {name: tensor_digest(t) for name, t in final.items()}  # every tensor, bit for bit
    assert any(tensor_digest(start[name]) != held[name] for name in start)  # and training did change them
    assert call(vllm_server.url, "/weight_info")["weight_version"] == "3"

    # the server samples from final/: its greedy completions are HF's on final/, token for token
    from posttrain.config.schema import GenerationConfig
    from posttrain.generation.server import ServerEngine

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "Hello there", "Count: 1 2 3")]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    engine = ServerEngine(GenerationConfig(engine="vllm", placement="servers", servers=(vllm_server.url,)), tokenizer, False)
    hf = HFEngine(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32), tokenizer)
    assert engine.generate(prompts, params).completion_ids == hf.generate(prompts, params).completion_ids


def test_lora_grpo_syncs_the_folded_adapters(vllm_server, data, tmp_path):
    """With LoRA the servers get W + scaling * B @ A (adapters never sent): the sampler's log-probs stay the
    trainer's at every step, and at the end the server samples what the merged final/ does."""
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.hf import HFEngine
    from posttrain.generation.server import call
    from posttrain.generation.server_worker import tensor_digest

    out = tmp_path / "run"
    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, out, "model.lora.enabled=true",
                               "model.lora.r=4", "model.lora.alpha=8"))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    rows = metrics(out)
    assert all(r["sampler_logprob_gap"] < 2e-3 for r in rows), [r["sampler_logprob_gap"] for r in rows]
    held = call(vllm_server.url, "/collective_rpc", {"method": "posttrain_digests"})["results"][0]
    start = load_file(str(Path(vllm_server.model_dir) / "model.safetensors"))
    changed = {name for name in start if tensor_digest(start[name]) != held[name]}
    assert changed and all(name.endswith("proj.weight") for name in changed), changed  # adapted layers only

    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "Hello there", "Count: 1 2 3")]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    from posttrain.config.schema import GenerationConfig
    from posttrain.generation.server import ServerEngine

    engine = ServerEngine(GenerationConfig(engine="vllm", placement="servers", servers=(vllm_server.url,)), tokenizer, False)
    hf = HFEngine(AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32), tokenizer)
    assert engine.generate(prompts, params).completion_ids == hf.generate(prompts, params).completion_ids


LORA_ADAPTER = ("model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "generation.lora_sync=adapter",
                "generation.lora_check_atol=0.01")


def restore_starting_weights(vllm_server, tokenizer):
    """The session server's base weights back to the tiny model's (earlier tests synced trained ones into it): an
    adapter is served on top of the base the policy started from."""
    from posttrain.config.schema import GenerationConfig
    from posttrain.generation.server import ServerEngine

    engine = ServerEngine(GenerationConfig(engine="vllm", placement="servers", servers=(vllm_server.url,)), tokenizer,
                          sends_weights=True)
    engine.load_weights([list(load_file(str(Path(vllm_server.model_dir) / "model.safetensors")).items())])
    engine.close()


def test_lora_adapter_sync_serves_final_and_a_broken_delivery_stops_the_run(vllm_lora_server, data, tmp_path, capsys,
                                                                             monkeypatch):
    """generation.lora_sync=adapter: only the adapter travels, and the server then samples what the merged final/
    does (greedy, token for token); an adapter corrupted on its way is caught by the probe after the sync: exit 1
    naming the server and the version."""
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.hf import HFEngine
    from posttrain.generation.server import call

    tokenizer = AutoTokenizer.from_pretrained(vllm_lora_server.model_dir)
    restore_starting_weights(vllm_lora_server, tokenizer)

    def adapters() -> set[str]:
        return {m["id"] for m in call(vllm_lora_server.url, "/v1/models")["data"] if m["id"].startswith("posttrain-")}

    before = adapters()
    out = tmp_path / "run"
    run = start_grpo(overrides(vllm_lora_server.url, vllm_lora_server.model_dir, data, out, *LORA_ADAPTER))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    rows = metrics(out)
    assert all(r["sampler_logprob_gap"] < 2e-3 for r in rows), [r["sampler_logprob_gap"] for r in rows]
    served = adapters() - before
    assert len(served) == 4, served  # a new name per sync: before each of the 3 steps, and the final policy
    final_adapter = max(served, key=lambda name: int(name.rsplit("-", 1)[1]))

    prompts = [tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "Hello there", "Count: 1 2 3")]
    bodies = [{"model": final_adapter, "token_ids": ids, "sampling_params": {
        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [tokenizer.eos_token_id],
        "detokenize": False}} for ids in prompts]
    greedy = [call(vllm_lora_server.url, "/inference/v1/generate", body)["choices"][0]["token_ids"] for body in bodies]
    hf = HFEngine(AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32), tokenizer)
    assert greedy == hf.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0)).completion_ids

    # the same run with one adapter tensor corrupted on its way to the server (after the trainer sent its bytes)
    import posttrain.generation.weight_transfer as transfer

    sending = transfer.send_weights

    def corrupted(group, buckets):  # the first v_proj's B gets 1.0 added: one tensor wrong
        def altered():
            first = True
            for bucket in buckets:
                out = []
                for name, tensor in bucket:
                    if first and "v_proj.lora_B." in name:
                        tensor, first = tensor + 1.0, False
                    out.append((name, tensor))
                yield out

        return sending(group, altered())

    monkeypatch.setattr(transfer, "send_weights", corrupted)
    capsys.readouterr()
    code = run_cli("grpo", *overrides(vllm_lora_server.url, vllm_lora_server.model_dir, data, tmp_path / "broken",
                                      *LORA_ADAPTER), config=RECIPE)
    message = capsys.readouterr().err
    assert code == 1, message[-3000:]
    assert f"generation server {vllm_lora_server.url}" in message and "policy version 0" in message, message[-3000:]


def test_async_grpo_samples_one_step_behind_and_the_server_ends_on_final(vllm_server, data, tmp_path):
    """generation.max_staleness=1 (generation.async): step N+1's batch is sampled while step N trains, from the
    policy one step older; the truncated importance weights are logged; held-out evaluation and the end of the run
    still see the current policy."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.online.evaluation import greedy_texts
    from posttrain.config import load_recipe
    from posttrain.data.io import load_rows
    from posttrain.data.tokenize import tokenize_prompts
    from posttrain.rewards import as_completions, load_rewards
    from posttrain.generation.hf import HFEngine
    from posttrain.generation.server import call
    from posttrain.generation.server_worker import tensor_digest

    out = tmp_path / "run"
    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, out, "generation.max_staleness=1",
                               "algo.vllm_is_correction=true", f"data.eval={data['prompts_eval']}",
                               "train.eval_steps=3"))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    rows = metrics(out)
    train_rows = [r for r in rows if "policy_lag" in r]
    assert [r["policy_lag"] for r in train_rows] == [0, 1, 1]  # the first batch is sampled on-policy
    gaps = [r["sampler_logprob_gap"] for r in train_rows]
    assert gaps[0] < 2e-3 and min(gaps[1:]) > 10 * max(gaps[0], 1e-4), gaps  # later batches: the older policy
    assert abs(train_rows[0]["is_ratio"] - 1) < 1e-2 and all(0 <= r["is_capped_fraction"] <= 1 for r in train_rows)

    final = load_file(str(out / "final" / "model.safetensors"))
    held = call(vllm_server.url, "/collective_rpc", {"method": "posttrain_digests"})["results"][0]
    assert held == {name: tensor_digest(t) for name, t in final.items()}  # the batch sampled ahead did not stay

    # the last evaluation ran on final/'s weights: HF on final/ gives the same figures
    evaluated = [r for r in rows if "eval/reward" in r and r["step"] == 3]
    assert evaluated, rows
    recipe = load_recipe(str(out / "config.yaml"), [], ALGORITHMS["grpo"][0])
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    examples, _ = tokenize_prompts(load_rows(data["prompts_eval"]), tokenizer, recipe.data)
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    texts, ids = greedy_texts(HFEngine(model, tokenizer), tokenizer, examples, recipe.generation.max_completion_length)
    columns = {k: [e["columns"][k] for e in examples] for k in examples[0]["columns"]}
    prompts = [e["prompt"] for e in examples]
    total_B = load_rewards(recipe.rewards).score(prompts, as_completions(prompts, texts), columns, ids).total_B
    expected = {"eval/reward": float(total_B.double().mean()),
                "eval/completion_length": sum(map(len, ids)) / len(ids)}
    for key in ("eval/reward", "eval/completion_length"):
        assert evaluated[0][key] == pytest.approx(expected[key], abs=1e-6), (key, evaluated[0], expected)


def test_partial_rollouts_on_a_server_continue_across_syncs_and_a_sigterm_resumes_them(vllm_server, data, tmp_path):
    """generation.partial_rollouts on the server, chunks of 4 of the 8 tokens, one round per batch: every batch ahead
    gets its first chunk from the policy one step older and the rest, from its tokens so far, after the sync. A run
    stopped by SIGTERM saves its checkpoint with a batch half sampled, and resumed it ends as the uninterrupted run
    did: the same logged figures but the clocks, the same final weights; so does one killed with SIGKILL once a
    checkpoint with a batch half sampled is complete."""
    args = ("train.max_steps=4", "train.save_steps=1", "generation.max_staleness=2", "generation.partial_rollouts=true",
            "generation.partial_chunk_tokens=4", "generation.partial_chunks_per_batch=1",
            "algo.vllm_is_correction=true")
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, full, *args))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    rows = metrics(full)
    assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1] and rows[0]["partial/stale_completion_fraction"] == 0
    assert all(r["partial/stale_completion_fraction"] > 0.5 for r in rows[1:]), rows  # fails if chunks stop continuing
    records = [json.loads(line) for line in (full / "samples.jsonl").read_text().splitlines()]
    assert {tuple(r["token_versions"]) for r in records if r["step"] == 4} >= {(2, 2, 2, 2, 3, 3, 3, 3)}

    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, stopped, *args))
    deadline = time.monotonic() + 300
    while not (stopped / "metrics.jsonl").exists() or len(metrics(stopped)) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 143 and "SIGTERM at step" in stderr, stderr[-3000:]
    saved = sorted((stopped / "checkpoints").glob("step-*"))[-1]
    half = json.loads((saved / "rollouts_in_flight_0.json").read_text())["batches"][0]
    assert half["rounds"] == 1 and not all(half["ended"]), half  # its first chunk only, in the checkpoint
    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, stopped, *args,
                               "train.resume_from_checkpoint=auto"))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert unclocked_metrics(stopped) == unclocked_metrics(full)
    assert_same_final_weights(full, stopped)

    # kill -9 once the step-2 checkpoint (a batch half sampled in it) is complete: resumed, the same run again
    killed = tmp_path / "killed"
    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, killed, *args), start_new_session=True)
    deadline = time.monotonic() + 300
    while not (killed / "checkpoints" / "step-2" / "manifest.json").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.communicate(timeout=60)
    assert run.returncode == -signal.SIGKILL
    saved = sorted((killed / "checkpoints").glob("step-*/manifest.json"))[-1].parent
    half = json.loads((saved / "rollouts_in_flight_0.json").read_text())["batches"][0]
    assert half["rounds"] == 1 and not all(half["ended"]), half
    run = start_grpo(overrides(vllm_server.url, vllm_server.model_dir, data, killed, *args,
                               "train.resume_from_checkpoint=auto"))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert unclocked_metrics(killed) == unclocked_metrics(full)
    assert_same_final_weights(full, killed)


def test_a_server_dying_mid_run_stops_the_run_naming_it(vllm_server, data, tmp_path):
    """The run talks to the server through a forwarder; killing the forwarder (SIGKILL) after step 1 is the server
    dying for the trainer: the run must stop with exit 1 and the server's URL within its timeouts, never hang."""
    host, port = vllm_server.url.rsplit("//", 1)[1].split(":")
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "tests.integration.proxy", str(proxy_port), host, port],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proxy.stdout.readline().strip() == "listening"
        url = f"http://127.0.0.1:{proxy_port}"
        # sync_timeout_s too: a kill that lands inside a weight sync leaves the trainer's gloo broadcast waiting for
        # workers that never got /update_weights, until the sync's deadline (the recipe's is 600 s)
        run = start_grpo(overrides(url, vllm_server.model_dir, data, tmp_path / "run", "train.max_steps=500",
                                   "generation.request_timeout_s=20", "generation.request_retries=1",
                                   "generation.sync_timeout_s=20"))
        deadline = time.monotonic() + 300
        while not (tmp_path / "run" / "metrics.jsonl").exists() or not metrics(tmp_path / "run"):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.5)
        os.killpg(proxy.pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = run.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGKILL)
        proxy.wait()
    assert run.returncode == 1, stderr[-3000:]
    assert f"generation server {url} failed" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert took < 2 * 20 + 15, took  # (retries + 1) x request_timeout_s, + backoff


def test_an_update_a_dead_trainer_left_open_is_ended_by_the_next_trainer(vllm_server):
    """A trainer killed between /start_weight_update and /finish_weight_update (the test above can do it) leaves the
    server inside the update, and vLLM refuses every later start: the next trainer ends it, then syncs whole."""
    from posttrain.config.schema import GenerationConfig
    from posttrain.distributed.weight_sync import sync_units
    from posttrain.generation.http import ServerUnavailable
    from posttrain.generation.server import ServerEngine, call
    from posttrain.generation.server_worker import tensor_digest

    try:
        call(vllm_server.url, "/start_weight_update", {})  # what the dead trainer did last
    except ServerUnavailable as e:  # the test above may already have left one open
        assert "already active" in str(e), e
    with pytest.raises(ServerUnavailable, match="already active"):
        call(vllm_server.url, "/start_weight_update", {})
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    engine = ServerEngine(GenerationConfig(engine="vllm", placement="servers", servers=(vllm_server.url,),
                                           sync_timeout_s=120), AutoTokenizer.from_pretrained(vllm_server.model_dir),
                          sends_weights=True)
    pairs = [(u.name, u.compute([p.data for p in u.params])) for u in sync_units(model)]
    engine.load_weights([pairs])
    held = call(vllm_server.url, "/collective_rpc", {"method": "posttrain_digests"})["results"][0]
    assert held == {name: tensor_digest(t) for name, t in pairs}


@pytest.fixture
def other_vocabulary_model(vllm_server, tmp_path):
    """The server's model with 100 more rows in its (tied) embedding: a real model directory of another vocabulary."""
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 100)
    model.save_pretrained(tmp_path / "other")
    AutoTokenizer.from_pretrained(vllm_server.model_dir).save_pretrained(tmp_path / "other")
    return tmp_path / "other"


@pytest.mark.parametrize("case", ["unreachable", "wrong token", "other vocabulary"])
def test_bad_servers_exit_2_before_any_model_is_loaded(case, vllm_server, data, tmp_path, monkeypatch, capsys,
                                                       request):
    url, model_dir, expected = vllm_server.url, vllm_server.model_dir, ""
    if case == "unreachable":
        url, expected = f"http://127.0.0.1:{free_port()}", "generation.servers[0] = http://127.0.0.1:"
    elif case == "wrong token":
        monkeypatch.setenv("POSTTRAIN_SERVER_TOKEN", "not-the-token")
        expected = "refused the token in POSTTRAIN_SERVER_TOKEN"
    else:
        model_dir, expected = request.getfixturevalue("other_vocabulary_model"), "serves a model with a vocabulary"
    out = tmp_path / "run"
    assert run_cli("grpo", *overrides(url, model_dir, data, out), config=RECIPE) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("posttrain:")]
    assert len(said) == 1 and said[0].startswith("posttrain: error: ") and expected in said[0], err
    assert not (out / "config.yaml").exists()  # stopped before the run began: nothing written, no model loaded


@pytest.fixture(scope="module")
def stock_server(tiny_vllm_model_dir, tmp_path_factory):
    """A stock vLLM api_server (no posttrain serve, no worker extension, no middleware): only the weight-transfer
    backend that posttrain's plugin entry point registers in every vLLM process, and vLLM's own --api-key."""
    from posttrain.generation.http import ServerUnavailable, call

    port, token = free_port(), "stock-token"
    log = tmp_path_factory.mktemp("stock") / "api_server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_vllm_model_dir),
               "--port", str(port), "--api-key", token, "--weight-transfer-config", '{"backend": "gloo-posttrain"}',
               "--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
               "--max-model-len", "1024", "--enforce-eager", "--no-enable-prefix-caching",
               "--no-enable-chunked-prefill"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                call(url, "/health", timeout=2.0, token="")
                break
            except ServerUnavailable:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
                time.sleep(1.0)
        yield types.SimpleNamespace(url=url, token=token, log=log)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def test_a_stock_vllm_server_takes_syncs_and_serves_the_synced_policy(stock_server, tiny_vllm_model_dir,
                                                                     monkeypatch):
    """The start-up checks pass on a plain api_server, and the trainer's four phases (init, start, update, finish)
    sync into it: after a sync of perturbed weights its greedy completions are HF's on those weights, token for
    token, and it holds the version set."""
    from posttrain.config.schema import GenerationConfig, Recipe
    from posttrain.generation.server import check_servers
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.hf import HFEngine
    from posttrain.generation.http import call
    from posttrain.generation.server import ServerEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_vllm_model_dir)
    monkeypatch.setenv("POSTTRAIN_SERVER_TOKEN", stock_server.token)
    check_servers(Recipe(model=Recipe().model.__class__(name_or_path=str(tiny_vllm_model_dir)),
                         data=Recipe().data.__class__(train="x.jsonl"),
                         generation=GenerationConfig(engine="vllm", placement="servers", servers=(stock_server.url,))), tokenizer)
    from posttrain.config import LoraConfig
    from posttrain.errors import UserError

    with pytest.raises(UserError, match="does not load LoRA adapters at run time.*--enable-lora --max-lora-rank 8"):
        check_servers(Recipe(model=Recipe().model.__class__(name_or_path=str(tiny_vllm_model_dir),
                                                            lora=LoraConfig(enabled=True, r=4)),
                             data=Recipe().data.__class__(train="x.jsonl"),
                             generation=GenerationConfig(engine="vllm", placement="servers", lora_sync="adapter",
                                                         servers=(stock_server.url,))), tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=generator))
    config = GenerationConfig(engine="vllm", placement="servers", servers=(stock_server.url,), sync_bucket_mb=1)
    engine = ServerEngine(config, tokenizer, sends_weights=True, token=stock_server.token)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "Hello there", "Count: 1 2 3")]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    before = engine.generate(prompts, params).completion_ids
    engine.load_weights([[(name, param.detach()) for name, param in model.named_parameters()]])
    engine.set_version(7)
    after = engine.generate(prompts, params).completion_ids
    engine.close()
    expected = HFEngine(model, tokenizer).generate(prompts, params).completion_ids
    assert after == expected and before != expected
    assert call(stock_server.url, "/weight_info", token=stock_server.token)["weight_version"] == "7"
