"""DAPO dynamic sampling: the group filter against the paper's definition and verl's filter_groups semantics (written
out below from its description, not copied), and the refill loop against hand-made draws."""

from __future__ import annotations

import collections
import signal

import numpy as np
import pytest
import torch

from posttrain.errors import RunStopped
from posttrain.online.dynamic_sampling import refill, varied_groups


def dapo_keeps(accuracy_G: list[float]) -> bool:
    """DAPO eq. 11's constraint: 0 < |{o_i : is_equivalent(a, o_i)}| < G."""
    return 0 < sum(accuracy_G) < len(accuracy_G)


def verl_filter_groups(generation_batches, prompt_batch_size: int, group: int, max_generation_batches: int):
    """verl's DAPO trainer, as its ray_trainer describes it: per generation batch, the metric of each trajectory is
    grouped by prompt uid; a uid is kept when np.std of its values > 0 or it has one trajectory; the kept
    trajectories are appended to the batch; while the kept prompts are fewer than the train batch it generates again
    (raising past max_num_gen_batches > 0); then the batch is cut to prompt_batch_size * n trajectories."""
    batch: list[tuple[str, float]] = []
    num_prompts = 0
    for num_gen_batches, (uids, values) in enumerate(generation_batches, start=1):
        by_uid = collections.defaultdict(list)
        for uid, value in zip(uids, values):
            by_uid[uid].append(value)
        kept_uids = {uid for uid, vals in by_uid.items() if np.std(vals) > 0 or len(vals) == 1}
        num_prompts += len(kept_uids)
        batch += [(uid, v) for uid, v in zip(uids, values) if uid in kept_uids]
        if num_prompts < prompt_batch_size:
            if max_generation_batches <= 0 or num_gen_batches < max_generation_batches:
                continue
            raise ValueError("generated too many")
        return batch[: prompt_batch_size * group], num_gen_batches
    raise AssertionError("ran out of generation batches")


def test_the_filter_is_dapos_definition_on_accuracies():
    group = 4
    rows = [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1]]
    got = varied_groups(torch.tensor(rows, dtype=torch.float32).flatten(), group).tolist()
    assert got == [dapo_keeps(r) for r in rows] == [False, False, True, True, True]


def test_the_filter_of_a_shaped_reward_differs_which_is_why_accuracy_is_the_default():
    # all four answers wrong, but one ran into the overlong buffer: the total reward varies, the accuracy does not
    accuracy_B = torch.tensor([0.0, 0.0, 0.0, 0.0])
    reward_B = accuracy_B + torch.tensor([0.0, 0.0, -0.25, 0.0])
    assert varied_groups(accuracy_B, 4).tolist() == [False] and varied_groups(reward_B, 4).tolist() == [True]


def test_nan_and_groups_of_one():
    assert varied_groups(torch.tensor([0.0, float("nan"), 1.0, 0.0]), 2).tolist() == [False, True]
    assert varied_groups(torch.tensor([1.0, 1.0, 0.0]), 1).tolist() == [True, True, True]  # verl: len == 1 is kept


@pytest.mark.parametrize("seed", range(6))
def test_refill_equals_verls_filter_groups_on_the_same_groups(seed):
    rng = np.random.default_rng(seed)
    group, prompts_per_batch, need = 4, 6, 6
    # generation batches of scores in {0, 0.5, 1} (often all equal), each prompt a unique uid
    batches = []
    for b in range(20):
        values = rng.choice([0.0, 0.5, 1.0], size=(prompts_per_batch, 1)).repeat(group, 1)
        values[rng.random(prompts_per_batch) < 0.4, rng.integers(group)] = 0.25  # some groups vary
        uids = [f"b{b}p{p}" for p in range(prompts_per_batch) for _ in range(group)]
        batches.append((uids, values.flatten().tolist()))
    expected, verl_batches = verl_filter_groups(batches, need, group, max_generation_batches=0)

    draws = iter(batches)

    def draw():
        uids, values = next(draws)
        groups = [(uids[i], values[i : i + group]) for i in range(0, len(uids), group)]
        return groups, torch.tensor(values)

    out = refill(need, draw, varied_groups, group, max_batches=0)
    assert [(uid, v) for uid, values in out.groups for v in values] == expected
    assert out.batches == verl_batches and out.fillers == 0
    assert out.drawn == verl_batches * prompts_per_batch


