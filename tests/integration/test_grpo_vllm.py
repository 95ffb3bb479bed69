"""GRPO with the in-process vLLM engine (real vLLM on CPU, fp32): with syncs switched off the log-probs it reports
drift from the trainer's (with them, tests/distributed/test_grpo_vllm_distributed.py); one-step off-policy sampling
over multi-turn trajectories with a tool; batches sampled two steps ahead, carried by a checkpoint so a resumed run
equals its uninterrupted self bit for bit; a mixture-of-experts policy synced into vLLM.

Each run is its own process (one vLLM engine per process; vLLM's in-process engine is not torn down within one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posttrain.generation.vllm_engine import vllm_available
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import assert_same_final_weights, metrics, run_overrides, unclocked_metrics

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")]
HERE = "tests.integration.test_grpo"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=6)


def run_grpo(tiny_vllm_model_dir, data, out, *extra) -> subprocess.CompletedProcess:
    args = run_overrides(tiny_vllm_model_dir, data["prompts_train"], out, "train.max_steps=3",
                         "train.per_device_train_batch_size=8", "generation.max_completion_length=8",
                         "algo.num_generations=4", f"rewards=[{{name: '{HERE}:length_reward'}}]",
                         "generation.engine=vllm", "generation.vllm.kv_cache_gb=1", *extra, learning_rate="1e-2")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "posttrain", "grpo", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_vllm_engine_without_syncs_drifts_from_the_policy(tiny_vllm_model_dir, data, tmp_path):
    """The other half of "synced before every generation" (tests/distributed/test_grpo_vllm_distributed.py: the gap
    stays at float noise with a sync per step): with syncs switched off the engine keeps sampling from step 0."""
    stale = run_grpo(tiny_vllm_model_dir, data, tmp_path / "stale", "generation.sync_every=100")
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert "Traceback" not in stale.stderr, stale.stderr[-3000:]  # vLLM is torn down before the process groups
    rows = metrics(tmp_path / "stale")
    gaps = [r["sampler_logprob_gap"] for r in rows]
    assert gaps[0] < 2e-3 and gaps[2] > 10 * max(gaps[0], 1e-4), gaps  # the engine still samples from step 0
    # the mismatch figures, every step an engine samples (online/mismatch.py): one generation batch per step, so
    # pi_old is the step's own forward and their mean is the loss's gap; they grow with the drift, in the console too
    for r in rows:
        assert r["mismatch/logprob_diff/mean"] == pytest.approx(r["sampler_logprob_gap"], rel=1e-3, abs=1e-6), r
        assert r["mismatch/logprob_diff/p50"] <= r["mismatch/logprob_diff/p99"] <= r["mismatch/logprob_diff/max"]
        assert r["mismatch/is_ratio/p1"] <= r["mismatch/is_ratio/p50"] <= r["mismatch/is_ratio/p99"], r
        assert 0 <= r["mismatch/phantom_clip_fraction"] <= 1 and r["mismatch/k3"] >= 0, r
    assert rows[2]["mismatch/k3"] > 10 * max(rows[0]["mismatch/k3"], 1e-8), rows
    assert "mismatch/k3=" in stale.stdout + stale.stderr


def test_vllm_engine_async_multi_turn_samples_the_next_batch_during_training(tiny_vllm_model_dir, data, tmp_path):
    """generation.async with the in-process engine, over multi-turn trajectories with a tool: the engine samples
    batch N+1 in a thread (its tools forked from it) while batch N trains, from the policy one step older
    (policy_lag 1), and the truncated importance weights are logged. The trainer scores exactly the engine's tokens:
    at step 1 (sampled from the synced policy) its log-probs on the masked tokens match the engine's."""
    tools = "tests.integration.test_agents"
    run = run_grpo(tiny_vllm_model_dir, data, tmp_path / "async", "generation.async=true",
                   "algo.vllm_is_correction=true", "algo.vllm_is_cap=1.5", f"agent.tools=['{tools}:calculator']",
                   f"agent.tool_parser={tools}:every_turn_calls", "agent.max_turns=3", "agent.max_turn_tokens=4",
                   "generation.max_completion_length=64", "data.max_length=512")  # the tools turn: ~350 tokens
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "async")
    assert [r["policy_lag"] for r in rows] == [0, 1, 1]
    gaps = [r["sampler_logprob_gap"] for r in rows]
    assert gaps[0] < 2e-3 and min(gaps[1:]) > 10 * max(gaps[0], 1e-4), gaps
    assert all(r["is_ratio"] > 0 and 0 <= r["is_capped_fraction"] <= 1 for r in rows), rows
    # 8 trajectories a step, 3 turns each, a tool call after each of the first two
    assert all((r["turns/mean"], r["tools/calls"], r["tools/errors"]) == (3, 16, 0) for r in rows), rows


def full_and_resumed(model_dir, data, tmp_path, *common: str) -> tuple:
    """One 4-step run uninterrupted (tmp_path/full) and stopped after step 2 then resumed (tmp_path/split), with the
    correction on and a checkpoint at step 2; both succeed, and the resumed run samples nothing again."""
    common = (*common, "algo.vllm_is_correction=true", "train.max_steps=4", "train.save_steps=2")
    full, split = tmp_path / "full", tmp_path / "split"
    for out, extra in ((full, []), (split, ["train.max_steps_per_run=2"]),
                       (split, ["train.resume_from_checkpoint=auto"])):
        run = run_grpo(model_dir, data, out, *common, *extra)
        assert run.returncode == 0, run.stderr[-3000:]
    assert "sampled again" not in run.stderr, run.stderr[-3000:]
    return full, split


