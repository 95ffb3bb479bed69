"""posttrain.ops.advantages against hand-worked numbers."""

import math

import pytest
import torch

from posttrain.ops.advantages import group_advantages, zero_std_fraction

# two groups of 3: [1, 2, 3] (mean 2, sample std 1) and [5, 5, 5] (mean 5, std 0)
REWARDS_B = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])


def test_group_scale_divides_by_each_groups_sample_std():
    expected = [-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0, 0.0]
    assert group_advantages(REWARDS_B, 3, "group").tolist() == pytest.approx(expected, rel=1e-6)


def test_group_scale_of_two_is_bessel_corrected():
    # {0, 1}: sample std sqrt(((-.5)^2 + .5^2) / (2 - 1)) = sqrt(0.5); population std would be 0.5
    expected = [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4)]
    assert group_advantages(torch.tensor([0.0, 1.0]), 2).tolist() == pytest.approx(expected, rel=1e-6)


def test_batch_scale_keeps_group_means_and_divides_by_one_std():
    mean = sum(REWARDS_B.tolist()) / 6  # 3.5
    batch_std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS_B.tolist()) / 5)
    expected = [-1 / (batch_std + 1e-4), 0.0, 1 / (batch_std + 1e-4), 0.0, 0.0, 0.0]
    assert group_advantages(REWARDS_B, 3, "batch").tolist() == pytest.approx(expected, rel=1e-6)


def test_no_scale_only_subtracts_group_mean():
    assert group_advantages(REWARDS_B, 3, "none").tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_group_advantages_rejects_bad_arguments():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(REWARDS_B, 3, "std")
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(REWARDS_B, 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(REWARDS_B, 1)


def test_zero_std_fraction_by_hand():
    assert zero_std_fraction(REWARDS_B, 3).item() == 0.5
    assert zero_std_fraction(torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 2).item() == pytest.approx(2 / 3)
