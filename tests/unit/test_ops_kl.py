"""posttrain.ops.kl against hand-worked numbers."""

import math

import pytest
import torch

from posttrain.ops.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3

LOGPROBS_BT = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]])
REF_LOGPROBS_BT = torch.tensor([[0.0, math.log(0.25), math.log(0.4)]])


def test_k1_by_hand():
    expected = [0.0, math.log(0.5 / 0.25), math.log(0.2 / 0.4)]
    assert kl_k1(LOGPROBS_BT, REF_LOGPROBS_BT)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_k2_by_hand():
    expected = [0.0, 0.5 * math.log(2) ** 2, 0.5 * math.log(0.5) ** 2]
    assert kl_k2(LOGPROBS_BT, REF_LOGPROBS_BT)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_k3_by_hand():
    # r = ref / p: 0.5 then 2.0; k3 = r - 1 - log r
    expected = [0.0, 0.5 - 1 - math.log(0.5), 2.0 - 1 - math.log(2.0)]
    assert kl_k3(LOGPROBS_BT, REF_LOGPROBS_BT)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_k3_is_unbiased_for_kl():
    # sample from p over 3 outcomes; E_p[k3] = KL(p || q)
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    expectation = (p * kl_k3(p.log()[None], q.log()[None])[0]).sum().item()
    assert expectation == pytest.approx(exact, abs=1e-6)


def test_table_names_the_estimators():
    assert KL_ESTIMATORS == {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
