"""reasoning-gym tasks as data + reward (posttrain/data/reasoning_gym.py, posttrain/rewards/reasoning_gym.py)."""

from __future__ import annotations

import collections
import sys

import pytest

from posttrain.config.schema import RewardConfig
from posttrain.data import load_rows
from posttrain.data.reasoning_gym import parse_spec
from posttrain.errors import UserError
from posttrain.rewards import load_reward

pytest.importorskip("reasoning_gym")

TRAIN = "reasoning_gym:basic_arithmetic?size=60&seed=1&min_terms=2&max_terms=2&max_digits=1"


def test_the_spec_reads_tasks_weights_and_options():
    spec = parse_spec("reasoning_gym:chain_sum*3,basic_arithmetic?size=10&seed=4&chain_sum.max_terms=3&prompt=direct",
                      "data.train")
    assert spec.tasks == (("chain_sum", 3.0, (("max_terms", 3),)), ("basic_arithmetic", 1.0, ()))
    assert (spec.size, spec.seed, spec.prompt, spec.seeded) == (10, 4, "direct", True)
    assert parse_spec("reasoning_gym:leg_counting", "data.train").seed == 0  # reproducible by default
    plus = parse_spec('reasoning_gym:basic_arithmetic?operators=["+","-"]&examples=1', "data.train")
    assert plus.tasks[0][2] == (("operators", ["+", "-"]),) and plus.examples == 1  # "+" is a plus, not a space


@pytest.mark.parametrize("source, message", [
    ("reasoning_gym:basic_arithmetc", "no task 'basic_arithmetc'; did you mean 'basic_arithmetic'"),
    ("reasoning_gym:a,b?max_terms=3", "with several tasks name the task"),
    ("reasoning_gym:basic_arithmetic*0", "weight > 0"),
    ("reasoning_gym:basic_arithmetic?size=0", "size=0 .* must be a whole number >= 1"),
    ("reasoning_gym:basic_arithmetic?prompt=mine", "prompt='mine' is not one of reasoning-gym's system prompts"),
    ("reasoning_gym:basic_arithmetic?min_terms=9&max_terms=2", "reasoning-gym refused the options"),
    ("reasoning_gym:basic_arithmetic?no_such_option=1", "reasoning-gym refused the options"),
    ("reasoning_gym:basic_arithmetic?examples=-1", "examples=-1 .* must be a whole number >= 0"),
])
def test_a_bad_spec_is_named(source, message):
    with pytest.raises(UserError, match=f"data.train: .*{message}"):
        load_rows(source, what="data.train")


def test_rows_the_held_out_split_and_a_composite():
    train = load_rows(TRAIN, what="data.train")
    held_out = load_rows("reasoning_gym:?size=40", what="data.eval", held_out_from=TRAIN)
    assert len(train) == 60 and set(train["task"]) == {"basic_arithmetic"}
    assert train[0]["prompt"][0]["role"] == "system" and "<answer>" in train[0]["prompt"][0]["content"]
    questions = {r["prompt"][1]["content"] for r in train}
    assert 0 < len(held_out) <= 40 and not questions & {r["prompt"][1]["content"] for r in held_out}
    # one-digit pairs: few distinct questions, so the fresh seed alone would overlap; the questions are dropped
    assert len(held_out) < 40
    assert load_rows(TRAIN, what="data.train")["prompt"] == train["prompt"]  # the same rows for the same spec
    mixed = load_rows("reasoning_gym:basic_arithmetic*3,chain_sum?size=200&seed=2", what="data.train")
    counts = collections.Counter(mixed["task"])
    assert set(counts) == {"basic_arithmetic", "chain_sum"} and 2 < counts["basic_arithmetic"] / counts["chain_sum"] < 4.5


