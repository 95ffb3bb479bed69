"""PPO-family estimators, whitening, the KL controller and the clipped value loss against numbers worked by hand."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses.value import clipped_value_loss
from posttrain.ops.advantages import (discounted_returns, gae, last_token_mask, masked_moments, rloo_scores,
                                      token_rewards, whiten)
from posttrain.ops.kl import KLController

# one row: a prompt token, three completion tokens, one pad whose reward and value must not leak in
MASK = torch.tensor([[0, 1, 1, 1, 0]], dtype=torch.bool)
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 1.0, 5.0]])
VALUES = torch.tensor([[0.0, 0.5, 0.4, 0.2, 9.0]])


def test_gae_by_hand():
    # gamma 1, lam 0.5: A3 = 1 - 0.2 = 0.8; A2 = (0.2 - 0.4) + 0.5 * 0.8 = 0.2; A1 = (0.4 - 0.5) + 0.5 * 0.2 = 0
    advantages, returns = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.0, 0.2, 0.8, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.5, 0.6, 1.0, 0.0]]))


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    # gamma 0.5, lam 1: A1 = 0.25 * 1 - 0.5 = -0.25, A2 = 0.5 * 1 - 0.4 = 0.1, A3 = 1 - 0.2 = 0.8
    advantages, _ = gae(REWARDS, VALUES, MASK, gamma=0.5, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -0.25, 0.1, 0.8, 0.0]]))


def test_gae_rows_are_independent():
    both_R, both_V = torch.cat([REWARDS, REWARDS * 2]), torch.cat([VALUES, VALUES])
    advantages, _ = gae(both_R, both_V, torch.cat([MASK, MASK]), gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages[0], torch.tensor([0.0, 0.0, 0.2, 0.8, 0.0]))
    # reward 2: A3 = 2 - 0.2 = 1.8, A2 = -0.2 + 0.5 * 1.8 = 0.7, A1 = -0.1 + 0.5 * 0.7 = 0.25
    torch.testing.assert_close(advantages[1], torch.tensor([0.0, 0.25, 0.7, 1.8, 0.0]))


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[0.0, -0.1, 0.2, 1.0, 5.0]])
    # G3 = 1, G2 = 0.2 + 0.5 * 1 = 0.7, G1 = -0.1 + 0.5 * 0.7 = 0.25
    torch.testing.assert_close(discounted_returns(rewards, MASK, 0.5), torch.tensor([[0.0, 0.25, 0.7, 1.0, 0.0]]))


def test_token_rewards_put_the_score_on_the_last_completion_token():
    kl = torch.tensor([[0.0, 0.1, 0.2, 0.3, 7.0]])
    out = token_rewards(torch.tensor([2.0]), kl, MASK, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.05, -0.1, 1.85, 0.0]]))
    assert last_token_mask(torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])).tolist() == [[False, False, True, False],
                                                                                    [False] * 4]


def test_rloo_baseline_is_the_mean_of_the_others():
    torch.testing.assert_close(rloo_scores(torch.tensor([1.0, 0.0, 0.0, 2.0]), 2), torch.tensor([1.0, -1.0, -2.0, 2.0]))
    torch.testing.assert_close(rloo_scores(torch.tensor([3.0, 0.0, 0.0]), 3), torch.tensor([3.0, -1.5, -1.5]))


def test_whiten_by_hand_and_from_summed_moments():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # mean 2, population variance 2/3
    s = (2 / 3) ** 0.5
    torch.testing.assert_close(whiten(x, mask, masked_moments(x, mask)), torch.tensor([[-1 / s, 0.0, 1 / s, 0.0]]))
    torch.testing.assert_close(whiten(x, mask, masked_moments(x, mask), shift_mean=False),
                               torch.tensor([[2 - 1 / s, 2.0, 2 + 1 / s, 0.0]]))
    # two ranks' moments summed give the whole step's
    halves = masked_moments(x[:, :2], mask[:, :2]) + masked_moments(x[:, 2:], mask[:, 2:])
    torch.testing.assert_close(halves, masked_moments(x, mask))


def test_kl_controller_fixed_and_adaptive():
    fixed = KLController(0.1)
    assert fixed.update(50.0, 1000) == 0.1
    adaptive = KLController(0.1, target=6.0, horizon=10000)
    # kl 12: error clipped to +0.2 -> x (1 + 0.2 * 1000 / 10000) = 1.02
    assert adaptive.update(12.0, 1000) == pytest.approx(0.102)
    # kl 3: error -0.5 clipped to -0.2 -> x 0.98
    assert adaptive.update(3.0, 1000) == pytest.approx(0.102 * 0.98)


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.4]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # token 0: (1 - 2)^2 = 1 vs clipped (0.7 - 2)^2 = 1.69 -> 0.845 (clipped branch: no gradient)
    # token 1: (0 - 0.4)^2 = 0.16 vs clipped (0.3 - 0.4)^2 = 0.01 -> 0.08
    loss, clip_fraction = clipped_value_loss(values, old, returns, mask, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.08]]))
    assert clip_fraction.item() == pytest.approx(0.5)
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.4]]))
    plain, none_clipped = clipped_value_loss(values.detach(), old, returns, mask, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.08]]))
    assert none_clipped.item() == 0.0
