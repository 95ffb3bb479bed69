"""RewardSet: weights, missing values, error policy, timeouts, output validation; reward_metrics."""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time

import pytest
import torch

from posttrain.errors import UserError
from posttrain.rewards.combine import Reward, RewardError, RewardSet, reward_metrics

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Say hi."]
COMPLETIONS = ["4", "blue", "hello there"]


def constant(value):
    return lambda prompts, completions, **columns: [value] * len(completions)


def by_length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def fails_on_blue(prompts, completions, **columns):
    for c in completions:
        if c == "blue":
            raise ValueError("cannot score colours")
    return [1.0] * len(completions)


def test_weighted_total():
    rewards = RewardSet([Reward("one", constant(1.0), 0.5), Reward("len", by_length, 2.0)])
    total, per_function, skipped, _ = rewards.score(PROMPTS, COMPLETIONS)
    # 0.5 * 1 + 2 * len: 0.5 + 2, 0.5 + 8, 0.5 + 22
    assert total.tolist() == [2.5, 8.5, 22.5]
    assert per_function["one"].tolist() == [1.0, 1.0, 1.0]
    assert per_function["len"].tolist() == [1.0, 4.0, 11.0]
    assert skipped == 0
    assert total.dtype == torch.float32 and rewards.names == ["one", "len"]


def test_none_counts_as_missing_and_zero():
    def some_none(prompts, completions, **columns):
        return [1.0, None, 3]

    total, per_function, skipped, _ = RewardSet([("a", some_none, 2.0, 5.0, "raise"), ("b", constant(True), 1.0)]).score(
        PROMPTS, COMPLETIONS
    )
    assert total.tolist() == [3.0, 1.0, 7.0]
    assert per_function["a"][1].isnan() and per_function["b"].tolist() == [1.0, 1.0, 1.0]
    assert skipped == 1


def test_columns_are_passed_aligned():
    seen = {}

    def wants_answer(prompts, completions, answer):  # no **columns: gets only what it names
        seen["answer"] = answer
        return [float(c == a) for c, a in zip(completions, answer)]

    columns = {"answer": ["4", "red", "hi"], "source": ["x", "y", "z"]}
    total, _, _, _ = RewardSet([Reward("match", wants_answer)]).score(PROMPTS, COMPLETIONS, columns)
    assert total.tolist() == [1.0, 0.0, 0.0] and seen["answer"] == columns["answer"]
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3"):
        RewardSet([Reward("match", wants_answer)]).score(PROMPTS, COMPLETIONS, {"answer": ["4", "red"]})


def test_raise_names_function_and_sample():
    rewards = RewardSet([Reward("colour_check", fails_on_blue, on_error="raise")])
    with pytest.raises(RewardError) as info:
        rewards.score(PROMPTS, COMPLETIONS)
    message = str(info.value)
    assert "reward 'colour_check' raised ValueError: cannot score colours on sample 1" in message
    assert "Name a colour." in message and "'blue'" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert not isinstance(info.value, UserError)


def test_skip_makes_the_batch_missing():
    rewards = RewardSet([Reward("colour_check", fails_on_blue, 1.0, on_error="skip"), Reward("one", constant(1.0))])
    total, per_function, skipped, _ = rewards.score(PROMPTS, COMPLETIONS)
    assert per_function["colour_check"].isnan().all()
    assert total.tolist() == [1.0, 1.0, 1.0]
    assert skipped == 3


def test_timeout_raise_and_skip():
    release = threading.Event()

    def slow(prompts, completions, **columns):
        release.wait(5)
        return [1.0] * len(completions)

    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"reward 'slow' did not return within 0.2s on a batch of 3"):
            RewardSet([Reward("slow", slow, timeout=0.2)]).score(PROMPTS, COMPLETIONS)
        assert time.monotonic() - start < 2
        total, per_function, skipped, _ = RewardSet(
            [Reward("slow", slow, timeout=0.2, on_error="skip"), Reward("one", constant(1.0), 3.0)]
        ).score(PROMPTS, COMPLETIONS)
        assert per_function["slow"].isnan().all() and total.tolist() == [3.0, 3.0, 3.0] and skipped == 3
    finally:
        release.set()


