"""posttrain distill's pure pieces: the seeded on-policy coin, the prompt of a row, and the recipe checks that fail
before anything loads."""

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.config.load import load_recipe
from posttrain.errors import UserError
from posttrain.online.distill_source import on_policy_step, prompt_ids


def test_the_on_policy_coin_is_seeded_by_step_and_lands_at_lmbda():
    assert not any(on_policy_step(7, step, 0.0) for step in range(200))
    assert all(on_policy_step(7, step, 1.0) for step in range(200))
    coins = [on_policy_step(7, step, 0.3) for step in range(3000)]
    assert abs(sum(coins) / len(coins) - 0.3) < 0.03
    assert coins == [on_policy_step(7, step, 0.3) for step in range(3000)]  # a resumed run flips the same coins
    assert coins != [on_policy_step(8, step, 0.3) for step in range(3000)]


def test_the_prompt_is_what_comes_before_the_first_trained_token():
    assert prompt_ids({"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 0, 1, 1]}) == [5, 6, 7]


def load(*overrides):
    return load_recipe(None, ["data.train=a.jsonl", "algo.teacher_model_name_or_path=teacher/", *overrides],
                       ALGORITHMS["distill"][0])


@pytest.mark.parametrize("overrides, message", [
    (["algo.beta=1.5"], "algo.beta and algo.lmbda in [0, 1]"),
    (["algo.lmbda=-0.1"], "algo.beta and algo.lmbda in [0, 1]"),
    (["algo.temperature=0"], "algo.temperature must be > 0"),
    (["generation.temperature=0"], "algo.temperature must be > 0"),
    (["data.completion_only_loss=false"], "data.completion_only_loss=true"),
    (["algo.teacher_server=http://127.0.0.1:9"], "name the teacher once"),
    (["algo.teacher_model_name_or_path=null"], "name the teacher once"),
    (["launcher=ray", "placement.colocate=[[policy, teachers]]"], "unknown role 'teachers'"),
])
def test_bad_recipes_fail_at_load(overrides, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(*overrides)


def test_supervised_kd_may_pack_and_greedy_sampling_needs_a_loss_temperature():
    assert load("launcher=ray", "placement.colocate=[[policy, teacher]]").placement.colocate == (("policy", "teacher"),)
    assert load("algo.lmbda=0", "data.packing=true").data.packing
    recipe = load("generation.temperature=0", "algo.temperature=1.0")
    assert recipe.algo.loss_temperature(recipe) == 1.0
    recipe = load("generation.temperature=0.7")  # null: the sampling temperature
    assert recipe.algo.loss_temperature(recipe) == 0.7
