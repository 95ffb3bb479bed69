"""Where a step's micro-batches come from.

`DatasetSource` serves offline data (SFT, RM, DPO). The global sample order is one infinite stream: epoch e is a
permutation of the dataset seeded by (seed, e), epochs concatenated. Step s takes the next `global_batch` samples of
that stream and splits them over ranks and micro-batches. So the order depends on the seed and the global batch
size only — not on how the global batch is split — which is what makes 1x4, 2x2 and 4x1 runs identical and makes
resume exact: the data position is just the step number.

With a token budget (train.max_tokens_per_microbatch) the step's global batch is spread over ranks by tokens instead
(`balanced_partition`: every rank computes the same plan from the same stream, so no collective is needed) and each
rank hands its share to the loop as one batch, which regroups it within the budget (train/micro_batches.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from posttrain.batch import Batch
from posttrain.data.token_budget import balanced_partition


class Source:
    """Where the loop's micro-batches come from; what it and run.py ask of every source, with defaults."""

    prepares_batches = False
    """The source hands out batches already through algorithm.prepare (an online batch is prepared once per
    generation batch, so one reused for several steps keeps the old policy of its first step); the loop then calls
    prepare only on batches that did not come that way."""

    def step_batches(self, step: int) -> list[Batch]:
        """This rank's `gradient_accumulation_steps` micro-batches for optimiser step `step`."""
        raise NotImplementedError

    def micro_batches_per_epoch(self) -> int:
        """Per-rank micro-batches for one pass over the data (the schedule's length with num_train_epochs)."""
        raise NotImplementedError

    @property
    def last_metrics(self) -> dict[str, float]:
        """Figures of the last step to log beside the loss (an online source's rewards, lengths, timings)."""
        return {}

    def nothing_trained_hint(self) -> str:
        """Asked when every completion token of a step was masked out: what in the recipe did it, and what to
        change ("" when the source cannot tell)."""
        return ""

    def save_state(self, directory) -> None:
        """Every rank, into a checkpoint being written: what the source holds beyond the step number (an online
        source's generation batches sampled ahead); the data position itself is the step."""

    def load_state(self, directory) -> None:
        """On resume, from the checkpoint's directory: what `save_state` wrote."""

    def close(self, step: int) -> None:
        """After the loop, before export: engines that outlive the run get the final policy."""

    def abandon(self) -> None:
        """The run failed or was stopped before close: work the source queued (generation batches sampled ahead)
        never starts, so nothing of it keeps the process from exiting."""

    def end(self) -> None:
        """After the run's last collective."""


class SampleOrder:
    """The seeded global stream of dataset indices."""

    def __init__(self, num_examples: int, seed: int):
        self.num_examples = num_examples
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_examples)
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_examples, generator=g).tolist()}
        return self._perms[epoch][offset]


class DatasetSource(Source):
    def __init__(self, examples: Sequence[dict], collate: Callable[[list[dict]], Batch], per_device_batch_size: int,
                 gradient_accumulation_steps: int, world_size: int, rank: int, seed: int, balance: bool = False):
        self.examples, self.collate, self.world_size, self.rank = examples, collate, world_size, rank
        self.micro, self.accumulation = per_device_batch_size, gradient_accumulation_steps
        self.order = SampleOrder(len(examples), seed)
        self.balance = balance
        """Spread each step's rows over ranks by tokens, one batch per rank (with a token budget)."""

    @classmethod
    def from_recipe(cls, recipe, backend, examples: Sequence[dict], collate) -> "DatasetSource":
        """This rank's source for a run: the train.* batch split, seeded by train.dataloader_seed (default: seed)."""
        t = recipe.train
        seed = t.dataloader_seed if t.dataloader_seed is not None else recipe.seed
        return cls(examples, collate, t.per_device_train_batch_size, t.gradient_accumulation_steps, backend.data_world_size,
                   backend.data_rank, seed, balance=t.max_tokens_per_microbatch is not None)

    @property
    def global_batch(self) -> int:
        return self.micro * self.accumulation * self.world_size

    def micro_batches_per_epoch(self) -> int:
        """Per-rank micro-batches in one pass over the data (for epoch-based schedules)."""
        return -(-len(self.examples) // (self.micro * self.world_size))

    def step_positions(self, step: int) -> list[range]:
        """Positions in the global stream of this rank's micro-batches (micro-batch k of rank r: slot k * world + r)."""
        start = step * self.global_batch
        slots = [k * self.world_size + self.rank for k in range(self.accumulation)]
        return [range(start + slot * self.micro, start + (slot + 1) * self.micro) for slot in slots]

    def step_indices(self, step: int) -> list[list[int]]:
        """Dataset indices of this rank's micro-batches (step_positions through the seeded order); balanced: this
        rank's share of the step's rows as one list, the shares as equal in tokens as balanced_partition finds."""
        if not self.balance:
            return [[self.order.index(p) for p in positions] for positions in self.step_positions(step)]
        start = step * self.global_batch
        indices = [self.order.index(p) for p in range(start, start + self.global_batch)]
        shares = balanced_partition([example_tokens(self.examples[i]) for i in indices], self.world_size)
        return [[indices[k] for k in sorted(shares[self.rank])]]

    def step_batches(self, step: int) -> list[Batch]:
        return [dataclasses.replace(self.collate([self.examples[i] for i in indices]),
                                    example_index_B=torch.tensor(indices)) for indices in self.step_indices(step)]


def example_tokens(example: dict) -> int:
    """Tokens an example puts through the model: its row, or a preference pair's two rows."""
    if "input_ids" in example:
        return len(example["input_ids"])
    return 2 * len(example["prompt_ids"]) + len(example["chosen_ids"]) + len(example["rejected_ids"])
