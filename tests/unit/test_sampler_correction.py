"""posttrain.losses.sampler_correction against the peers' formulas, written out here on randomised cases: TRL 1.16's
GRPOTrainer (`vllm_importance_sampling_mode`, trl/trainer/grpo_trainer.py, _generate_and_score_completions) and
verl's rollout correction (verl/trainer/ppo/rollout_corr_helper.py), and IcePop's two-sided token mask."""

import math

import pytest
import torch

from posttrain.losses.sampler_correction import SAMPLER_CORRECTIONS, correction_bounds, sampler_importance_weights


def trl_weights(old_BT, sampler_BT, mask_BT, mode, clip_max, clip_min):
    """TRL 1.16: diff = (old - sampling) * mask, NaN -> 0; sequence modes sum it over the row; ratio = exp(diff);
    *_truncate: clamp(ratio, clip_min, clip_max); *_mask: ratio set to 0 outside [clip_min or -inf, clip_max or inf].
    The per-token loss is multiplied by the ratio (a (B, 1) ratio broadcasts over the row)."""
    diff_BT = torch.nan_to_num((old_BT - sampler_BT) * mask_BT, nan=0.0)
    diff = diff_BT.sum(-1, keepdim=True) if mode.startswith("sequence") else diff_BT
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max).expand_as(old_BT)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0).expand_as(old_BT)


def verl_weights(old_BT, rollout_BT, mask_BT, level, threshold, threshold_lower=None, reject=False):
    """verl: log_ratio = old - rollout; token: itself, sequence: masked sum over the row, geometric: masked mean;
    clamped to [-20, 20] then exp. IS (compute_rollout_correction_weights): weights * mask, clamp(max=threshold).
    RS (compute_rollout_rejection_mask): keep where lower <= w <= upper (lower defaults to 1 / upper)."""
    log_ratio = old_BT - rollout_BT
    if level == "sequence":
        log_ratio = (log_ratio * mask_BT).sum(-1, keepdim=True)
    elif level == "geometric":
        log_ratio = (log_ratio * mask_BT).sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True)
    w = torch.exp(torch.clamp(log_ratio, -20.0, 20.0)).expand_as(old_BT)
    if not reject:
        return (w * mask_BT).clamp(max=threshold)
    lower = threshold_lower if threshold_lower is not None else 1.0 / threshold
    return ((w >= lower) & (w <= threshold)).float()


def random_case(seed, spread):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    old_BT = -torch.rand(B, T, generator=g) * 3
    sampler_BT = old_BT + torch.randn(B, T, generator=g) * spread
    lengths = torch.randint(1, T, (B,), generator=g)
    mask_BT = (torch.arange(T)[None, :] >= 1) & (torch.arange(T)[None, :] <= lengths[:, None])
    return old_BT, sampler_BT, mask_BT.float()


CASES = [(seed, spread, clip_max, clip_min) for seed in range(4) for spread in (0.05, 0.4)
         for clip_max, clip_min in ((2.0, None), (3.0, 0.5), (1.2, 0.9))]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("seed,spread,clip_max,clip_min", CASES)
def test_trl_modes_equal_trl(mode, seed, spread, clip_max, clip_min):
    old_BT, sampler_BT, mask_BT = random_case(seed, spread)
    ours, _ = sampler_importance_weights(old_BT, sampler_BT, mask_BT, mode, clip_max, clip_min)
    theirs = trl_weights(old_BT, sampler_BT, mask_BT, mode, clip_max, clip_min)
    inside = mask_BT.bool()  # outside the completion TRL's weight meets a zero mask; ours is 1
    torch.testing.assert_close(ours[inside], theirs[inside], rtol=1e-5, atol=1e-7)
    assert (ours[~inside] == 1).all()


@pytest.mark.parametrize("seed,spread,clip_max,clip_min", CASES)
def test_icepop_is_trl_token_mask_with_both_bounds(seed, spread, clip_max, clip_min):
    old_BT, sampler_BT, mask_BT = random_case(seed, spread)
    ours, metrics = sampler_importance_weights(old_BT, sampler_BT, mask_BT, "icepop", clip_max, clip_min)
    lower = clip_min if clip_min is not None else 1.0 / clip_max  # two-sided without a given lower bound
    theirs = trl_weights(old_BT, sampler_BT, mask_BT, "token_mask", clip_max, lower)
    inside = mask_BT.bool()
    torch.testing.assert_close(ours[inside], theirs[inside], rtol=1e-5, atol=1e-7)
    assert metrics["is_masked_fraction"].item() == pytest.approx(float((theirs[inside] == 0).float().mean()))


