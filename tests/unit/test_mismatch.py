"""Trainer-engine mismatch figures (ops/mismatch.py, online/mismatch.py) against hand-worked numbers; the report
draws them and the console shows mismatch/k3, so a run that stops logging them fails here."""

import math

import pytest
import torch

from posttrain.batch import Batch
from posttrain.online.mismatch import _local, engine_mismatch
from posttrain.ops.mismatch import mismatch_figures
from posttrain.report.write import plan_charts
from posttrain.rundir.metrics import MetricsLogger

MISMATCH_KEYS = {"mismatch/logprob_diff/mean", "mismatch/logprob_diff/p50", "mismatch/logprob_diff/p99",
                 "mismatch/logprob_diff/max", "mismatch/k3", "mismatch/is_ratio/p1", "mismatch/is_ratio/p50",
                 "mismatch/is_ratio/p99"}


def test_figures_by_hand():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    sampler = torch.tensor([-1.1, -2.0, -0.2, -3.5])
    d = [0.1, 0.0, -0.3, 0.5]  # trainer - sampler; |d| sorted: 0, .1, .3, .5
    figures = {k: float(v) for k, v in mismatch_figures(trainer, sampler).items()}
    assert set(figures) == MISMATCH_KEYS
    assert figures["mismatch/logprob_diff/mean"] == pytest.approx(0.9 / 4, rel=1e-5)
    assert figures["mismatch/logprob_diff/p50"] == pytest.approx(0.2, rel=1e-5)  # between .1 and .3
    assert figures["mismatch/logprob_diff/p99"] == pytest.approx(0.3 + 0.97 * 0.2, rel=1e-5)
    assert figures["mismatch/logprob_diff/max"] == pytest.approx(0.5, rel=1e-5)
    # KL(engine || trainer) by k3 with r = pi_trainer / pi_engine: r - 1 - log r
    assert figures["mismatch/k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4, rel=1e-4)
    ratios = sorted(math.exp(x) for x in d)  # exp(-.3), 1, exp(.1), exp(.5)
    assert figures["mismatch/is_ratio/p50"] == pytest.approx((1 + math.exp(0.1)) / 2, rel=1e-5)
    assert figures["mismatch/is_ratio/p1"] == pytest.approx(ratios[0] + 0.03 * (ratios[1] - ratios[0]), rel=1e-5)
    assert mismatch_figures(torch.zeros(0), torch.zeros(0)) == {}
    # at a synced engine's 1e-5 nats k3 ~ d^2 / 2 = 5e-11 keeps its digits (exp(d) - 1 - d in float32 would not)
    tiny = mismatch_figures(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0 - 1e-5, -2.0 + 1e-5]))["mismatch/k3"]
    assert float(tiny) == pytest.approx(0.5e-10, rel=5e-2)


def batch(old_BT, sampler_BT, mask_BT, advantages_B) -> Batch:
    return Batch(input_ids_BT=torch.zeros(old_BT.shape, dtype=torch.long), completion_mask_BT=mask_BT,
                 old_logprobs_BT=old_BT, sampler_logprobs_BT=sampler_BT, advantages_B=advantages_B)


def test_step_figures_gather_every_rank_and_count_phantom_clipping():
    # rank 0: row 0 (A = +1) rho = 1.5 (clipped above 1.2), 0.5 (A > 0: the unclipped branch is the smaller, kept);
    #         row 1 (A = -1) rho = 0.5 (clipped below 0.8), and a padded position that must not count
    log = math.log
    rank0 = batch(torch.tensor([[0.0, log(1.5), log(0.5)], [0.0, log(0.5), 7.0]]), torch.zeros(2, 3),
                  torch.tensor([[0, 1, 1], [0, 1, 0]]), torch.tensor([1.0, -1.0]))
    # rank 1: one token with rho = 1 (no mismatch, not clipped)
    rank1 = batch(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -1.0]]), torch.tensor([[0, 1]]),
                  torch.tensor([1.0]))
    other = _local([rank1], (0.2, 0.2))
    figures = engine_mismatch([rank0], (0.2, 0.2), lambda mine: [mine, other])
    assert figures["mismatch/phantom_clip_fraction"] == pytest.approx(2 / 4)
    gaps = [log(1.5), -log(0.5), -log(0.5), 0.0]
    assert figures["mismatch/logprob_diff/max"] == pytest.approx(max(gaps), rel=1e-5)
    assert figures["mismatch/logprob_diff/mean"] == pytest.approx(sum(gaps) / 4, rel=1e-5)
    # a batch without the trainer's log-probs (the policy samples itself) gives no figure
    plain = Batch(input_ids_BT=torch.zeros(1, 2, dtype=torch.long), completion_mask_BT=torch.tensor([[0, 1]]))
    assert engine_mismatch([plain], (0.2, 0.2), lambda mine: [mine]) == {}


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_report_draws_the_mismatch_chart(command):
    keys = {"reward/mean", "loss", "clip_fraction", "mismatch/phantom_clip_fraction"} | MISMATCH_KEYS
    key_charts, _, rest = plan_charts([command], keys, constants=set())
    chart = next(c for c in key_charts if c.title == "trainer vs engine log-probs")
    assert set(chart.keys) == {"mismatch/logprob_diff/mean", "mismatch/logprob_diff/p99", "mismatch/k3",
                               "mismatch/phantom_clip_fraction"}


def test_console_line_shows_the_mismatch(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), 2, 0, True)
    logger.bar.disable = True  # a log file: one plain line per logging step
    logger.log(1, {"loss": 0.5, "mismatch/k3": 1.25e-5})
    logger.close()
    assert "mismatch/k3=1.25e-05" in capsys.readouterr().out
