"""TRL's reward-function contract (posttrain/rewards/contract.py) as RewardSet.score serves it: keyword calls, the
dataset's shapes, columns, trainer_state, log_extra / log_metric, async functions, None, and errors naming the
sample."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from posttrain.config.load import load_recipe
from posttrain.algorithms.grpo import GRPOAlgoConfig
from posttrain.errors import UserError
from posttrain.rewards import RewardSet, TrainerState, as_completions, trainer_state
from posttrain.rewards.builtin import exact_match, format_reward, length_penalty
from posttrain.rewards.combine import Reward, RewardError

STANDARD = ["What is 2 + 2?", "Name a colour."]
CHAT = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "Name a colour."}]]
TEXTS = ["<think>add</think><answer>4</answer>", "blue"]
IDS = [[5, 6, 7], [8]]


def test_called_by_keyword_with_every_argument_of_the_contract():
    seen = {}

    def keyword_only(*, prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, state=trainer_state,
                    answer=answer, rest=sorted(kwargs), loggers=(callable(log_extra), callable(log_metric)))
        return [1.0] * len(completions)

    state = TrainerState(global_step=7, epoch=0.5)
    columns = {"answer": ["4", "red"], "task": ["math", "words"], "completion": ["x", "y"], "completion_ids": [0, 0]}
    RewardSet([Reward("k", keyword_only)]).score(STANDARD, TEXTS, columns, IDS, state)
    assert seen["prompts"] == STANDARD and seen["completions"] == TEXTS and seen["completion_ids"] == IDS
    assert seen["state"].global_step == 7 and seen["state"].epoch == 0.5
    assert seen["answer"] == ["4", "red"] and seen["loggers"] == (True, True)
    assert seen["rest"] == ["task"]  # the dataset's own completion / completion_ids columns are not passed, as in TRL


def test_completions_take_the_dataset_shape():
    assert as_completions(STANDARD, TEXTS) == TEXTS
    assert as_completions(CHAT, TEXTS) == [[{"role": "assistant", "content": t}] for t in TEXTS]

    def trl_format(completions, **kwargs):  # TRL's docs: conversational completions are message lists
        return [float(c[0]["content"].startswith("<think>")) for c in completions]

    scores = RewardSet([Reward("fmt", trl_format)]).score(CHAT, as_completions(CHAT, TEXTS), {}, IDS)
    assert scores.total_B.tolist() == [1.0, 0.0]


def test_a_function_names_only_what_it_takes():
    def wants(completions, answer):  # no **kwargs: nothing else is passed
        return [float(c == a) for c, a in zip(completions, answer)]

    assert RewardSet([Reward("w", wants)]).score(STANDARD, ["4", "x"], {"answer": ["4", "red"], "task": [1, 2]},
                                                 IDS).total_B.tolist() == [1.0, 0.0]


def test_trl_length_example_reads_completion_ids():
    def reward_len(completion_ids, **kwargs):  # one positional parameter: still a keyword call
        return [float(len(ids)) for ids in completion_ids]

    assert RewardSet([Reward("len", reward_len)]).score(STANDARD, TEXTS, None, IDS).total_B.tolist() == [3.0, 1.0]


def test_columns_first_is_still_a_keyword_call():
    def by_columns(answer, task, **kwargs):  # two positional parameters, both columns: TRL's keyword call
        return [float(t == "math" and a == "4") for a, t in zip(answer, task)]

    scores = RewardSet([Reward("c", by_columns)]).score(STANDARD, TEXTS, {"answer": ["4", "4"], "task": ["math", "x"]})
    assert scores.total_B.tolist() == [1.0, 0.0]


def test_earlier_positional_contract_is_served_and_told_once(caplog):
    with caplog.at_level(logging.INFO, logger="posttrain.rewards.contract"):
        rewards = RewardSet([Reward("old", lambda p, c, **columns: [float(len(p[i]) + len(c[i])) for i in range(2)])])
        assert rewards.score(["ab", "c"], ["x", "yz"]).total_B.tolist() == [3.0, 3.0]
        rewards.score(CHAT, as_completions(CHAT, TEXTS))
        rewards.score(CHAT, as_completions(CHAT, TEXTS))
    said = [r.getMessage() for r in caplog.records]
    assert sum("takes (p, c) by position" in m for m in said) == 1
    assert sum("each completion is now a list of messages" in m for m in said) == 1, said


def test_trainer_state_counts_steps_and_epochs(tmp_path):
    recipe = load_recipe(None, ["data.train=a.jsonl", "rewards=[{name: exact_match}]", "train.max_steps=30",
                                "train.logging_steps=5", "train.per_device_train_batch_size=8"], GRPOAlgoConfig)
    state = trainer_state(recipe, global_step=12, max_steps=30, steps_per_epoch=8, is_main=True)
    assert (state.global_step, state.max_steps, state.logging_steps, state.train_batch_size) == (12, 30, 5, 8)
    assert state.epoch == pytest.approx(1.5) and state.num_train_epochs == pytest.approx(3.75)
    assert state.is_world_process_zero


def test_async_functions_run_together_on_one_loop():
    loops = []

    async def slow(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.4)
        return [1.0] * len(completions)

    async def slow_none(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.4)
        return [None, 2.0]

    started = time.monotonic()
    scores = RewardSet([Reward("a", slow), Reward("b", slow_none)]).score(STANDARD, TEXTS)
    assert time.monotonic() - started < 0.75  # together: 0.4 s, not 0.8 s
    assert scores.total_B.tolist() == [1.0, 3.0] and scores.skipped == 1
    assert loops[0] is loops[1]


def test_async_timeout_and_error_name_the_function_and_sample():
    async def stuck(completions, **kwargs):
        await asyncio.sleep(10)

    with pytest.raises(RewardError, match="reward 'stuck' did not return within 0.2s"):
        RewardSet([Reward("stuck", stuck, timeout=0.2)]).score(STANDARD, TEXTS)

    async def fails_on_blue(completions, **kwargs):
        if "blue" in completions:
            raise ValueError("no colours")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="raised ValueError: no colours on sample 1 .*completion: 'blue'"):
        RewardSet([Reward("fails_on_blue", fails_on_blue)]).score(STANDARD, TEXTS)


def test_none_is_left_out_of_the_sum_and_an_unscored_row_is_warned(caplog):
    rewards = RewardSet([Reward("a", lambda completions, **kw: [None, 1.0], 2.0),
                         Reward("b", lambda completions, **kw: [None, None])])
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.combine"):
        scores = rewards.score(STANDARD, TEXTS, {"answer": ["4", "red"]})
    assert scores.total_B.tolist() == [0.0, 2.0] and scores.skipped == 3
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "every reward function returned None for 1 of 2" in warned[0]
    assert "What is 2 + 2?" in warned[0] and "'answer': '4'" in warned[0]


def test_string_code_on_message_lists_is_named_with_the_sample_and_the_change():
    def old_style(prompts, completions, **kwargs):
        return [float(c.startswith("<think>")) for c in completions]

    with pytest.raises(RewardError, match="reward 'old_style' raised AttributeError.* on sample 0 .*its text is "
                                          "completion\\[0\\]\\['content'\\]"):
        RewardSet([Reward("old_style", old_style)]).score(CHAT, as_completions(CHAT, TEXTS))


def test_log_metric_and_log_extra():
    def logs(completions, log_extra, log_metric, **kwargs):
        log_metric("format/hits", 2.0)
        log_metric("format/hits", 4.0)
        log_extra("parsed", [c[:3] for c in completions])
        return [0.0] * len(completions)

    scores = RewardSet([Reward("logs", logs)]).score(STANDARD, TEXTS)
    assert scores.logged.metrics == {"format/hits": [2.0, 4.0]}
    assert scores.logged.extra == {"parsed": ["<th", "blu"]}

    def bad_extra(completions, log_extra, **kwargs):
        log_extra("parsed", ["only one"])
        return [0.0] * len(completions)

    with pytest.raises(UserError, match="reward 'bad_extra' called log_extra\\('parsed', ...\\) with 1 values for 2"):
        RewardSet([Reward("bad_extra", bad_extra)]).score(STANDARD, TEXTS)


def test_builtins_read_message_lists_and_multi_turn_completions():
    chat = as_completions(CHAT, ["#### 4", "<answer>red</answer>"])
    assert exact_match(completions=chat, answer=["4", "red"]) == [1.0, 0.0]
    assert format_reward(completions=chat, pattern="<answer>.*</answer>") == [0.0, 1.0]
    assert length_penalty(completions=chat, max_length=6) == [-1.0, -1.0]
    assert length_penalty(completions=chat, max_length=6, unit="tokens", completion_ids=IDS) == [-0.5, pytest.approx(-1 / 6)]
    trajectory = [{"role": "assistant", "content": "call add(2, 2)"}, {"role": "tool", "content": "4"},
                  {"role": "assistant", "content": "Answer: 4"}]
    assert exact_match(completions=[trajectory], answer=["4"]) == [1.0]  # the last assistant message answers