@pytest.mark.parametrize("seed,spread", [(s, sp) for s in range(4) for sp in (0.05, 0.4, 3.0)])
@pytest.mark.parametrize("threshold", [1.5, 2.0, 5.0])
def test_verl_levels_equal_verl(seed, spread, threshold):
    old_BT, sampler_BT, mask_BT = random_case(seed, spread)
    inside = mask_BT.bool()
    for mode, level in (("token_truncate", "token"), ("sequence_truncate", "sequence")):
        ours, _ = sampler_importance_weights(old_BT, sampler_BT, mask_BT, mode, threshold)
        torch.testing.assert_close(ours[inside], verl_weights(old_BT, sampler_BT, mask_BT, level, threshold)[inside],
                                   rtol=1e-5, atol=1e-7)
    # verl's rejection sampling: kept where lower <= w <= upper (lower 1 / upper); ours keeps rho there, 0 elsewhere
    for mode, level in (("icepop", "token"), ("sequence_mask", "sequence"), ("geometric_mask", "geometric")):
        low = 1.0 / threshold
        ours, _ = sampler_importance_weights(old_BT, sampler_BT, mask_BT, mode, threshold, low)
        kept = verl_weights(old_BT, sampler_BT, mask_BT, level, threshold, low, reject=True)
        assert torch.equal((ours[inside] != 0).float(), kept[inside]), mode


def test_metrics_count_capped_and_masked_tokens_by_hand():
    # one row, three completion tokens with rho = 0.25, 1.0, 4.0; bounds [0.5, 2]
    old_BT = torch.tensor([[0.0, math.log(0.25), 0.0, math.log(4.0)]])
    sampler_BT = torch.zeros(1, 4)
    mask_BT = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    truncated, m = sampler_importance_weights(old_BT, sampler_BT, mask_BT, "token_truncate", 2.0, 0.5)
    assert truncated[0].tolist() == pytest.approx([1.0, 0.5, 1.0, 2.0])
    assert m["is_capped_fraction"].item() == pytest.approx(2 / 3) and m["is_masked_fraction"].item() == 0
    assert m["is_ratio"].item() == pytest.approx((0.25 + 1 + 4) / 3)
    masked, m = sampler_importance_weights(old_BT, sampler_BT, mask_BT, "icepop", 2.0)  # low = 1 / 2
    assert masked[0].tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0])
    assert m["is_masked_fraction"].item() == pytest.approx(2 / 3) and m["is_capped_fraction"].item() == 0
    # the product 0.25 * 1 * 4 = 1 is inside the bounds: the whole row keeps weight 1; the geometric mean too
    for mode in ("sequence_mask", "geometric_mask"):
        assert sampler_importance_weights(old_BT, sampler_BT, mask_BT, mode, 2.0, 0.5)[0][0].tolist() == \
            pytest.approx([1.0] * 4)


def test_nan_sampler_logprob_counts_as_ratio_one_and_huge_ratios_stay_finite():
    old_BT = torch.tensor([[0.0, -1.0, -1.0, 0.0]])
    sampler_BT = torch.tensor([[0.0, float("nan"), -80.0, 0.0]])  # rho = exp(79): clamped at exp(20) first
    mask_BT = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    for mode in SAMPLER_CORRECTIONS:
        weights, metrics = sampler_importance_weights(old_BT, sampler_BT, mask_BT, mode, 2.0)
        assert torch.isfinite(weights).all() and all(torch.isfinite(v) for v in metrics.values()), mode
    assert sampler_importance_weights(old_BT, sampler_BT, mask_BT, "token_mask", 2.0)[0][0, 1:3].tolist() == [1, 0]


def test_bounds_of_each_mode():
    assert correction_bounds("token_mask", 3.0, None) == (0.0, 3.0)
    assert correction_bounds("icepop", 5.0, None) == (0.2, 5.0)
    assert correction_bounds("icepop", 5.0, 0.5) == (0.5, 5.0)
    assert correction_bounds("token_truncate", None, 0.5) == (0.5, math.inf)
