"""A completion no reward function scores (every one returned None) is TRL's unscorable completion: left out of its
group's mean and std, advantage 0, left out of the reward metrics and of dynamic sampling's filter. Checked against
TRL 1.16's own lines (GRPOTrainer._generate_and_score_completions, sum_then_normalize) with TRL's nanstd."""

import math

import pytest
import torch

from posttrain.ops.advantages import group_advantages, nanstd, zero_std_fraction
from posttrain.rewards import RewardSet
from posttrain.online.engine_link import Sample
from posttrain.online.dynamic_sampling import varied_groups
from posttrain.online.scoring import RankFigures
from posttrain.online.scoring import step_metrics

NAN = math.nan
G = 4
# two functions, three groups of 4: group 0 has one unscored completion, group 1 one scored completion only,
# group 2 every completion scored (one by the second function alone)
PER_FUNC_BK = torch.tensor([[1.0, 0.5], [0.0, NAN], [NAN, NAN], [1.0, 0.0],
                            [NAN, NAN], [NAN, 2.0], [NAN, NAN], [NAN, NAN],
                            [0.0, 0.0], [1.0, 1.0], [NAN, 3.0], [0.5, NAN]])
WEIGHTS_K = torch.tensor([1.0, 0.5])


@pytest.fixture(scope="module")
def trl_nanstd():
    pytest.importorskip("trl", minversion="1.16")
    from trl.trainer.utils import nanstd as trl_nanstd

    return trl_nanstd


