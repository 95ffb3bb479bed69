"""The `overlong` built-in against DAPO's R_length (Yu et al. 2025, eq. 13) worked out by hand."""

from __future__ import annotations

import pytest

from posttrain.config.schema import RewardConfig
from posttrain.errors import UserError
from posttrain.rewards.load import load_reward
from posttrain.rewards.overlong import Overlong, overlong_penalty


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (16_384, 0.0),        # |y| <= L_max - L_cache: no penalty
    (16_385, -1 / 4096),            # first token into the buffer: (16384 - 16385) / 4096
    (18_432, -0.5),                 # half-way through the buffer: (16384 - 18432) / 4096
    (20_480, -1.0),                 # at the cap: (16384 - 20480) / 4096
    (20_481, -1.0), (50_000, -1.0),  # past the cap
])
def test_paper_setting(length, expected):
    """The paper's setting: L_max = 20480, L_cache = 4096."""
    assert overlong_penalty(length, 20_480, 4_096) == pytest.approx(expected, abs=1e-12)


def test_called_by_keyword_on_token_ids_with_a_penalty_factor():
    reward = Overlong(max_length=10, buffer=4, penalty_factor=0.5)
    ids = [[1] * n for n in (6, 7, 8, 10, 12)]
    # expected = 10 - 4 = 6: 0; 0.5 * (6 - 7) / 4; 0.5 * (6 - 8) / 4; 0.5 * (6 - 10) / 4; -0.5 past the cap
    assert reward(prompts=["p"] * 5, completions=["c"] * 5, completion_ids=ids, answer=[1] * 5) == [
        0.0, -0.125, -0.25, -0.5, -0.5]


def test_loaded_from_the_recipe_and_scored_from_completion_ids():
    reward = load_reward(RewardConfig(name="overlong", kwargs={"max_length": 8, "buffer": 2}))
    ids = [[5] * n for n in (6, 7, 9)]
    assert reward.fn(["p"] * 3, ["a", "b", "c"], completion_ids=ids) == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_length": 8, "buffer": 0}, "0 < kwargs.buffer <= kwargs.max_length"),
    ({"max_length": 8, "buffer": 9}, "0 < kwargs.buffer <= kwargs.max_length"),
    ({"max_length": 8.5, "buffer": 2}, "integers"),
    ({"max_length": 8, "buffer": 2, "penalty_factor": -1}, "penalty_factor must be a number >= 0"),
    ({"max_length": 8}, "needs kwargs buffer"),
    ({"max_length": 8, "bufer": 2}, "did you mean 'buffer'"),
])
def test_bad_kwargs_fail_at_load(kwargs, message):
    with pytest.raises(UserError, match=message):
        load_reward(RewardConfig(name="overlong", kwargs=kwargs))


def test_without_token_ids_it_says_so():
    with pytest.raises(UserError, match="completion_ids"):
        Overlong(8, 2)(["p"], ["c"])
