"""PPO's advantage-estimator table and its whitening defaults, through PPO.advantages, against hand-worked numbers.

The rloo case was found by an independent comparison with OpenRLHF (2026-11-23): whitening a leave-one-out baselined
score by token-weighted statistics let one completion's length push an above-average completion below zero."""

from __future__ import annotations

import statistics

import pytest
import torch

from posttrain.algorithms.ppo import PPO, PPOAlgoConfig
from posttrain.batch import Batch
from posttrain.config.load import load_recipe
from posttrain.errors import UserError
from posttrain.ops.advantages import (ADVANTAGE_ESTIMATORS, discounted_advantages, gae, grpo_scores, raw_scores,
                                      rloo_scores)
from posttrain.online.rollout_source import Rollouts


def make_ppo(model_dir, *overrides: str) -> PPO:
    # kl_coef 0: no reference, so every token's reward is 0 except the score at its completion's end
    return PPO(load_recipe(None, [f"model.name_or_path={model_dir}", "data.train=unused.jsonl", "algo.kl_coef=0",
                                  "rewards=[{name: exact_match}]", *overrides], PPOAlgoConfig))


def step(scores, lengths, group_size, values=None) -> Rollouts:
    """One micro-batch: a prompt token, then each completion's `lengths[i]` tokens, then padding."""
    T = 1 + max(lengths)
    mask_BT = torch.tensor([[0] + [1] * n + [0] * (T - 1 - n) for n in lengths], dtype=torch.bool)
    values_BT = torch.zeros(len(lengths), T) if values is None else torch.tensor(values)
    batch = Batch(input_ids_BT=torch.ones(len(lengths), T, dtype=torch.long), completion_mask_BT=mask_BT,
                  num_sequences=len(lengths), old_logprobs_BT=torch.zeros(len(lengths), T), old_values_BT=values_BT)
    return Rollouts([batch], torch.tensor(scores), torch.zeros(len(scores), dtype=torch.bool), 0, group_size,
                    lambda x: x)


def completion_advantages(ppo: PPO, rollouts: Rollouts) -> tuple[list, torch.Tensor]:
    """Per completion: its tokens' (advantages, returns); and the advantages outside the completions."""
    [batch], _ = ppo.advantages(rollouts)
    rows = zip(batch.advantages_BT, batch.returns_BT, batch.completion_mask_BT)
    return [[a[m].tolist(), r[m].tolist()] for a, r, m in rows], batch.advantages_BT[~batch.completion_mask_BT]


def whitened(values: list[float]) -> list[float]:
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(v - mean) / std for v in values]


def test_the_table():
    assert list(ADVANTAGE_ESTIMATORS) == ["gae", "reinforce++", "rloo", "grpo"]
    expected = {"gae": (raw_scores, gae, True, False), "reinforce++": (raw_scores, discounted_advantages, True, False),
                "rloo": (rloo_scores, discounted_advantages, False, True),
                "grpo": (grpo_scores, discounted_advantages, False, True)}
    assert {name: tuple(e) for name, e in ADVANTAGE_ESTIMATORS.items()} == expected


def test_rloo_is_not_whitened_by_default(tiny_model_dir):
    # G = 3, scores [1, 0.8, 0], lengths [10, 1, 1]: leave-one-out 1 - 0.4 = 0.6, 0.8 - 0.5 = 0.3, 0 - 0.9 = -0.9,
    # carried by every token of its completion (gamma 1, no KL); OpenRLHF gives the same
    rollouts = step([1.0, 0.8, 0.0], [10, 1, 1], 3)
    rows, outside = completion_advantages(make_ppo(tiny_model_dir, "algo.advantage_estimator=rloo",
                                                   "algo.num_generations=3", "train.per_device_train_batch_size=3"),
                                          rollouts)
    assert [a for a, _ in rows] == [pytest.approx([0.6] * 10), pytest.approx([0.3]), pytest.approx([-0.9])]
    assert [r for _, r in rows] == [pytest.approx([0.6] * 10), pytest.approx([0.3]), pytest.approx([-0.9])]
    assert not outside.any()
    # forced on, the 12 tokens are whitened together: mean 0.45, population std 0.4153 -> 0.361, -0.361, -3.25
    rows, _ = completion_advantages(make_ppo(tiny_model_dir, "algo.advantage_estimator=rloo", "algo.num_generations=3",
                                             "train.per_device_train_batch_size=3", "algo.whiten_advantages=true"),
                                    rollouts)
    expected = whitened([0.6] * 10 + [0.3, -0.9])
    assert [a for a, _ in rows] == [pytest.approx(expected[:10], abs=1e-5), pytest.approx([expected[10]], abs=1e-5),
                                    pytest.approx([expected[11]], abs=1e-5)]
    assert expected[0] == pytest.approx(0.361, abs=1e-3) and expected[11] == pytest.approx(-3.25, abs=1e-2)