DYNAMIC = ("algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.metric=reward",
           "algo.dynamic_sampling.max_batches=0", "rewards=[{name: 'tests.integration.test_dynamic_sampling:"
           "first_letter_reward'}]")


@pytest.mark.parametrize("dynamic", [(), DYNAMIC], ids=["plain", "dynamic_sampling"])
def test_max_staleness_2_resumes_bit_for_bit(tiny_vllm_model_dir, data, tmp_path, dynamic):
    """generation.max_staleness=2: batches are sampled two steps ahead (policy_lag 0, 1, 2, 2) and importance
    weighted; a run stopped after step 2 carries its two batches in flight in the checkpoint (one file, listed in the
    manifest), and resumed it trains on them: every logged figure but the clocks, and the final weights, equal the
    uninterrupted run's exactly. With DAPO's dynamic sampling too: the draws ahead are the prompt order's next
    generation batches, and the checkpoint says where the order stands."""
    full, split = full_and_resumed(tiny_vllm_model_dir, data, tmp_path, "generation.max_staleness=2", *dynamic)
    saved = json.loads((split / "checkpoints" / "step-2" / "manifest.json").read_text())["files"]
    assert "rollouts_in_flight_0.json" in saved
    in_flight = json.loads((split / "checkpoints" / "step-2" / "rollouts_in_flight_0.json").read_text())["batches"]
    a, b = unclocked_metrics(full), unclocked_metrics(split)
    if not dynamic:
        assert [(b["index"], b["submitted_at"], set(b["sampled_by"])) for b in in_flight] == [(2, 0, {0}), (3, 1, {1})]
        assert [r["policy_lag"] for r in a] == [0, 1, 2, 2] and [r["rollout/policy_lag_max"] for r in a] == [0, 1, 2, 2]
    else:  # some step drew again, so the draws ahead run past the generation batch count
        next_draw = json.loads((split / "checkpoints" / "step-2" / "dynamic_sampling.json").read_text())["next_draw"]
        assert len(in_flight) == 2 and in_flight[0]["index"] == next_draw
        assert sum(r["dynamic_sampling/batches"] for r in a) > 4 and all(r["frac_reward_zero_std"] == 0 for r in a)
        assert max(r["rollout/policy_lag_max"] for r in a) <= 2
    assert b == a
    assert_same_final_weights(full, split)


def test_partial_rollouts_continue_across_syncs_and_resume_bit_for_bit(tiny_vllm_model_dir, data, tmp_path):
    """generation.partial_rollouts with max_staleness=2, chunks of 4 of the 8 tokens, one round per batch: each batch
    ahead gets its first chunk from the policy one step older and the rest after the sync, from its tokens so far (the
    in-process engine, prefix caching on). A run stopped after step 2 carries batch 2 half sampled, and resumed it
    equals the uninterrupted run in every logged figure but the clocks and in the final weights."""
    full, split = full_and_resumed(tiny_vllm_model_dir, data, tmp_path, "generation.max_staleness=2",
                                   "generation.partial_rollouts=true", "generation.partial_chunk_tokens=4",
                                   "generation.partial_chunks_per_batch=1",
                                   "generation.vllm.enable_prefix_caching=true")
    in_flight = json.loads((split / "checkpoints" / "step-2" / "rollouts_in_flight_0.json").read_text())["batches"]
    half = in_flight[0]  # batch 2: its first chunk, by the policy of step 1; batch 3 not started
    assert [(b["index"], b["rounds"]) for b in in_flight] == [(2, 1), (3, 0)]
    assert not any(half["ended"]) and all(v == [1] * 4 for v in half["token_versions"])
    a = unclocked_metrics(full)
    assert unclocked_metrics(split) == a
    assert_same_final_weights(full, split)
    # every completion that ran past its first chunk straddled a sync (fails if the chunks stop continuing)
    assert [r["policy_lag"] for r in a] == [0, 1, 1, 1] and a[0]["partial/stale_completion_fraction"] == 0
    assert all(r["partial/stale_completion_fraction"] > 0.5 and r["partial/versions_per_completion_max"] == 2
               for r in a[1:]), a
    assert sum(r["partial/chunks_on_the_spot"] for r in a) == 3 and all(r["partial/dropped"] == 0 for r in a)
    assert all(0 <= r["generation/prefix_cache_hit_fraction"] <= 1 for r in a)  # the cache on, and counted
    records = [json.loads(line) for line in (full / "samples.jsonl").read_text().splitlines()]
    assert {tuple(r["token_versions"]) for r in records if r["step"] == 3} >= {(1, 1, 1, 1, 2, 2, 2, 2)}


def test_vllm_engine_samples_from_a_synced_moe_policy(tiny_moe_model_dir, data, tmp_path):
    """vLLM's CPU build runs the tiny Qwen3-MoE, and every sync carries its experts and routers: on the first step of
    each generation batch the trainer's log-probs match vLLM's as closely as on step 1 (from the same checkpoint),
    while a step with the policy one update away shows the gap a missed sync would leave. Routing replay (R2) and
    the load-balancing loss run beside it."""
    out = tmp_path / "run"
    result = run_grpo(tiny_moe_model_dir, data, out, "train.max_steps=4", "algo.num_iterations=2",
                      "algo.routing_replay=old_policy", "model.router_aux_loss_coef=0.001")
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {r["step"]: r for r in metrics(out)}
    assert rows[1]["sampler_logprob_gap"] < 0.05 and rows[3]["sampler_logprob_gap"] < 0.05, rows
    assert rows[2]["sampler_logprob_gap"] > 3 * rows[3]["sampler_logprob_gap"], rows
    assert rows[3]["routing_agreement"] == 1.0 and rows[4]["routing_agreement"] < 1.0, rows
