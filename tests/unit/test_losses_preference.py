"""posttrain.losses.preference against hand-worked numbers."""

import math

import pytest
import torch

from posttrain.losses.preference import (
    PREFERENCE_LOSSES,
    bradley_terry_loss,
    hinge_loss,
    implicit_rewards,
    ipo_loss,
    preference_logits,
    robust_loss,
    sigmoid_loss,
    simpo_loss,
)


def log_sigmoid(z):
    return -math.log1p(math.exp(-z))


# two pairs: logits = (pc - rc) - (pr - rr) = (-10 + 12) - (-14 + 13) = 3, and (-5 + 4) - (-6 + 6) = -1
PC, PR = torch.tensor([-10.0, -5.0]), torch.tensor([-14.0, -6.0])
RC, RR = torch.tensor([-12.0, -4.0]), torch.tensor([-13.0, -6.0])
LOGITS = [3.0, -1.0]
BETA = 0.1


def test_preference_logits_by_hand():
    assert preference_logits(PC, PR, RC, RR).tolist() == LOGITS
    assert preference_logits(PC, PR).tolist() == [4.0, 1.0]  # reference-free


def test_sigmoid_dpo_by_hand():
    expected = [-log_sigmoid(0.3), -log_sigmoid(-0.1)]
    assert sigmoid_loss(torch.tensor(LOGITS), beta=BETA).tolist() == pytest.approx(expected, rel=1e-6)


def test_sigmoid_with_label_smoothing_is_cdpo():
    eps = 0.2
    expected = [-(1 - eps) * log_sigmoid(BETA * x) - eps * log_sigmoid(-BETA * x) for x in LOGITS]
    got = sigmoid_loss(torch.tensor(LOGITS), beta=BETA, label_smoothing=eps)
    assert got.tolist() == pytest.approx(expected, rel=1e-6)


def test_robust_by_hand():
    eps = 0.2
    expected = [(-(1 - eps) * log_sigmoid(BETA * x) + eps * log_sigmoid(-BETA * x)) / (1 - 2 * eps) for x in LOGITS]
    got = robust_loss(torch.tensor(LOGITS), beta=BETA, label_smoothing=eps)
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    # without noise it is plain DPO
    assert robust_loss(torch.tensor(LOGITS), beta=BETA).tolist() == pytest.approx([-log_sigmoid(0.3), -log_sigmoid(-0.1)])
    with pytest.raises(ValueError, match="label_smoothing"):
        robust_loss(torch.tensor(LOGITS), beta=BETA, label_smoothing=0.5)


def test_ipo_by_hand():
    # 1 / (2 * 0.1) = 5
    assert ipo_loss(torch.tensor(LOGITS), beta=BETA).tolist() == pytest.approx([(3 - 5) ** 2, (-1 - 5) ** 2])


def test_hinge_by_hand():
    assert hinge_loss(torch.tensor([3.0, -1.0, 20.0]), beta=BETA).tolist() == pytest.approx([0.7, 1.1, 0.0])


def test_simpo_by_hand():
    # length-normalised: chosen -10 over 5 tokens, rejected -14 over 7 tokens -> logits = -2 - (-2) = 0
    logits_P = preference_logits(torch.tensor([-10.0 / 5, -3.0 / 2]), torch.tensor([-14.0 / 7, -8.0 / 4]))
    got = simpo_loss(logits_P, beta=2.0, simpo_gamma=0.5)
    assert got.tolist() == pytest.approx([-log_sigmoid(2.0 * 0.0 - 0.5), -log_sigmoid(2.0 * 0.5 - 0.5)], rel=1e-6)
    smoothed = simpo_loss(logits_P, beta=2.0, label_smoothing=0.1, simpo_gamma=0.5)
    z = 2.0 * 0.5 - 0.5
    assert smoothed[1].item() == pytest.approx(-0.9 * log_sigmoid(z) - 0.1 * log_sigmoid(-z), rel=1e-6)


def test_table_rows():
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "robust", "ipo", "hinge", "simpo"}
    assert PREFERENCE_LOSSES["simpo"].reference_free and PREFERENCE_LOSSES["simpo"].length_normalised
    assert PREFERENCE_LOSSES["ipo"].length_normalised and not PREFERENCE_LOSSES["ipo"].reference_free
    assert not any(PREFERENCE_LOSSES[name].length_normalised for name in ("sigmoid", "robust", "hinge"))
    for spec in PREFERENCE_LOSSES.values():  # one signature for all
        loss_P = spec.loss(torch.tensor(LOGITS), beta=BETA, label_smoothing=0.1, simpo_gamma=0.5)
        assert loss_P.shape == (2,) and torch.isfinite(loss_P).all()


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    sigmoid_loss(preference_logits(pc, pr, RC, RR), beta=BETA).sum().backward()
    # d/dpc of -log sigmoid(beta x) = -beta * sigmoid(-beta x)
    assert pc.grad.tolist() == pytest.approx([-BETA / (1 + math.exp(0.3)), -BETA / (1 + math.exp(-0.1))], rel=1e-6)
    assert pr.grad.tolist() == pytest.approx((-pc.grad).tolist())


def test_implicit_rewards_by_hand():
    chosen_P, rejected_P = implicit_rewards(PC, PR, RC, RR, beta=BETA)
    assert chosen_P.tolist() == pytest.approx([0.2, -0.1]) and rejected_P.tolist() == pytest.approx([-0.1, 0.0])
    chosen_P, rejected_P = implicit_rewards(PC, PR, beta=2.0)  # reference-free
    assert chosen_P.tolist() == [-20.0, -10.0] and rejected_P.tolist() == [-28.0, -12.0]
    assert not implicit_rewards(PC.clone().requires_grad_(), PR, RC, RR, beta=BETA)[0].requires_grad


def test_bradley_terry_by_hand():
    chosen_P, rejected_P = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5])
    assert bradley_terry_loss(chosen_P, rejected_P).tolist() == pytest.approx([-log_sigmoid(1.0), -log_sigmoid(-0.5)])
    got = bradley_terry_loss(chosen_P, rejected_P, margin_P=torch.tensor([1.0, 0.5]))
    assert got.tolist() == pytest.approx([-log_sigmoid(0.0), -log_sigmoid(-1.0)])
