"""--reward_funcs / --reward_weights / --reward_model_name_or_path (TRL's keys) as flags and in flat TRL configs:
each form of a reward, several at once, weights, and bad input as one message with exit 2 before any model loads."""

from __future__ import annotations

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.cli import command_line_overrides, main
from posttrain.config.load import load_recipe
from posttrain.config.trl_flags import split_trl_flags
from posttrain.rewards import load_rewards

GRPO = ALGORITHMS["grpo"][0]
REWARD_FILE = '''
def accuracy(completions, answer, **kwargs):
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]
'''


def recipe_from(argv: list[str]):
    rest, flags = split_trl_flags(["grpo", *argv])
    return load_recipe(None, command_line_overrides(rest[1:], flags, GRPO) + ["data.train=x.jsonl"], GRPO)


def entries(recipe) -> list[tuple]:
    return [(r.name, r.weight, dict(r.kwargs)) for r in recipe.rewards]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    (tmp_path / "rm").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_each_form_several_after_one_flag_with_weights(reward_module):
    recipe = recipe_from(["--reward_funcs", "my_rewards.py:accuracy", "my_rewards.accuracy", "exact_match", "rm",
                          "org/reward-model", "--reward_weights", "1", "0.5", "2", "0.25", "3"])
    assert entries(recipe) == [("my_rewards.py:accuracy", 1.0, {}), ("my_rewards.accuracy", 0.5, {}),
                               ("exact_match", 2.0, {}), ("reward_model", 0.25, {"path": "rm"}),
                               ("reward_model", 3.0, {"path": "org/reward-model"})]
    # the two import forms load the same function; a TRL script's dotted path runs unchanged
    rewards = load_rewards(recipe.rewards[:2])
    chat = [[{"role": "user", "content": "2 + 2?"}]] * 2
    scores = rewards.score(chat, [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]],
                           {"answer": ["4", "4"]})
    assert rewards.names == ["accuracy", "accuracy_2"]
    assert scores.per_function["accuracy"].tolist() == scores.per_function["accuracy_2"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("argv", [
    ["--reward_funcs", "my_rewards.accuracy", "--reward_funcs", "exact_match"],   # repeated: both kept
    ["--reward_funcs", "my_rewards.accuracy,exact_match"],                        # comma-separated
    ["--reward_funcs=my_rewards.accuracy,exact_match"],
    ["--reward_funcs", "[my_rewards.accuracy, exact_match]"],                     # a YAML list
])
def test_repeated_comma_and_list_forms(reward_module, argv):
    assert [r.name for r in recipe_from(argv + ["train.max_steps=2"]).rewards] == ["my_rewards.accuracy",
                                                                                   "exact_match"]


def test_flags_replace_the_recipes_rewards_and_a_model_flag_goes_first(reward_module):
    config = reward_module / "grpo.yaml"
    config.write_text("rewards: [{name: format, kwargs: {pattern: x}}]\ndata: {train: x.jsonl}\n")
    rest, flags = split_trl_flags(["grpo", "--reward_funcs", "exact_match", "--reward_model_name_or_path", "rm"])
    recipe = load_recipe(str(config), command_line_overrides(rest[1:], flags, GRPO), GRPO)
    assert entries(recipe) == [("reward_model", 1.0, {"path": "rm"}), ("exact_match", 1.0, {})]


def test_flat_trl_config_file(reward_module):
    config = reward_module / "trl.yaml"
    config.write_text("num_generations: 4\nreward_funcs: [my_rewards.accuracy, exact_match]\n"
                      "reward_weights: [1.0, 0.1]\ndataset_name: x.jsonl\n")
    recipe = load_recipe(str(config), [], GRPO)
    assert entries(recipe) == [("my_rewards.accuracy", 1.0, {}), ("exact_match", 0.1, {})]


@pytest.mark.parametrize("argv, message", [
    (["--reward_funcs", "a.py:f", "b.py:g", "--reward_weights", "1.0"],
     "--reward_weights: 1 weights for 2 rewards (a.py:f, b.py:g); give one weight per reward"),
    (["--reward_weights", "1.0"], "--reward_weights: weights with no --reward_funcs beside them"),
    (["--reward_funcs", "exact_match", "--reward_weights", "heavy"], "--reward_weights heavy: expected a number"),
    (["--reward_funcs", "no_such_module_xyz.fn"], "reward 'no_such_module_xyz.fn': cannot import module "
                                                   "'no_such_module_xyz'"),
    (["--reward_funcs", "my_rewards.acuracy"], "reward 'my_rewards.acuracy': my_rewards has no attribute 'acuracy'; "
                                               "did you mean 'accuracy'"),
    (["--reward_funcs", "my_rewards.py"], "reward 'my_rewards.py' names a file; say which function"),
    (["--reward_funcs", "accuracy_reward"], "reward 'accuracy_reward' is a TRL built-in; with trl installed pass it "
                                            "as 'trl.rewards.accuracy_reward'"),
    (["--reward_funcs", "runs/no/model"], "reward_model kwargs.path: local path 'runs/no/model' does not exist"),
    (["--reward_funcs", "exact_match", "--reward_weights", "1e39"],
     "rewards[0].weight is 1e+39, beyond the largest float32 (3.4e+38)"),
    (["--reward_funcs", "os:system"], "reward 'os:system' cannot be a reward function: it takes (command)"),
    (["--reward_funcs", "subprocess:getoutput"], "reward 'subprocess:getoutput' cannot be a reward function"),
])
def test_bad_rewards_exit_2_with_one_message_before_any_model_loads(reward_module, capsys, argv, message):
    # the model path does not exist either: the reward is checked first, so its message is the one printed
    code = main(["grpo", "--model_name_or_path", "missing-model/", "--dataset_name", "x.jsonl", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("posttrain: error:") == 1, err
    assert "missing-model" not in err and "Traceback" not in err


def test_trls_own_reward_function_runs_unchanged_by_its_dotted_path():
    pytest.importorskip("trl")
    rewards = load_rewards(recipe_from(["--reward_funcs", "trl.rewards.think_format_reward"]).rewards)
    chat = [[{"role": "user", "content": "2 + 2?"}]] * 2
    completions = [[{"role": "assistant", "content": "<think>\nadd\n</think>\n4"}],
                   [{"role": "assistant", "content": "4"}]]
    assert rewards.names == ["think_format_reward"]
    assert rewards.score(chat, completions, {}, [[1], [2]]).total_B.tolist() == [1.0, 0.0]