def test_solved_examples_open_every_conversation_and_the_held_out_split_keeps_them():
    """examples=K: the training spec's first K rows, answered in tags, before each question (and not asked again);
    the held-out rows take the training prompt and examples, and never ask an example's question."""
    import reasoning_gym

    train_spec = "reasoning_gym:chain_sum?size=30&seed=7&max_terms=2&max_digits=2&prompt=direct&examples=2"
    train = load_rows(train_spec, what="data.train")
    held_out = load_rows("reasoning_gym:?size=20", what="data.eval", held_out_from=train_spec)
    own = reasoning_gym.create_dataset("chain_sum", size=30, seed=7, max_terms=2, max_digits=2)
    opening = [{"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["direct"]}]
    for i in (0, 1):
        opening += [{"role": "user", "content": own[i]["question"]},
                    {"role": "assistant", "content": f"<answer>{own[i]['answer']}</answer>"}]
    assert len(train) == 28 and train["rg_index"] == list(range(2, 30))
    assert all(p[:-1] == opening and p[-1]["role"] == "user" for p in list(train["prompt"]) + list(held_out["prompt"]))
    assert [p[-1]["content"] for p in train["prompt"]] == [own[i]["question"] for i in range(2, 30)]
    asked = {p[-1]["content"] for p in held_out["prompt"]}
    assert len(held_out) > 0 and not asked & {own[i]["question"] for i in range(30)}
    plain = load_rows("reasoning_gym:?size=20&prompt=simple&examples=0", what="data.eval", held_out_from=train_spec)
    assert [m["role"] for m in plain["prompt"][0]] == ["system", "user"]  # its own prompt and examples win
    assert plain["prompt"][0][0]["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["simple"]
    with pytest.raises(UserError, match="examples=5 .* is more than its size=4"):
        load_rows("reasoning_gym:chain_sum?size=4&examples=5", what="data.train")


def test_the_reward_is_the_tasks_own_scorer_on_the_answer_tags():
    import reasoning_gym

    rows = load_rows("reasoning_gym:basic_arithmetic*1,leg_counting?size=8&seed=3", what="data.train")
    reward = load_reward(RewardConfig(name="reasoning_gym")).fn
    completions = [f"I think...\n<answer>{a}</answer>" for a in rows["answer"]]
    completions[1] = "no tags at all " + rows["answer"][1]
    completions[2] = "<answer>wrong</answer>"
    logged = []
    columns = {k: rows[k] for k in ("rg_dataset", "rg_index", "task")}
    scores = reward(completions, log_metric=lambda name, value: logged.append((name, value)), **columns)
    own = []
    for i, text in enumerate(completions):  # reasoning-gym's own scorer on its own extraction, row by row
        dataset = reasoning_gym.create_dataset(rows["task"][i], size=8, seed=3 + 1 + ["basic_arithmetic", "leg_counting"].index(rows["task"][i]))
        entry = dataset[rows["rg_index"][i]]
        assert entry["question"] == rows["prompt"][i][1]["content"]
        answer = reasoning_gym.utils.extract_answer(text)
        own.append(0.0 if answer is None else dataset.score_answer(answer, entry))
    assert scores == own and scores[0] == 1.0 and scores[1] == scores[2] == 0.0
    assert logged == [(f"reasoning_gym/{t}", s) for t, s in zip(rows["task"], scores)]
    with pytest.raises(UserError, match="reward reasoning_gym scores rows made by a 'reasoning_gym:<task>'"):
        reward(["x"], answer=["1"])


def test_a_missing_reasoning_gym_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(UserError, match=r"needs the 'reasoning-gym' package.*pip install 'posttrain\[envs\]'"):
        load_rows("reasoning_gym:basic_arithmetic", what="data.train")


def test_held_out_figures_per_task_leave_out_missing_values():
    from types import SimpleNamespace

    import torch

    from posttrain.online.evaluation import per_task

    backend = SimpleNamespace(device="cpu", all_reduce_sum=lambda x: x)
    examples = [{"columns": {"task": t}} for t in ("a", "b", "a", "a", "c")]
    per_function = {"reasoning_gym": torch.tensor([1.0, 0.0, 0.0, float("nan"), 0.5]),
                    "fmt": torch.tensor([1.0, 1.0, 1.0, 1.0, float("nan")])}
    assert per_task(backend, examples, examples, per_function) == {
        "eval/reasoning_gym/a": 0.5, "eval/reasoning_gym/b": 0.0, "eval/reasoning_gym/c": 0.5,
        "eval/fmt/a": 1.0, "eval/fmt/b": 1.0}  # c: fmt gave no value, so no figure
    assert per_task(backend, [{"columns": {}}], [{"columns": {}}], per_function) == {}
