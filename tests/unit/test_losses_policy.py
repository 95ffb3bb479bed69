"""posttrain.losses.policy against hand-worked numbers, plus invariance of the aggregation to micro-batching."""

import math

import pytest
import torch

from posttrain.losses.policy import LOSS_AGGREGATIONS, add_kl_penalty, clipped_surrogate
from posttrain.losses.sampler_correction import sampler_importance_weights
from posttrain.ops.logprobs import sequence_mean

# two sequences, position 0 is the prompt; row 1's last token is padding.
# ratios pi / pi_old: row 0 -> 1.5, 0.5; row 1 -> 0.7, (3.0 under padding)
MASK_BT = torch.tensor([[False, True, True], [False, True, False]])
OLD_BT = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -1.0]])
RATIOS_BT = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.7, 3.0]])
ADVANTAGES_B = torch.tensor([1.0, -1.0])
EPS_LOW, EPS_HIGH = 0.2, 0.28  # clip-higher: ratio kept in [0.8, 1.28]


def logprobs():
    return (OLD_BT + RATIOS_BT.log()).requires_grad_()


def test_token_level_clip_by_hand():
    logprobs_BT = logprobs()
    loss_BT, clip_fraction = clipped_surrogate(logprobs_BT, OLD_BT, ADVANTAGES_B, MASK_BT, EPS_LOW, EPS_HIGH)
    # row 0, A = +1: min(1.5, 1.28) = 1.28 (clipped); min(0.5, 0.8) = 0.5
    # row 1, A = -1: min(-0.7, -0.8) = -0.8 (clipped)
    assert loss_BT[MASK_BT].tolist() == pytest.approx([-1.28, -0.5, 0.8])
    assert clip_fraction.item() == pytest.approx(2 / 3)
    assert not clip_fraction.requires_grad
    # clipped tokens get no gradient; otherwise d(-r A)/d logp = -r A
    (loss_BT * MASK_BT).sum().backward()
    assert logprobs_BT.grad[MASK_BT].tolist() == pytest.approx([0.0, -0.5, 0.0])


def test_sequence_level_gspo_by_hand():
    logprobs_BT = logprobs()
    loss_BT, clip_fraction = clipped_surrogate(
        logprobs_BT, OLD_BT, ADVANTAGES_B, MASK_BT, EPS_LOW, EPS_HIGH, level="sequence"
    )
    # row 0: s = exp((log 1.5 + log 0.5) / 2) = sqrt(0.75), inside [0.8, 1.28]; row 1: s = 0.7, clipped to 0.8
    s0 = math.sqrt(1.5 * 0.5)
    assert loss_BT[MASK_BT].tolist() == pytest.approx([-s0, -s0, 0.8], rel=1e-6)
    assert clip_fraction.item() == pytest.approx(1 / 3)
    # GSPO-token form: every token of row 0 gets gradient -s A (not -s A / len)
    (loss_BT * MASK_BT).sum().backward()
    assert logprobs_BT.grad[MASK_BT].tolist() == pytest.approx([-s0, -s0, 0.0], rel=1e-6)


def test_sequence_level_with_grpo_aggregation_equals_the_gspo_sequence_objective():
    g = torch.Generator().manual_seed(0)
    old_BT = -torch.rand(4, 6, generator=g)
    mask_BT = torch.arange(6)[None, :] < torch.tensor([[3], [6], [2], [5]])
    mask_BT[:, 0] = False
    advantages_B = torch.randn(4, generator=g)
    ours = (old_BT + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_()
    direct = ours.detach().clone().requires_grad_()

    loss_BT, _ = clipped_surrogate(ours, old_BT, advantages_B, mask_BT, 0.2, 0.2, level="sequence")
    LOSS_AGGREGATIONS["grpo"].aggregate(loss_BT, mask_BT, torch.tensor(4)).backward()
    # Zheng et al. 2025, eq. 5-7: s_i = exp(mean_t log(pi / pi_old)), J = mean_i min(s_i A_i, clip(s_i) A_i)
    s_B = torch.exp(sequence_mean(direct - old_BT, mask_BT))
    (-torch.minimum(s_B * advantages_B, s_B.clamp(0.8, 1.2) * advantages_B).mean()).backward()

    torch.testing.assert_close(ours.grad, direct.grad)


def test_clipped_surrogate_rejects_unknown_level():
    with pytest.raises(ValueError, match="level"):
        clipped_surrogate(logprobs(), OLD_BT, ADVANTAGES_B, MASK_BT, EPS_LOW, EPS_HIGH, level="tokens")


def test_truncated_importance_weights_by_hand():
    # pi_old / pi_sampler per completion token: row 0 -> 0.5, 3.0 (capped at 2); row 1 -> 1.25; outside: 1
    sampler_BT = torch.tensor([[0.0, -1.0 - math.log(0.5), -2.0 - math.log(3.0)], [0.0, -0.5 - math.log(1.25), 0.0]])
    old_BT = OLD_BT.clone()
    old_BT[1, 2] = 500.0  # padding: exp would overflow; it must stay out of the weights and the metrics
    weights_BT, metrics = sampler_importance_weights(old_BT, sampler_BT, MASK_BT, "token_truncate", 2.0)
    assert weights_BT.flatten().tolist() == pytest.approx([1.0, 0.5, 2.0, 1.0, 1.25, 1.0], rel=1e-6)
    assert metrics["is_ratio"].item() == pytest.approx((0.5 + 3.0 + 1.25) / 3, rel=1e-6)
    assert metrics["is_capped_fraction"].item() == pytest.approx(1 / 3)
    # the weights scale the surrogate and carry no gradient of their own
    logprobs_BT = logprobs()
    loss_BT, _ = clipped_surrogate(logprobs_BT, OLD_BT, ADVANTAGES_B, MASK_BT, EPS_LOW, EPS_HIGH)
    weighted_BT = loss_BT * sampler_importance_weights(logprobs_BT.detach(), sampler_BT, MASK_BT, "token_truncate",
                                                       2.0)[0]
    (weighted_BT * MASK_BT).sum().backward()
    assert not weights_BT.requires_grad
    # row 0 token 2 (ratio 0.5, unclipped, A = +1): gradient -r A = -0.5 times its weight
    w = min(math.exp(float(logprobs_BT[0, 2]) - float(sampler_BT[0, 2])), 2.0)
    assert logprobs_BT.grad[0, 2].item() == pytest.approx(-0.5 * w, rel=1e-6)


def test_kl_penalty_is_added_per_token():
    loss_BT = torch.tensor([[0.0, 1.0, 2.0]])
    logprobs_BT = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]])
    ref_BT = torch.tensor([[0.0, math.log(0.25), math.log(0.4)]])
    new_loss_BT, kl_BT = add_kl_penalty(loss_BT, logprobs_BT, ref_BT, beta=0.04)
    kl = [0.0, 0.5 - 1 - math.log(0.5), 2.0 - 1 - math.log(2.0)]  # r - 1 - log r with r = ref / p
    assert kl_BT[0].tolist() == pytest.approx(kl, abs=1e-6)
    assert new_loss_BT[0].tolist() == pytest.approx([0.0 + 0.04 * kl[0], 1.0 + 0.04 * kl[1], 2.0 + 0.04 * kl[2]])


