"""Environments and tasks users already have, end to end on the tiny model (docs/environments.md): a reasoning-gym
task with its own scorer and the math-verify rewards; verifiers environments (single-turn, multi-turn with a
tool); a local OpenEnv server. One short GRPO run each; the logic is tested in tests/unit/test_reasoning_gym.py,
test_math_answers.py, test_verifiers_env.py and test_openenv_env.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.integration.helpers import metrics, run_cli, run_overrides

pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")

TASK = "reasoning_gym:basic_arithmetic*2,chain_sum?size=16&seed=5&basic_arithmetic.max_terms=2"


def test_a_reasoning_gym_task_trains_with_its_scorer_and_math_verify(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    rewards = ("rewards=[{name: reasoning_gym}, {name: math_accuracy, kwargs: {answer_column: answer}}, "
               "{name: think_answer_format, weight: 0.1}]")
    assert run_cli("grpo", *run_overrides(
        tiny_model_dir, TASK, out, "data.eval='reasoning_gym:?size=6'", "train.max_steps=2", "train.eval_steps=2",
        "train.per_device_train_batch_size=4", "algo.num_generations=2", "generation.max_completion_length=8",
        "data.max_length=512", rewards)) == 0
    rows = metrics(out)
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in trained)
    for r in trained:  # every function under its own name; per-task accuracy from the task's scorer
        assert {"rewards/reasoning_gym/mean", "rewards/math_accuracy/mean", "rewards/think_answer_format/mean"} <= set(r)
        assert any(k.startswith("reasoning_gym/") for k in r)
    held_out = [r for r in rows if "eval/reward" in r]  # before training and at step 2
    assert len(held_out) == 2 and all({"eval/reasoning_gym/basic_arithmetic", "eval/reasoning_gym/chain_sum",
                                       "eval/math_accuracy/chain_sum"} <= set(r) for r in held_out)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<answer>" in s["prompt"][0]["content"] for s in samples if isinstance(s["prompt"], list))


VF = "verifiers:tests.integration.verifiers_envs"


def grpo_on(tiny_model_dir, out, train: str, *extra: str) -> list[dict]:
    assert run_cli("grpo", *run_overrides(
        tiny_model_dir, train, out, "train.max_steps=1", "train.per_device_train_batch_size=4",
        "algo.num_generations=2", "generation.max_completion_length=24", "data.max_length=512", *extra)) == 0
    return [r for r in metrics(out) if "loss" in r]


def test_a_verifiers_single_turn_environment_trains_on_its_rubric(tiny_model_dir, tmp_path):
    pytest.importorskip("verifiers.v1")
    [row] = grpo_on(tiny_model_dir, tmp_path / "run", f"{VF}:single_turn?num_tasks=4", "rewards=[{name: verifiers}]")
    assert {"rewards/verifiers/mean", "verifiers/correct", "verifiers/brief"} <= set(row)
    # the total is the rubric's weighted sum: correct x 1 + brief x 0.5
    assert row["rewards/verifiers/mean"] == pytest.approx(row["verifiers/correct"] + 0.5 * row["verifiers/brief"])


def test_a_verifiers_tool_environment_runs_through_the_agent_loop_token_exact(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("verifiers.v1")
    from posttrain.agents import AgentLoop

    runs = []
    run = AgentLoop.run
    monkeypatch.setattr(AgentLoop, "run", lambda self, *a: runs.append(run(self, *a)) or runs[-1])
    [row] = grpo_on(tiny_model_dir, tmp_path / "run", f"{VF}:with_tools?num_tasks=4", "rewards=[{name: verifiers}]",
                    "agent.environment=verifiers", "agent.max_turns=3", "agent.max_turn_tokens=4",
                    "agent.tool_parser=tests.integration.verifiers_envs:every_turn_calls",
                    "generation.max_completion_length=96")
    assert row["turns/mean"] == 3 and row["verifiers/used_tool"] == 1.0
    trajectories = [t for batch in runs for t in batch]
    assert len(trajectories) == 4
    for t in trajectories:  # the model's turns are the engine's ids (mask 1), the tool answers appended (mask 0)
        roles = [m["role"] for m in t.messages[t.opening:]]
        assert roles == ["assistant", "tool"] * 2 + ["assistant"]
        assert len(t.completion_ids) == len(t.completion_mask) == len(t.logprobs)
        assert 0 < sum(t.completion_mask) < len(t.completion_mask)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.completion_mask) if not m)


def test_a_local_openenv_server_is_started_played_through_the_agent_loop_and_stopped(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    pytest.importorskip("openenv.core")
    from posttrain.agents import openenv_env
    from posttrain.agents import AgentLoop

    runs = []
    run = AgentLoop.run
    monkeypatch.setattr(AgentLoop, "run", lambda self, *a: runs.append(run(self, *a)) or runs[-1])
    monkeypatch.setattr(openenv_env, "_SERVERS", {})
    [row] = grpo_on(tiny_model_dir, tmp_path / "run", TASK, "rewards=[{name: reasoning_gym}]",
                    "agent.environment=openenv:tests.integration.openenv_envs:app", "agent.max_turns=4",
                    "agent.max_turn_tokens=4", "agent.user_code_timeout=120", "generation.max_completion_length=96")
    # the server ends each episode after two turns and rewards a turn by its length / 50
    assert row["turns/mean"] == 2 and 0 < row["rewards/environment/mean"] <= 2 * 4 * 4 / 50 + 1e-6
    for t in (t for batch in runs for t in batch):
        assert [m["content"] for m in t.messages[t.opening - 1:t.opening]] == ["Say something."]
        assert [m["role"] for m in t.messages[t.opening:]] == ["assistant", "user", "assistant"]
        assert t.env_reward == pytest.approx(sum(len(m["content"]) for m in t.messages[t.opening::2]) / 50)
        assert 0 < sum(t.completion_mask) < len(t.completion_mask)
    [server] = openenv_env._SERVERS.values()
    assert server.url.startswith("http://127.0.0.1:")
    server.stop()  # what the run's exit does (atexit)
    assert server.process.poll() is not None


@pytest.mark.parametrize("module, package, overrides", [
    ("math_verify", "math-verify", ["rewards=[{name: math_accuracy}]"]),
    ("reasoning_gym", "reasoning-gym", ["rewards=[{name: exact_match}]"]),
    ("verifiers.v1", "verifiers", ["data.train=verifiers:my-env", "rewards=[{name: exact_match}]"]),
    ("openenv.core", "openenv-core", ["rewards=[{name: exact_match}]", "agent.environment=openenv:http://127.0.0.1:1"]),
])
def test_a_missing_package_is_named_with_its_extra_before_anything_loads(tiny_model_dir, tmp_path, monkeypatch,
                                                                        capsys, module, package, overrides):
    from posttrain.models import load

    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(load, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    out = tmp_path / "run"
    assert run_cli("grpo", *run_overrides(tiny_model_dir, TASK, out, *overrides)) == 2
    printed = capsys.readouterr().err
    assert f"needs the '{package}' package" in printed and "pip install 'posttrain[envs]'" in printed
    assert not (out / "config.yaml").exists()
