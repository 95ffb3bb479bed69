"""algorithm.prepare runs once per batch: in the loop for a dataset's batches, in the online source for an online
batch (once per generation batch, so a batch reused for several steps keeps the old policy of its first step)."""

import contextlib
import types

import torch

from posttrain.batch import Batch
from posttrain.config.schema import Recipe
from posttrain.train.loop import LoopContext, prepared_micro_batches
from posttrain.train.sources import Source


class CountingAlgorithm:
    def __init__(self):
        self.calls = 0

    def prepare(self, batch, models, training=True):
        self.calls += 1
        return batch


class OneBatch(Source):
    def __init__(self, prepares: bool):
        self.prepares_batches = prepares

    def step_batches(self, step):
        ids = torch.tensor([[1, 2, 3]])
        return [Batch(input_ids_BT=ids, attention_mask_BT=torch.ones_like(ids), completion_mask_BT=torch.ones_like(ids))]


def context(source, algorithm) -> LoopContext:
    backend = types.SimpleNamespace(recipe=Recipe(), device="cpu", autocast=contextlib.nullcontext,
                                    all_gather_object=lambda obj: [obj])
    models = types.SimpleNamespace(tokenizer=None)
    return LoopContext(backend=backend, algorithm=algorithm, models=models, source=source, total_steps=1,
                       logger=None, checkpointer=None)


def test_the_loop_prepares_a_dataset_batch_and_leaves_a_prepared_online_batch_alone():
    for prepares, expected in ((False, 1), (True, 0)):
        algorithm = CountingAlgorithm()
        assert len(prepared_micro_batches(context(OneBatch(prepares), algorithm), step=1)) == 1
        assert algorithm.calls == expected, prepares


def test_the_online_sources_say_whether_they_prepare():
    from posttrain.online.distill_source import DistillSource
    from posttrain.online.rollout_source import RolloutSource

    assert RolloutSource.prepares_batches and not DistillSource.prepares_batches
