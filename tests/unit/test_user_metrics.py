"""Issue 48 class 6: what a reward function logs through log_metric never replaces a metric of the trainer's."""

from __future__ import annotations

import pytest
import torch

from posttrain.errors import UserError
from posttrain.online.scoring import RankFigures
from posttrain.online.scoring import step_metrics
from posttrain.rewards.combine import Reward, RewardSet
from posttrain.rewards.contract import UserLog
from posttrain.train.loop import source_metrics
from posttrain.usercode import UserCodeError


@pytest.mark.parametrize("name", ["loss", "reward/mean", "rewards/acc/mean", "loss/critic", "learning_rate",
                                  "grad_norm", "tokens_per_second", "step", "time/generate", "completion_length/mean"])
def test_log_metric_refuses_a_name_the_trainer_logs_naming_the_reward(name):
    with pytest.raises(UserError, match=f"reward 'acc' called log_metric\\('{name}', ...\\): the trainer logs "
                                        f"'{name}' itself .* e.g. 'acc/{name}'"):
        UserLog("acc", 2).log_metric(name, 1.0)


def test_a_name_of_its_own_is_logged():
    log = UserLog("acc", 2)
    log.log_metric("acc/loss", 1.0)
    log.log_metric("my_accuracy", 0.5)
    assert log.metrics == {"acc/loss": [1.0], "my_accuracy": [0.5]}


def test_through_a_reward_set_the_reserved_name_stops_the_batch():
    def cheats(completions, log_metric, **kwargs):
        log_metric("reward/mean", 99.0)
        return [0.0] * len(completions)

    with pytest.raises(UserError, match="log_metric\\('reward/mean'"):
        RewardSet([Reward("cheats", cheats, on_error="skip")]).score(["p"], ["c"])


def test_a_user_metric_named_like_a_rollout_figure_is_refused_where_they_meet():
    def part(logged):
        return RankFigures(total=[1.0, 0.0], scored=[True, True], per_function={"acc": [1.0, 0.0]}, skipped=0,
                           logged=logged, lengths=[3, 4], truncated=[False, False], lags=[0, 0], agent=None)

    with pytest.raises(UserCodeError, match="log_metric\\('frac_reward_zero_std', ...\\), a metric the trainer logs"):
        step_metrics([part({"frac_reward_zero_std": [0.5]})], torch.tensor([1.0, 0.0]), torch.tensor([True, True]), 2)
    figures = step_metrics([part({"acc/frac": [0.5]})], torch.tensor([1.0, 0.0]), torch.tensor([True, True]), 2)
    assert figures["acc/frac"] == 0.5


def test_a_source_figure_named_like_the_algorithms_is_refused_not_swapped_in():
    with pytest.raises(UserCodeError, match="the metric 'entropy' is the trainer's"):
        source_metrics({"loss": 1.0, "entropy": 2.0}, {"entropy": 0.0, "reward/mean": 1.0})
    assert source_metrics({"loss": 1.0}, {"reward/mean": 1.0}) == {"reward/mean": 1.0}
