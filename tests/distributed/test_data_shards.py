"""Data across ranks (train/sources.py): in every step each rank reads its own disjoint slice of one global stream,
and that stream depends on the seed only, not on how the global batch is split over processes, micro-batches and
accumulation. Pure, no processes."""

from __future__ import annotations

from posttrain.train.sources import DatasetSource

N = 40
GLOBAL = 8
SPLITS = [(1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 4, 1), (4, 1, 2), (8, 1, 1)]  # (world, micro, accumulation)


def step_by_rank(world: int, micro: int, accumulation: int, step: int, seed: int = 7) -> list[list[int]]:
    """Each rank's dataset indices for `step`, its micro-batches in order."""
    ranks = [DatasetSource(list(range(N)), lambda rows: rows, micro, accumulation, world, r, seed) for r in range(world)]
    return [[i for mb in source.step_indices(step) for i in mb] for source in ranks]


def global_order(world: int, micro: int, accumulation: int, step: int, seed: int = 7) -> list[int]:
    """The step's indices in stream order: micro-batch k of rank r is slot k * world + r."""
    ranks = [DatasetSource(list(range(N)), lambda rows: rows, micro, accumulation, world, r, seed) for r in range(world)]
    per_rank = [source.step_indices(step) for source in ranks]
    return [i for k in range(accumulation) for r in range(world) for i in per_rank[r][k]]


def test_ranks_read_disjoint_shards_covering_the_global_batch():
    for world, micro, accumulation in SPLITS:
        for step in range(N // GLOBAL):
            shards = step_by_rank(world, micro, accumulation, step)
            flat = [i for shard in shards for i in shard]
            assert all(len(shard) == micro * accumulation for shard in shards)
            assert len(set(flat)) == len(flat) == GLOBAL, (world, step, shards)


def test_global_order_depends_on_seed_not_on_the_split():
    for step in range(N // GLOBAL + 2):  # into the second epoch
        orders = {split: global_order(*split, step) for split in SPLITS}
        assert len({tuple(o) for o in orders.values()}) == 1, orders
    epoch = [i for step in range(N // GLOBAL) for i in global_order(2, 2, 2, step)]
    assert sorted(epoch) == list(range(N))  # one epoch visits every example once
    assert global_order(2, 2, 2, 0, seed=7) != global_order(2, 2, 2, 0, seed=8)