def test_functions_run_concurrently():
    """Two 0.5 s functions with 0.9 s timeouts both finish: they do not wait for each other."""

    def sleepy(prompts, completions, **columns):
        time.sleep(0.5)
        return [1.0] * len(completions)

    total, _, skipped, _ = RewardSet([Reward("a", sleepy, timeout=0.9), Reward("b", sleepy, timeout=0.9)]).score(
        PROMPTS, COMPLETIONS
    )
    assert total.tolist() == [2.0, 2.0, 2.0] and skipped == 0


def test_function_raising_its_own_timeout_error_is_an_error_not_a_timeout():
    def network(prompts, completions, **columns):
        raise TimeoutError("verifier service timed out")

    with pytest.raises(RewardError, match="raised TimeoutError: verifier service timed out on sample 0"):
        RewardSet([Reward("net", network)]).score(PROMPTS, COMPLETIONS)


def test_user_error_propagates_even_when_skipping():
    def needs_column(prompts, completions, **columns):
        raise UserError("the data has no 'answer' column")

    with pytest.raises(UserError, match="no 'answer' column"):
        RewardSet([Reward("m", needs_column, on_error="skip")]).score(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize(
    "output, message",
    [
        ([1.0, 2.0], "returned 2 values for 3 completions"),
        ([1.0, "good", 0.0], "returned 'good' for sample 1"),
        ([1.0, math.inf, 0.0], "returned inf for sample 1"),
        (1.0, "returned a float"),
        ("abc", "returned a str"),
    ],
)
def test_bad_output_is_a_reward_error_even_when_skipping(output, message):
    rewards = RewardSet([Reward("bad", lambda p, c, **k: output, on_error="skip")])
    with pytest.raises(RewardError, match=f"reward 'bad' {message}"):
        rewards.score(PROMPTS, COMPLETIONS)


def test_tensor_output_and_none_are_accepted():
    total, per_function, skipped, _ = RewardSet(
        [Reward("t", lambda p, c, **k: torch.tensor([1.0, 3.0, 2.0]))]
    ).score(PROMPTS, COMPLETIONS)
    assert total.tolist() == [1.0, 3.0, 2.0] and skipped == 0
    total, _, skipped, _ = RewardSet([Reward("n", lambda p, c, **k: [1.0, None, 2.0])]).score(PROMPTS, COMPLETIONS)
    assert total.tolist() == [1.0, 0.0, 2.0] and skipped == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.tensor(float("nan")).item()])
def test_nan_or_inf_is_an_error_naming_the_sample_never_a_silent_zero(bad):
    reward = Reward("t", lambda p, c, **k: torch.tensor([1.0, bad, 2.0]))
    with pytest.raises(RewardError, match=r"reward 't' returned (nan|inf) for sample 1 \(prompt: 'Name a colour.'\)"):
        RewardSet([reward]).score(PROMPTS, COMPLETIONS)


def test_wrong_count_or_type_names_the_batch():
    with pytest.raises(RewardError, match=r"returned 2 values for 3 completions \(first prompt: 'What is 2 \+ 2\?'\)"):
        RewardSet([Reward("t", lambda p, c, **k: [1.0, 2.0])]).score(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match=r"returned a float for a batch of 3 \(first prompt"):
        RewardSet([Reward("t", lambda p, c, **k: 1.0)]).score(PROMPTS, COMPLETIONS)