# --- aggregation -------------------------------------------------------------------------------------------------

LOSS_BT = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]])  # 9 = outside the completion, must not count
MAX_COMPLETION_LENGTH = 4


@pytest.mark.parametrize(
    "loss_type, count, value",
    [
        ("dapo", 3, (1 + 2 + 3) / 3),  # completion tokens
        ("grpo", 2, ((1 + 2) / 2 + 3 / 1) / 2),  # sequences
        ("dr_grpo", 2 * 4, (1 + 2 + 3) / (2 * 4)),  # sequences * max_completion_length
        ("bnpo", 1, (1 + 2 + 3) / 3 / 1),  # micro-batches
    ],
)
def test_aggregation_by_hand(loss_type, count, value):
    aggregation = LOSS_AGGREGATIONS[loss_type]
    normaliser = aggregation.count(MASK_BT, MAX_COMPLETION_LENGTH)
    assert normaliser.item() == count and normaliser.dtype == torch.int64
    assert aggregation.aggregate(LOSS_BT, MASK_BT, normaliser).item() == pytest.approx(value)


def random_step(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    loss_BT = torch.randn(B, T, generator=g).requires_grad_()
    lengths_B = torch.tensor([1, 6, 3, 2, 5, 4])
    mask_BT = (torch.arange(T)[None, :] >= 1) & (torch.arange(T)[None, :] <= lengths_B[:, None])
    return loss_BT, mask_BT


def step_loss(loss_type, loss_BT, mask_BT, splits):
    """What the loop does: sum the counts of all micro-batches, then add up each one's aggregate."""
    aggregation = LOSS_AGGREGATIONS[loss_type]
    parts = [(loss_BT[a:b], mask_BT[a:b]) for a, b in splits]
    normaliser = sum(aggregation.count(mask, MAX_COMPLETION_LENGTH) for _, mask in parts)
    return sum(aggregation.aggregate(loss, mask, normaliser) for loss, mask in parts)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("splits", [[(0, 2), (2, 6)], [(0, 1), (1, 3), (3, 6)]])
def test_aggregation_does_not_depend_on_micro_batching(loss_type, splits):
    loss_BT, mask_BT = random_step()
    whole = step_loss(loss_type, loss_BT, mask_BT, [(0, 6)])
    (whole_grad,) = torch.autograd.grad(whole, loss_BT)
    split = step_loss(loss_type, loss_BT, mask_BT, splits)
    (split_grad,) = torch.autograd.grad(split, loss_BT)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_grad, whole_grad)


def test_bnpo_is_the_mean_of_micro_batch_token_means():
    loss_BT, mask_BT = random_step()
    # rows [0, 3) and [3, 6) hold 1 + 6 + 3 = 10 and 2 + 5 + 4 = 11 completion tokens
    means = [(loss_BT[a:b] * mask_BT[a:b]).sum() / mask_BT[a:b].sum() for a, b in [(0, 3), (3, 6)]]
    torch.testing.assert_close(step_loss("bnpo", loss_BT, mask_BT, [(0, 3), (3, 6)]), (means[0] + means[1]) / 2)


def test_bnpo_does_not_depend_on_micro_batching_when_token_counts_are_equal():
    loss_BT, mask_BT = random_step()
    mask_BT = mask_BT[:4].clone()  # rows 0-1 hold 1 + 6 = 7 completion tokens; give rows 2-3 5 + 2 = 7 too
    mask_BT[2, 1:6] = True
    whole = step_loss("bnpo", loss_BT[:4], mask_BT, [(0, 4)])
    torch.testing.assert_close(step_loss("bnpo", loss_BT[:4], mask_BT, [(0, 2), (2, 4)]), whole)