def test_max_batches_trains_on_what_there_is_with_fillers_and_says_so(caplog):
    group = 2
    draws = iter([(["a", "b", "c"], torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0])),   # a varies
                  (["d", "e", "f"], torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))])  # none does
    out = refill(3, lambda: next(draws), varied_groups, group, max_batches=2)
    assert out.groups == ["a", "b", "c"] and out.fillers == 2 and (out.kept, out.drawn, out.batches) == (1, 6, 2)
    assert "1 of the 3 prompt groups" in caplog.text and "max_batches" in caplog.text


def test_no_limit_stops_the_run_once_every_prompt_was_drawn():
    """max_batches=0 with a metric that never varies (a constant reward) drew forever, a run that never ended."""
    draws = []

    def draw():
        draws.append(1)
        return ["a", "b"], torch.tensor([1.0, 1.0, 0.0, 1.0] if len(draws) == 2 else [1.0] * 4)

    with pytest.raises(RunStopped, match=r"drew every prompt of the data once for this step \(3 generation batches\) "
                                         r"and 1 of the 2 prompt groups"):
        refill(2, draw, varied_groups, 2, max_batches=0, batches_per_pass=3)
    assert len(draws) == 3
    draws.clear()
    assert refill(1, draw, varied_groups, 2, max_batches=0, batches_per_pass=3).batches == 2  # full in time: trains


def test_every_rank_draws_while_any_is_short():
    calls = []
    draws = iter([(["a", "b"], torch.tensor([0.0, 1.0, 0.0, 1.0])), (["c", "d"], torch.tensor([0.0, 1.0] * 2))])
    # this rank is full after one draw, but another rank is short once more
    answers = iter([True, False])
    out = refill(2, lambda: next(draws), varied_groups, 2, max_batches=0,
                 short_anywhere=lambda short: calls.append(short) or next(answers))
    assert calls == [0, 0] and out.batches == 2 and out.groups == ["a", "b"] and out.kept == 4


def constant_draws(count):
    def draw():
        count.append(1)
        return ["a", "b"], torch.tensor([1.0] * 4)
    return draw


def test_a_high_max_batches_draws_at_most_one_pass_and_says_so_without_contradiction(caplog):
    """max_batches far above a pass with a metric that never varies drew for hours; now one pass, and the warning
    does not claim to train on groups it has none of."""
    count = []
    out = refill(2, constant_draws(count), varied_groups, 2, max_batches=10**9, batches_per_pass=3)
    assert len(count) == 3 and out.batches == 3 and out.kept == 0 and out.fillers == 2
    assert "0 of the 2 prompt groups" in caplog.text and "one pass over the data" in caplog.text
    assert "this step trains on nothing" in caplog.text and "training on them" not in caplog.text


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("max_batches", [0, 10**9])
def test_a_stop_signal_ends_the_draws_between_two_batches(signum, max_batches):
    count = []
    signals = iter([0, 0, signum])
    with pytest.raises(RunStopped, match=f"{signal.Signals(signum).name} while dynamic sampling drew") as stopped:
        refill(2, constant_draws(count), varied_groups, 2, max_batches=max_batches, batches_per_pass=None,
               stop_signal=lambda: next(signals))
    assert len(count) == 3 and stopped.value.exit_code == 128 + signum


def test_a_sampler_whose_whole_pass_varies_nowhere_stops_the_run():
    from posttrain.algorithms.grpo import DynamicSamplingConfig
    from posttrain.online.dynamic_sampling import DynamicSampler
    from posttrain.online.engine_link import Sample

    def draw(index, step):
        return Sample([[1]] * 4, [[2]] * 4, [[0.0]] * 4, [False] * 4, sampled_by=[None] * 4,
                      prompts=[{"prompt": "p", "columns": {}}] * 2, positions=[0, 1], dataset_index=[0, 1],
                      texts=["x"] * 4, total=[1.0] * 4, scored=[True] * 4)

    sampler = DynamicSampler(DynamicSamplingConfig(enabled=True, metric="reward", max_batches=50), 2, 2, draw,
                             lambda t: t, batches_per_pass=2)
    with pytest.raises(RunStopped, match="no prompt group varies: no step of this run can train"):
        sampler.fill(0, 0)


def test_a_second_signal_of_the_other_kind_acts_at_once():
    """SIGTERM, then Ctrl-C: the second gets the handler from before the run (it used to be recorded again)."""
    from types import SimpleNamespace

    from posttrain.train.guard import Guard

    seen = []
    before = {s: signal.signal(s, lambda n, f: seen.append(n)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with Guard(SimpleNamespace(nonfinite="stop", max_nonfinite_skips=0), SimpleNamespace(can_skip_steps=False)):
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            assert seen == [signal.SIGINT]
            raise KeyboardInterrupt  # leave without the after-the-last-step stop
    except KeyboardInterrupt:
        pass
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
