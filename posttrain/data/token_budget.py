"""Micro-batches bounded by tokens instead of rows: which whole units (rows, preference pairs, GRPO groups) go into
which micro-batch, and which rank gets which units.

Why tokens: with reasoning traces of 64 to 32k tokens, a fixed number of rows per micro-batch is either padded to
the longest row (memory and compute spent on filler) or sized for the worst case (most micro-batches nearly empty).
A token budget (`train.max_tokens_per_microbatch`, verl's ppo_max_token_len_per_gpu) keeps every micro-batch about
equally full. The update does not depend on how the step is split, because the loop divides every micro-batch's loss
by one normaliser counted over the whole step before the split (train/loop.py, phase 3).

    count = fewest_micro_batches(unit_tokens, budget)          # this rank; the loop agrees the max over ranks
    parts = micro_batches_within_budget(unit_tokens, budget, count)   # lists of unit indices, one per micro-batch
    ranks = balanced_partition(unit_tokens, world_size)        # which units each rank trains on

Everything here is pure: lists of ints in, lists of index lists out.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def fewest_micro_batches(unit_tokens: Sequence[int], budget: int) -> int:
    """How many micro-batches of at most `budget` tokens first-fit-decreasing needs for these whole units.
    A unit longer than the budget takes a micro-batch of its own (it cannot be split without sequence parallelism);
    `train.max_tokens_per_microbatch` below `data.max_length` is refused at start-up for that reason."""
    return len(_first_fit_decreasing(unit_tokens, budget))


def micro_batches_within_budget(unit_tokens: Sequence[int], budget: int, count: int | None = None) -> list[list[int]]:
    """Exactly `count` micro-batches (default: the fewest that fit) of whole units, each within `budget` tokens where
    the units allow, with their token sums as even as the packing allows. `count` is the number every rank agreed
    on (the most any rank needs), so a rank with fewer or shorter units gets some smaller or empty micro-batches:
    collective-bound backends (ZeRO-3, FSDP) need every rank to run the same number of forwards.
    Each micro-batch lists its units in their original order."""
    needed = fewest_micro_batches(unit_tokens, budget)
    count = needed if count is None else count
    if count < needed:
        raise ValueError(f"{count} micro-batches cannot hold these units within {budget} tokens: {needed} are needed")
    if not unit_tokens:
        return [[] for _ in range(count)]
    parts = balanced_partition(unit_tokens, count)
    if max(sum(unit_tokens[i] for i in part) for part in parts) > max(budget, max(unit_tokens)):
        # the even split broke the budget where first-fit-decreasing did not: keep the packing that fits
        parts = _first_fit_decreasing(unit_tokens, budget)
        parts += [[] for _ in range(count - len(parts))]
    return [sorted(part) for part in parts]


def balanced_partition(unit_tokens: Sequence[int], parts: int) -> list[list[int]]:
    """Split units into `parts` lists with token sums as equal as the largest differencing method (Karmarkar and
    Karp 1982) finds: the two partial partitions whose sums differ most are merged, largest subset against
    smallest, until one remains. It balances long-tailed lengths (a few 32k traces among many short ones) better
    than greedy longest-first. Returns lists of unit indices, possibly empty when there are fewer units than parts.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    # a partial partition: `parts` subsets, each (sum, indices), kept sorted by sum, largest first
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for index, tokens in enumerate(unit_tokens):
        subsets = [(int(tokens), [index])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-int(tokens), index, subsets))  # key: minus (largest sum - smallest sum)
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, order, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # largest subset of one with the smallest of the other, and so on down
        merged = [(a_sum + b_sum, a_idx + b_idx) for (a_sum, a_idx), (b_sum, b_idx) in zip(first, reversed(second))]
        merged.sort(key=lambda subset: -subset[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), order, merged))
    return [indices for _, indices in heap[0][2]]


def _first_fit_decreasing(unit_tokens: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of unit indices, each within `budget` tokens (a unit over it alone in its bin), longest units first."""
    if budget < 1:
        raise ValueError(f"the token budget must be at least 1, got {budget}")
    bins: list[list[int]] = []
    sizes: list[int] = []
    for index in sorted(range(len(unit_tokens)), key=lambda i: -unit_tokens[i]):
        slot = next((b for b, size in enumerate(sizes) if size + unit_tokens[index] <= budget), None)
        if slot is None:
            bins.append([])
            sizes.append(0)
            slot = len(bins) - 1
        bins[slot].append(index)
        sizes[slot] += unit_tokens[index]
    return bins