def test_sys_exit_in_a_reward_is_a_failure_naming_the_sample():
    def exits_on_blue(prompts, completions, **columns):
        if "blue" in completions:
            raise SystemExit(0)
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward 'x' called sys.exit\(0\) on sample 1 \(prompt: 'Name a colour.'") as e:
        RewardSet([Reward("x", exits_on_blue)]).score(PROMPTS, COMPLETIONS)
    assert "exits_on_blue" in e.value.user_traceback and "SystemExit: 0" in e.value.user_traceback


def exit_on_blue(how: str):
    """A reward, sync or async, that exits on the sample 'blue' by sys.exit or os._exit (code 7: were the guard gone,
    os._exit would end pytest itself, and with 7, not a silent 0)."""
    def score(completions, **kwargs):
        if "blue" in completions:
            sys.exit(7) if how.endswith("sys.exit") else os._exit(7)
        return [1.0] * len(completions)

    async def score_async(completions, **kwargs):
        return score(completions)

    return score_async if how.startswith("async") else score


@pytest.mark.parametrize("how", ["sync os._exit", "async os._exit", "async sys.exit"])
def test_an_exit_in_a_reward_sync_or_async_names_the_function_and_sample(how):
    """An async reward runs on the event loop every async reward shares: os._exit there ended the process with no
    word, sys.exit stopped the loop (reported as a timeout, and every later async reward timed out too)."""
    call = how.split()[1]
    with pytest.raises(RewardError, match=rf"reward 'x' called {call}\(7\) on sample 1 \(prompt: 'Name a colour.'") as e:
        RewardSet([Reward("x", exit_on_blue(how), timeout=10)]).score(PROMPTS, COMPLETIONS)
    assert "score" in e.value.user_traceback
    async def still_scored(completions, **kwargs):
        return [0.5] * len(completions)

    assert RewardSet([Reward("y", still_scored, timeout=10)]).score(PROMPTS, COMPLETIONS).total_B.tolist() == [0.5] * 3


def test_construction_checks():
    with pytest.raises(ValueError, match="unique, a repeats"):
        RewardSet([Reward("a", by_length), Reward("a", by_length)])
    with pytest.raises(ValueError, match="on_error must be raise or skip"):
        RewardSet([Reward("a", by_length, on_error="ignore")])
    with pytest.raises(ValueError, match="timeout must be > 0"):
        RewardSet([Reward("a", by_length, timeout=0)])
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        RewardSet([Reward("a", by_length)]).score(PROMPTS[:2], COMPLETIONS)


def test_reward_metrics_are_nan_aware():
    metrics = reward_metrics(
        {"a": torch.tensor([1.0, float("nan"), 3.0]), "b": torch.tensor([2.0, 2.0]), "c": torch.tensor([float("nan")])}
    )
    assert metrics["rewards/a/mean"].item() == 2.0 and metrics["rewards/a/std"].item() == 1.0  # population std
    assert metrics["rewards/b/mean"].item() == 2.0 and metrics["rewards/b/std"].item() == 0.0
    assert metrics["rewards/c/mean"].isnan() and metrics["rewards/c/std"].isnan()
    assert all(v.dim() == 0 and v.dtype == torch.float32 for v in metrics.values())


def test_user_code_gets_copies_so_a_reward_cannot_change_what_is_trained_or_what_others_see():
    """A reward that edits what it is handed (ids[:] = ..., ids.pop(), completions.clear(), a message's content, a
    column) changes only its own copy: the trained ids stay the engine's, the next reward sees the batch as sampled."""
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    ids = [[1, 2, 3], [4, 5], [6]]
    columns = {"answer": [["4"], ["red"], ["hi"]]}
    seen = {}

    def vandal(prompts, completions, completion_ids, answer, **kwargs):
        for row in completion_ids:
            row[:] = [0] * len(row)
        completion_ids[0].pop()
        prompts[0][0]["content"] = "edited"
        completions[1][0]["content"] = "edited"
        answer[2].append("extra")
        completions.clear()
        return [1.0, 1.0, 1.0]

    def reader(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        return [float(len(c)) for c in completions]

    rewards = RewardSet([Reward("vandal", vandal), Reward("reader", reader)])
    scores = rewards.score(prompts, completions, columns, ids)
    assert ids == [[1, 2, 3], [4, 5], [6]]
    assert prompts[0][0]["content"] == PROMPTS[0] and completions[1][0]["content"] == COMPLETIONS[1]
    assert columns == {"answer": [["4"], ["red"], ["hi"]]}
    assert seen == {"prompts": prompts, "completions": completions, "ids": ids, "answer": columns["answer"]}
    assert scores.per_function["reader"].tolist() == [1.0, 1.0, 1.0]


def test_the_one_sample_reruns_that_name_a_failure_get_copies_too():
    ids = [[1, 2], [3, 4], [5, 6]]

    def pops_then_fails(prompts, completions, completion_ids, **kwargs):
        for row in completion_ids:
            row.pop()
        if any(c == "blue" for c in completions):
            raise ValueError("cannot score colours")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="on sample 1"):
        RewardSet([Reward("pops", pops_then_fails)]).score(PROMPTS, COMPLETIONS, None, ids)
    assert ids == [[1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("value", [1e39, -1e39, 10**45, 3.5e38])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_reward_finite_in_float64_but_inf_in_float32_is_named(value, on_error):
    """1e39 is a finite Python float and inf in the float32 rewards: its group's advantages would be 0, loss 0."""
    def huge(prompts, completions, **kwargs):
        return [1.0, value, 2.0]

    with pytest.raises(RewardError, match=r"reward 'huge' returned .* for sample 1 .* which is inf in torch.float32"):
        RewardSet([Reward("huge", huge, on_error=on_error)]).score(PROMPTS, COMPLETIONS)


def test_a_group_of_rewards_below_the_limit_gets_finite_nonzero_advantages():
    """1e19 passes the reward checks: the advantages the GRPO family computes from it are finite and not all 0."""
    from posttrain.ops.advantages import group_advantages

    scores = RewardSet([Reward("edge", by_length, 1e18)]).score(PROMPTS, COMPLETIONS)
    advantages = group_advantages(scores.total_B, 3)
    assert advantages.isfinite().all() and advantages.abs().max() > 0.5


def test_a_weight_float32_cannot_hold_or_a_weighted_sum_that_overflows_is_named():
    with pytest.raises(ValueError, match="reward 'one': weight 1e\\+39 is not a finite torch.float32"):
        RewardSet([Reward("one", constant(1.0), 1e39)])
    rewards = RewardSet([Reward("big", constant(1e20), 1e20), Reward("one", constant(1.0))])
    with pytest.raises(RewardError, match=r"weighted reward of sample 0 .* is inf \('big' 1e\+20 x weight 1e\+20, "
                                          r"'one' 1 x weight 1\), beyond 1.8e\+19"):
        rewards.score(PROMPTS, COMPLETIONS)
    # finite in float32, but the group's variance squares it: an inf std made every advantage 0
    with pytest.raises(RewardError, match=r"is 1e\+20 \('big' 1e\+20 x weight 1\), beyond 1.8e\+19, whose square "
                                          r"\(the group's variance\) is inf in torch.float32"):
        RewardSet([Reward("big", constant(1e20))]).score(PROMPTS, COMPLETIONS)
    assert RewardSet([Reward("fine", constant(1e19))]).score(PROMPTS, COMPLETIONS).total_B.isfinite().all()


def test_log_metric_refuses_a_value_float32_cannot_hold():
    def logs(prompts, completions, log_metric, **kwargs):
        log_metric("mine", 1e39)
        return [1.0] * len(completions)

    with pytest.raises(UserError, match=r"log_metric\('mine', 1e\+39\); the value must be a finite number that "
                                        "float32 holds"):
        RewardSet([Reward("logs", logs)]).score(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize("order", ["victim_first", "culprit_first"])
def test_an_async_reward_that_blocks_the_shared_loop_is_named_not_the_one_it_starved(order):
    import asyncio

    async def polite(completions, **kwargs):
        await asyncio.sleep(0.05)
        return [1.0] * len(completions)

    async def blocking(completions, **kwargs):
        time.sleep(2.0)  # holds the event loop every async reward shares
        return [1.0] * len(completions)

    rewards = [Reward("polite", polite, timeout=1.0), Reward("blocking", blocking, timeout=5.0)]
    if order == "culprit_first":  # polite is waited for after blocking returned: it may well have finished by then
        rewards.reverse()
    try:
        RewardSet(rewards).score(PROMPTS, COMPLETIONS)
    except RewardError as e:  # never "polite did not return" alone: the message names the one that held the loop
        assert re.search(r"reward 'polite' did not return within 1s because reward 'blocking' held the shared event "
                         r"loop for \d\.\ds without awaiting", str(e)), e
    else:
        assert order == "culprit_first"
    time.sleep(0.5)  # the loop is free again for the next test
