"""The queue of generation batches sampled ahead (generation.max_staleness): the order they are consumed, the lag
each is trained at, the refusal of a batch staler than k, and their exact round trip through checkpoint files."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.agents import Trajectory
from posttrain.errors import UserError
from posttrain.online.engine_link import Sample
from posttrain.online.in_flight import FILE, InFlight, Sampled, lag_metrics, policy_lag


def answer(index: int, positions: list[int], group: int = 2, sampled_by: int = 2) -> Sample:
    """What the engine link returns for a batch: G rows per prompt, values that say which batch and prompt they are."""
    rows = [(index, p, g) for p in positions for g in range(group)]
    return Sample([[p] for _, p, _ in rows], [[index, p, g] for index, p, g in rows],
                  [[-0.1 * (index + 1), math.nextafter(-1 / 3, 0)] for _ in rows], [g == 1 for _, _, g in rows],
                  sampled_by=[sampled_by] * len(rows), token_versions=[[sampled_by] * 3 for _ in rows],
                  dropped=[False] * len(rows))


def drive(queue: InFlight, batches: int, iterations: int = 1) -> list[tuple[int, int, str]]:
    """The rollout source's schedule: batch 0 sampled on the spot; once batch i is taken (at step i x iterations),
    nothing is sampling, and batches up to i + k are submitted by the policy of that step, in one worker thread.
    Returns (step, lag, what was trained) for every step."""
    trained = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for index in range(batches):
            step = index * iterations
            taken, refused = queue.take(index, step)
            assert refused is None
            result = taken.wait() if taken else answer(index, [index], sampled_by=step)
            queue.settle()
            for j in queue.wanted(index):
                queue.push(Sampled(j, [j], step, pool.submit(answer, j, [j], sampled_by=step)))
            for s in range(step, step + iterations):
                trained.append((s, policy_lag(s, result.sampled_by[0]), result.completion_ids[0][0]))
    return trained


@pytest.mark.parametrize("k, lags", [(0, [0, 0, 0, 0, 0]), (1, [0, 1, 1, 1, 1]), (2, [0, 1, 2, 2, 2]),
                                     (3, [0, 1, 2, 3, 3])])
def test_batches_are_consumed_in_order_each_at_most_k_batches_behind(k, lags):
    trained = drive(InFlight(k, 1), 5)
    assert [index for _, _, index in trained] == [0, 1, 2, 3, 4]  # every batch once, in order, none skipped
    assert [lag for _, lag, _ in trained] == lags


def test_lag_counts_optimiser_steps_and_grows_while_a_batch_is_reused():
    trained = drive(InFlight(2, 2), 3, iterations=2)  # each batch trained for 2 steps (num_iterations=2)
    assert [(s, lag) for s, lag, _ in trained] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    assert lag_metrics([2, 2, 3, 4]) == {"policy_lag": 2.75, "rollout/policy_lag_mean": 2.75,
                                         "rollout/policy_lag_max": 4.0}
    assert policy_lag(7, None) == 0  # the hf engine samples with the trained policy itself


def test_a_batch_staler_than_k_is_refused_and_those_after_it_dropped(tmp_path):
    queue = InFlight(2, 1)
    for j in (3, 4):  # submitted at step 2 with k = 2, then checkpointed
        queue.push(Sampled(j, [j], 2, result=answer(j, [j])))
    queue.save(tmp_path, rank=0)

    same = InFlight(2, 1)
    assert same.load(tmp_path, lambda index: [index]) == []
    assert same.take(3, 3)[0].index == 3 and same.take(4, 4)[0].index == 4  # 1 and 2 steps behind: within k

    smaller = InFlight(1, 1)  # resumed with generation.max_staleness=1
    smaller.load(tmp_path, lambda index: [index])
    assert smaller.take(3, 3)[0].index == 3
    taken, why = smaller.take(4, 4)
    assert taken is None and len(smaller) == 0
    assert why == ("generation batch 4 was submitted at step 2, 2 steps before step 4, more than "
                   "generation.max_staleness=1 generation batches (1 steps)")

    synchronous = InFlight(0, 1)  # resumed without sampling ahead: everything in flight is sampled again
    synchronous.load(tmp_path, lambda index: [index])
    taken, why = synchronous.take(3, 3)
    assert taken is None and "generation.max_staleness=0" in why and len(synchronous) == 0

    assert queue.take(4, 4) == (None, "the batch in flight is generation batch 3, not 4") and len(queue) == 0
    queue.push(Sampled(5, [5], 0))
    with pytest.raises(ValueError, match="generation batch 7 submitted after 5"):
        queue.push(Sampled(7, [7], 0))


def test_checkpoint_files_restore_every_value_exactly_under_any_world_size(tmp_path):
    trajectory = Trajectory(prompt_ids=[1, 2], messages=[{"role": "assistant", "content": "hi"}],
                            completion_ids=[5, 6], logprobs=[-0.25, 0.0], completion_mask=[1, 0], env_reward=0.5)
    for rank, positions in enumerate(([8, 9], [10, 11])):  # two ranks, two prompts each, two batches in flight
        queue = InFlight(2, 1)
        for index in (4, 5):
            sample = answer(index, [p + 10 * (index - 4) for p in positions])
            sample.trajectories = [trajectory] * len(sample.prompt_ids)
            queue.push(Sampled(index, [p + 10 * (index - 4) for p in positions], 3, result=sample))
        assert queue.save(tmp_path, rank) == tmp_path / FILE.format(rank=rank)
    assert json.loads((tmp_path / "rollouts_in_flight_1.json").read_text())["batches"][0]["positions"] == [10, 11]

    one = InFlight(2, 1)  # resumed on one process: it takes all four prompts of each batch, rows gathered by position
    assert one.load(tmp_path, lambda index: [p + 10 * (index - 4) for p in (8, 9, 10, 11)], Trajectory) == []
    assert [(b.index, b.submitted_at, b.result.sampled_by) for b in one.batches] == [(4, 3, [2] * 8), (5, 3, [2] * 8)]
    restored = one.batches[1].wait()
    ids, completions, logprobs, truncated, trajectories = (restored.prompt_ids, restored.completion_ids,
                                                           restored.logprobs, restored.truncated,
                                                           restored.trajectories)
    assert ids == [[p] for p in (18, 18, 19, 19, 20, 20, 21, 21)]
    assert completions[4] == [5, 20, 0] and truncated == [False, True] * 4
    assert logprobs[0] == [-0.1 * 6, math.nextafter(-1 / 3, 0)]  # bit for bit, not to the printed digits
    assert trajectories == [trajectory] * 8

    four = InFlight(2, 1)  # four processes: one prompt each; rank 3 of four takes position 11 (+10 in batch 5)
    assert four.load(tmp_path, lambda index: [11 + 10 * (index - 4)], Trajectory) == []
    assert four.batches[0].wait().prompt_ids == [[11], [11]]
    lost = InFlight(2, 1)
    assert lost.load(tmp_path, lambda index: [12], Trajectory) == [
        f"generation batch 4: the rows of prompt positions [12] are not in {tmp_path}"]
    assert len(lost) == 0
    data = json.loads((tmp_path / "rollouts_in_flight_0.json").read_text())
    for record in data["batches"]:  # a file written before versions were kept per token
        del record["token_versions"], record["dropped"]
    (tmp_path / "rollouts_in_flight_0.json").write_text(json.dumps(data))
    earlier = InFlight(2, 1)
    assert earlier.load(tmp_path, lambda index: [8 + 10 * (index - 4)], Trajectory) == []
    restored = earlier.batches[0].wait()
    assert restored.token_versions == [[2, 2, 2]] * 2 and restored.dropped == [False] * 2
    (tmp_path / "rollouts_in_flight_1.json").write_text('{"format": 99, "batches": []}')
    with pytest.raises(UserError, match="rollouts_in_flight_1.json is not a file of generation batches in flight"):
        InFlight(2, 1).load(tmp_path, lambda index: [12])


@pytest.mark.parametrize("edit, problem", [
    (lambda b: b.update(positions=[]), "positions must be a non-empty list"),
    (lambda b: b.update(positions=[8, 8]), "a prompt position is listed twice"),
    (lambda b: b.update(prompt_ids=b["prompt_ids"][:3]), "3 rows for 2 prompt positions"),
    (lambda b: b.update(logprobs=b["logprobs"][:1]), "logprobs must be a list of 4 rows"),
    (lambda b: b.pop("completion_ids"), "no completion_ids"),
    (lambda b: b.update(index="4"), "index and submitted_at must be whole numbers"),
    (lambda b: b.update(trajectories=[1, 2, 3, 4]), "trajectories must be objects"),
    (lambda b: b["token_versions"][1].pop(), "token_versions must hold one version per completion token"),
    (lambda b: b.update(rounds=-1), "rounds must be a whole number"),
])
def test_an_edited_in_flight_file_is_named_before_anything_loads(tmp_path, edit, problem):
    """A file edited with its manifest recomputed: IndexError / KeyError deep in the resume before."""
    from posttrain.online.in_flight import files_problem

    queue = InFlight(2, 1)
    queue.push(Sampled(4, [8, 9], 3, 2, result=answer(4, [8, 9])))
    queue.save(tmp_path, 0)
    assert files_problem(tmp_path) is None
    data = json.loads((tmp_path / FILE.format(rank=0)).read_text())
    edit(data["batches"][0])
    (tmp_path / FILE.format(rank=0)).write_text(json.dumps(data))
    assert files_problem(tmp_path).startswith(f"{FILE.format(rank=0)} batch 0: {problem}")


def test_a_failed_run_abandons_the_batches_queued_ahead():
    """run.py calls source.abandon() when the run fails or is stopped: the rollout source's one worker finishes the
    batch it is sampling and never starts those queued behind it, then ends (they used to be sampled one after the
    other after the run had failed, and the process waited for them at its exit)."""
    import threading
    import time
    import types

    from posttrain.online.rollout_source import RolloutSource
    from posttrain.train.sources import Source

    sampled = []

    def sample(index):
        time.sleep(0.2)
        sampled.append(index)
        return answer(index, [index])

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-async-test")
    queue = InFlight(3, 1)
    for j in (1, 2, 3):
        queue.push(Sampled(j, [j], 0, pool.submit(sample, j)))
    time.sleep(0.05)  # batch 1 is sampling
    RolloutSource.abandon(types.SimpleNamespace(_pool=pool))
    time.sleep(0.6)
    assert sampled == [1] and [b.future.cancelled() for b in queue.batches] == [False, True, True]
    assert not any(t.name.startswith("posttrain-async-test") for t in threading.enumerate())
    Source().abandon()  # every source answers (an offline one has nothing queued)