def test_grpo_is_not_whitened_by_default(tiny_model_dir):
    # group [1, 0]: mean 0.5, sample std 0.7071 -> +-0.5 / 0.7072 on every token, lengths [2, 1]
    rows, _ = completion_advantages(make_ppo(tiny_model_dir, "algo.advantage_estimator=grpo", "algo.num_generations=2",
                                             "train.per_device_train_batch_size=2"), step([1.0, 0.0], [2, 1], 2))
    a = 0.5 / (0.5**0.5 + 1e-4)
    assert [adv for adv, _ in rows] == [pytest.approx([a, a]), pytest.approx([-a])]


def test_gae_is_whitened_by_default(tiny_model_dir):
    # gamma 1, lam 0.95, scores [1, 0], lengths [2, 1], values [0.5, 0.5] and [0.2]:
    # row 0: A2 = 1 - 0.5 = 0.5, A1 = (0 + 0.5 - 0.5) + 0.95 * 0.5 = 0.475; returns 0.975, 1.0; row 1: A1 = -0.2
    values = [[0.0, 0.5, 0.5], [0.0, 0.2, 7.0]]  # the pad's 7 must not leak in
    rollouts = step([1.0, 0.0], [2, 1], 1, values)
    rows, outside = completion_advantages(make_ppo(tiny_model_dir), rollouts)
    expected = whitened([0.475, 0.5, -0.2])
    assert [a for a, _ in rows] == [pytest.approx(expected[:2], abs=1e-5), pytest.approx(expected[2:], abs=1e-5)]
    assert [r for _, r in rows] == [pytest.approx([0.975, 1.0]), pytest.approx([0.0])]
    assert not outside.any()
    rows, _ = completion_advantages(make_ppo(tiny_model_dir, "algo.whiten_advantages=false"), rollouts)
    assert [a for a, _ in rows] == [pytest.approx([0.475, 0.5]), pytest.approx([-0.2])]


def test_reinforce_plus_plus_is_whitened_by_default(tiny_model_dir):
    # gamma 1, scores [1, 0], lengths [2, 1]: returns [1, 1] and [0]; whitened (mean 2/3, std sqrt(2/9)):
    # 1/sqrt(2), 1/sqrt(2), -sqrt(2); the critic's target stays the unwhitened return
    rollouts = step([1.0, 0.0], [2, 1], 1)
    rows, _ = completion_advantages(make_ppo(tiny_model_dir, "algo.advantage_estimator=reinforce++"), rollouts)
    assert [a for a, _ in rows] == [pytest.approx([2**-0.5, 2**-0.5], abs=1e-5), pytest.approx([-(2**0.5)], abs=1e-5)]
    assert [r for _, r in rows] == [pytest.approx([1.0, 1.0]), pytest.approx([0.0])]


def test_an_unknown_estimator_names_the_closest(tiny_model_dir):
    with pytest.raises(UserError, match=r"algo.advantage_estimator is 'reinforce\+'; did you mean 'reinforce\+\+'\?"):
        make_ppo(tiny_model_dir, "algo.advantage_estimator=reinforce+")
    with pytest.raises(UserError, match="compares samples of one prompt"):
        make_ppo(tiny_model_dir, "algo.advantage_estimator=rloo")