def trl_sum_then_normalize(per_func_BK, weights_K, group, scale_rewards, trl_nanstd):
    """TRL 1.16's lines, as written there (mean / std / advantage / nan_to_num, and is_std_zero for the metric)."""
    unscorable_mask = torch.isnan(per_func_BK).all(dim=1)
    rewards = (per_func_BK * weights_K.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = trl_nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    else:
        std_rewards = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero, rewards


def scores(per_func_BK, weights_K):
    """posttrain's scoring of the same values: functions returning the columns (None for NaN)."""
    def returning(k):
        return lambda completions, **kw: [None if math.isnan(v) else float(v) for v in per_func_BK[:, k].tolist()]

    rewards = RewardSet([(f"f{k}", returning(k), float(w)) for k, w in enumerate(weights_K.tolist())])
    n = per_func_BK.shape[0]
    return rewards.score(["p"] * n, ["c"] * n)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls_with_unscorable_completions(scale_rewards, trl_nanstd):
    expected_B, _, _ = trl_sum_then_normalize(PER_FUNC_BK, WEIGHTS_K, G, scale_rewards, trl_nanstd)
    s = scores(PER_FUNC_BK, WEIGHTS_K)
    assert s.scored_B.tolist() == (~PER_FUNC_BK.isnan().all(dim=1)).tolist()
    got_B = group_advantages(s.total_B, G, scale_rewards, s.scored_B)
    assert got_B.tolist() == pytest.approx(expected_B.tolist(), abs=1e-6)
    assert got_B[~s.scored_B].eq(0).all()  # unscorable: no advantage
    assert got_B[4:8].eq(0).all()  # a group with one scored completion has nothing to compare it with
    # the unscored completion's reward (0 in total_B) moves nothing: group 0's scored advantages are those of the
    # three scored values alone
    alone = group_advantages(s.total_B[[0, 1, 3, 0, 1, 3]], 3, "group")[:3] if scale_rewards == "group" else None
    if alone is not None:
        assert got_B[[0, 1, 3]].tolist() == pytest.approx(alone.tolist(), abs=1e-6)


def test_without_a_mask_nothing_changes():
    rewards_B = torch.tensor([1.0, 0.0, 2.0, 2.0])
    assert group_advantages(rewards_B, 2, "group", torch.ones(4, dtype=torch.bool)).tolist() == \
        group_advantages(rewards_B, 2, "group").tolist()


def test_nanstd_is_trls(trl_nanstd):
    x_GN = torch.tensor([[1.0, NAN, 3.0, 0.0], [NAN, 2.0, NAN, NAN], [NAN] * 4])
    for dim in (None, 1):
        want = trl_nanstd(x_GN) if dim is None else trl_nanstd(x_GN, dim=1)
        assert nanstd(x_GN, dim=dim).tolist() == pytest.approx(want.tolist(), nan_ok=True)


def test_metrics_are_over_scored_completions_as_trls_nanmean(trl_nanstd):
    _, is_std_zero_B, trl_rewards_B = trl_sum_then_normalize(PER_FUNC_BK, WEIGHTS_K, G, "group", trl_nanstd)
    s = scores(PER_FUNC_BK, WEIGHTS_K)
    part = RankFigures(total=s.total_B.tolist(), scored=s.scored_B.tolist(),
                       per_function={k: v.tolist() for k, v in s.per_function.items()}, skipped=s.skipped, logged={},
                       lengths=[3] * 12, truncated=[False] * 12, lags=[0] * 12, agent=None)
    metrics = step_metrics([part], s.total_B, s.scored_B, G)
    assert metrics["reward/mean"] == pytest.approx(torch.nanmean(trl_rewards_B).item())
    assert metrics["rewards/unscored"] == 4
    assert metrics["frac_reward_zero_std"] == pytest.approx(is_std_zero_B.view(-1, G)[:, 0].float().mean().item())
    assert zero_std_fraction(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, torch.tensor([True, False, True, True])) == 0.5


def test_dynamic_sampling_leaves_unscored_completions_out_of_the_filter():
    # group 0: its scored completions agree, the unscored one (reward 0) must not make it look varied;
    # group 1: the scored ones differ beside an unscored one; group 2: a single scored completion
    total = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    scored = [True, True, False, True, True, False, True, True, True, False, False, False]
    prompts = [{"prompt": "p", "columns": {"answer": "a"}}] * 3
    drawn = Sample([[1]] * 12, [[2]] * 12, [[0.0]] * 12, [False] * 12, sampled_by=[None] * 12, prompts=prompts,
                   positions=list(range(3)), dataset_index=list(range(3)),
                   texts=["a", "a", "b", "a", "a", "b", "b", "b", "a", "b", "b", "b"], total=total, scored=scored)
    assert varied_groups(drawn.metric("reward"), G).tolist() == [False, True, False]
    # accuracy: group 0's unscored completion is the only wrong one; group 1 varies among the scored
    assert varied_groups(drawn.metric("accuracy"), G).tolist() == [False, True, False]
    assert [g.scored for g in drawn.groups()][1] == scored[4:8]
    assert Sample.join(drawn.groups()).scored == scored


def test_a_run_whose_every_step_is_unscored_stops_and_one_outage_does_not():
    from posttrain.errors import RunStopped
    from posttrain.online.scoring import UnscoredSteps

    none, some = torch.zeros(4, dtype=torch.bool), torch.tensor([True, False, False, False])
    with pytest.raises(RunStopped, match=r"no reward scored any completion of every step so far \(to step 1\) "
                                         r"\('judge' 4 of 4 missing\)"):
        UnscoredSteps().check(none, {"judge": 4}, 0)
    guard = UnscoredSteps(limit=3)
    guard.check(some, {"judge": 3}, 0)
    guard.check(none, {"judge": 4}, 1)  # an outage after scored steps: ridden out (on_error: skip)
    guard.check(none, {"judge": 4}, 2)
    with pytest.raises(RunStopped, match="of the last 3 steps"):
        guard.check(none, {"judge": 4}, 3)
    guard = UnscoredSteps(limit=2)
    for step in range(5):  # scored again in between: the count starts over
        guard.check(some if step % 2 else none, {"judge": 4}, step) if step else guard.check(some, {}, 0)
