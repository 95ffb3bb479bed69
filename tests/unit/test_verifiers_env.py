"""verifiers (0.4) environments: rows, the rubric as the reward (each function under its name, weights kept), the
tool environment's turns, and a rubric that raises named with its sample (environments in
tests/integration/verifiers_envs.py)."""

from __future__ import annotations

import sys

import pytest

from posttrain.config.schema import RewardConfig
from posttrain.data import load_rows
from posttrain.errors import UserError
from posttrain.rewards import RewardError, RewardSet, load_reward

pytest.importorskip("verifiers.v1")

ENVS = "verifiers:tests.integration.verifiers_envs"


def test_rows_and_the_rubric_total_with_each_function_logged():
    rows = load_rows(f"{ENVS}:single_turn?num_tasks=3", what="data.train")
    assert rows[2]["prompt"] == [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "What is 2 + 1?"}]
    assert "tools" not in rows.column_names and rows["vf_index"] == [0, 1, 2]
    reward = load_reward(RewardConfig(name="verifiers")).fn
    logged = []
    completions = ["3", "It is certainly, without any doubt, 2", "no idea"]
    scores = reward(prompts=rows["prompt"], completions=completions, vf_taskset=rows["vf_taskset"],
                    vf_index=rows["vf_index"], log_metric=lambda name, value: logged.append((name, value)))
    # row 0 (answer 1): "3" is wrong, brief -> 0.5; row 1 (answer 2): right, long -> 1.0; row 2 (3): wrong, brief
    assert scores == [0.5, 1.0, 0.5]
    assert sorted(logged) == sorted([("verifiers/correct", 0.0), ("verifiers/brief", 1.0), ("verifiers/correct", 1.0),
                                     ("verifiers/brief", 0.0), ("verifiers/correct", 0.0), ("verifiers/brief", 1.0)])


def test_the_tool_environment_runs_the_tasks_tools_and_scores_the_conversation():
    from posttrain.agents.parsers import pick_parser
    from posttrain.agents.verifiers_env import verifiers_environment

    every_turn_calls = pick_parser("tests.integration.verifiers_envs:every_turn_calls", None)
    spec = f"{ENVS}:with_tools?num_tasks=2"
    rows = load_rows(spec, what="data.train")
    assert [t["function"]["name"] for t in rows[0]["tools"]] == ["add"]
    env = verifiers_environment(spec, every_turn_calls)()
    assert env.reset({"prompt": rows[1]["prompt"], "vf_index": 1}) == rows[1]["prompt"]
    messages, reward, done = env.step({"role": "assistant", "content": "abc"})
    assert (messages, reward, done) == ([{"role": "tool", "name": "add", "content": "4"}], 0.0, False)
    no_call = verifiers_environment(spec, lambda text: ([], []))()
    no_call.reset({"prompt": rows[1]["prompt"], "vf_index": 1})
    assert no_call.step({"role": "assistant", "content": "2"}) == ([], 0.0, True)
    unknown = verifiers_environment(spec, lambda text: ([{"name": "mul", "arguments": {}}], []))()
    unknown.reset({"prompt": rows[0]["prompt"], "vf_index": 0})
    assert "no tool named 'mul'; the tools are add" in unknown.step({"role": "assistant", "content": "x"})[0][0]["content"]
    reward = load_reward(RewardConfig(name="verifiers")).fn
    conversation = [{"role": "assistant", "content": "abc"}, {"role": "tool", "name": "add", "content": "4"},
                    {"role": "assistant", "content": "2"}]
    # correct (1.0 x 1) + brief (1.0 x 0.5) + used_tool (1.0 x 2)
    assert reward(prompts=[rows[1]["prompt"]], completions=[conversation], vf_taskset=[spec], vf_index=[1]) == [3.5]


def test_a_rubric_that_raises_is_named_with_its_sample():
    rows = load_rows(f"{ENVS}:broken", what="data.train")
    rewards = RewardSet([load_reward(RewardConfig(name="verifiers"))])
    with pytest.raises(RewardError, match=r"reward 'verifiers' raised TaskError: task BrokenTask scoring: "
                                          r"ValueError: no score for this one on sample 2 \(prompt: 'What is 2 \+ 1\?'"):
        rewards.score(rows["prompt"], ["a"] * 4, {k: rows[k] for k in ("vf_taskset", "vf_index")})


@pytest.mark.parametrize("source, message", [
    (f"{ENVS}:nothing_here", "verifiers_envs has no"),
    (f"{ENVS}:single_turn?num_tasks=oops", "loading the verifiers environment .* failed"),
])
def test_a_bad_environment_is_named(source, message):
    with pytest.raises(UserError, match=f"data.train.*{message}"):
        load_rows(source, what="data.train")


def test_environment_verifiers_needs_verifiers_data(tiny_model_dir):
    from posttrain.agents import check_agent
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.models.load import load_tokenizer

    recipe = load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "data.train=x.jsonl",
                                "agent.environment=verifiers"], ALGORITHMS["grpo"][0])
    with pytest.raises(UserError, match="data.train must be verifiers:<environment>, not 'x.jsonl'"):
        check_agent(recipe, load_tokenizer(recipe.model), "grpo")


def test_a_missing_verifiers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(UserError, match=r"needs the 'verifiers' package.*pip install 'posttrain\[envs\]'"):
        load_rows("verifiers:some-env", what="data.train")


def test_a_verifiers_environment_wrapping_a_reasoning_gym_task_gives_the_same_prompts_and_rewards():
    """#44: the same task as reasoning_gym: data and as a verifiers environment gives the same rewards for the same
    completions (both through posttrain's data sources and rewards)."""
    pytest.importorskip("reasoning_gym")
    direct = load_rows("reasoning_gym:chain_sum?size=8&seed=3", what="data.train")
    wrapped = load_rows(f"{ENVS}:reasoning_gym_tasks?task=chain_sum&size=8&seed=3", what="data.train")
    assert wrapped["prompt"] == direct["prompt"]
    completions = [f"<answer>{a}</answer>" if i % 3 == 0 else "<answer>7</answer>" if i % 3 == 1 else str(a)
                   for i, a in enumerate(direct["answer"])]
    from_task = load_reward(RewardConfig(name="reasoning_gym")).fn(
        completions, **{k: direct[k] for k in ("rg_dataset", "rg_index", "task")})
    from_environment = load_reward(RewardConfig(name="verifiers")).fn(
        prompts=wrapped["prompt"], completions=completions, vf_taskset=wrapped["vf_taskset"],
        vf_index=wrapped["vf_index"])
    assert from_environment == from_task and 1.0 in from_task and 0.0 in from_task
