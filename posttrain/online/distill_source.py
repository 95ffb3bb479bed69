"""Micro-batches for distillation: the dataset's prompt + completion rows, whose completions the student samples
itself on a seeded `algo.lmbda` fraction of the steps (GKD's on-policy mixture, Agarwal et al. 2024).

    source = DistillSource(recipe, backend, models, train_examples, lmbda=0.5)   # run.py builds it
    micro_batches = source.step_batches(step)

Every step takes its rows exactly as the dataset source does (train/sources.py). Whether a step is on-policy is a
coin seeded by (seed, step), the same on every rank and on resume. On an on-policy step each row keeps its prompt
(its tokens before the first trained token) and gets a completion sampled through the run's engine link
(train/engine_link.py), seeded and synced as for GRPO, so resume reproduces it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from posttrain.batch import Batch
from posttrain.data.collate import collate_padded
from posttrain.online.engine_link import EngineLink, sampling_seed
from posttrain.train.sources import DatasetSource, Source


def prompt_ids(example: dict) -> list[int]:
    """The tokens before the first trained one (the prompt of a prompt + completion row)."""
    return example["input_ids"][: example["completion_mask"].index(1)]


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """The seeded coin of step `step`: True with probability lmbda, the same on every rank and on resume."""
    generator = torch.Generator().manual_seed(sampling_seed(seed, step))
    return bool(torch.rand((), generator=generator) < lmbda)


class DistillSource(Source):
    """The dataset source's rows (no rewards, one sample per row), completed on a seeded share of the steps through
    the run's engine link."""

    def __init__(self, recipe, backend, models, examples, lmbda: float, servers=None):
        self.recipe, self.examples, self.lmbda = recipe, examples, lmbda
        self.micro = recipe.train.per_device_train_batch_size
        self.pad_id = models.tokenizer.pad_token_id
        self.data = DatasetSource.from_recipe(recipe, backend, examples, lambda rows: collate_padded(rows, self.pad_id))
        self.link = EngineLink(recipe, backend, models.policy, models.tokenizer, servers)
        self._metrics: dict[str, float] = {}
        self._handed_out = time.perf_counter()

    def micro_batches_per_epoch(self) -> int:
        return self.data.micro_batches_per_epoch()

    @property
    def last_metrics(self) -> dict[str, float]:
        """The step's figures; time/train is the time since the micro-batches were handed to the loop."""
        return {**self._metrics, "time/train": time.perf_counter() - self._handed_out}

    def step_batches(self, step: int) -> list[Batch]:
        on_policy = on_policy_step(self.recipe.seed, step, self.lmbda)
        started, self.link.sync_seconds = time.perf_counter(), 0.0
        batches = self._sampled_batches(step) if on_policy else self.data.step_batches(step)
        lengths = torch.cat([b.completion_mask_BT.sum(-1) for b in batches]).float()
        generate = time.perf_counter() - started - self.link.sync_seconds if on_policy else 0.0
        self._metrics = {"on_policy": float(on_policy), "completion_length/mean": float(lengths.mean()),
                         "time/generate": generate, "time/sync": self.link.sync_seconds}
        self._handed_out = time.perf_counter()
        return batches

    def _sampled_batches(self, step: int) -> list[Batch]:
        """The rows' prompts, sampled by the current student in one pass over this rank's rows of the step."""
        self.link.sync(step)
        positions = [p for micro in self.data.step_positions(step) for p in micro]
        indices = [self.data.order.index(p) for p in positions]
        sample = self.link.sample([{"prompt_ids": prompt_ids(self.examples[i])} for i in indices], positions, indices)
        self.link.sleep()
        rows = sample.rows()
        return [dataclasses.replace(collate_padded(rows[i : i + self.micro], self.pad_id),
                                    example_index_B=torch.tensor(indices[i : i + self.micro]))
                for i in range(0, len(rows), self.micro)]

    def close(self, step: int) -> None:
        self.link.close(step)

    def end(self) -> None:
        self.link.end()
