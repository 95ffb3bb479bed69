"""posttrain.losses.sft against hand-worked numbers."""

import math

import pytest
import torch

from posttrain.losses.sft import sft_loss_sum


def test_sft_loss_is_the_negative_masked_sum():
    logprobs_BT = torch.tensor([[0.0, math.log(0.5), math.log(0.25)], [0.0, math.log(0.1), -50.0]])
    mask_BT = torch.tensor([[False, True, True], [False, True, False]])
    expected = -(math.log(0.5) + math.log(0.25) + math.log(0.1))
    assert sft_loss_sum(logprobs_BT, mask_BT).item() == pytest.approx(expected, rel=1e-6)


def test_sft_loss_gradient_is_minus_the_mask():
    logprobs_BT = torch.zeros(1, 3, requires_grad=True)
    sft_loss_sum(logprobs_BT, torch.tensor([[False, True, True]])).backward()
    assert logprobs_BT.grad.tolist() == [[0.0, -1.0, -1.0]]
