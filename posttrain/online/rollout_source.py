"""Online micro-batches, for any online algorithm: sample completions from the current policy, score them, build the
batch; the algorithm's `advantages` hook sees the whole step's rollouts and attaches advantages.

    source = RolloutSource(recipe, backend, models, algorithm, train_examples, rewards)   # run.py builds it
    micro_batches = source.step_batches(step)        # this rank's gradient_accumulation_steps micro-batches
    source.last_metrics                               # reward / length / timing figures of the step, all ranks

G = algorithm.samples_per_prompt completions per prompt (GRPO's group; 1 for plain PPO); a generation batch is used
for algorithm.steps_per_rollout optimiser steps (see posttrain/algorithms/grpo.py for the batch semantics). It is
made in phases:
  1. prompts: the next `prompts per step` positions of the seeded global prompt order (SampleOrder), the same for
     any world size; rank r takes the r-th contiguous slice, so each prompt's G completions stay on one rank;
  2. generate: G completions per prompt, `generation.batch_size` prompts per engine call, each call seeded by (seed,
     global position of its first prompt): resume reproduces it, and so does any accumulation split (any world size
     too with generation.batch_size=1). With generation.max_staleness k > 0 the batch was sampled in a thread during
     the training of up to k earlier batches (online/in_flight.py; a checkpoint carries the batches in flight), with
     generation.partial_rollouts in chunks across syncs (online/partial.py);
  3. score: the RewardSet on this rank's completions; the step's total rewards are gathered from all ranks (one
     small all_gather) so advantages and the metrics are computed on the whole step, identically on every rank;
  4. batches: prompt + completion rows, right padded, split into micro-batches; old / reference log-probs and critic
     values are taken now (algorithm.prepare), once, so a batch reused for several steps keeps them;
  5. advantages: algorithm.advantages(Rollouts) over the step (group-relative, GAE, ...).

last_metrics (whole step, all ranks): reward/mean|std (scored completions only), rewards/<name>/mean|std,
rewards/skipped, rewards/unscored (completions no reward scored), frac_reward_zero_std, completion_length/mean|max|min,
truncated_fraction, policy_lag and rollout/policy_lag_mean|max (optimiser steps from the sampling policy to the
trained one), mismatch/* where an engine samples apart (online/mismatch.py), partial/* with partial rollouts
(online/partial.py), prompts/untemplated_fraction where plain-text prompts meet a chat template; and this rank's
seconds per phase: time/generate (with max_staleness: the wait for the batch sampled ahead), time/sync, time/score
(with the gather), time/ref (log-probs, values, advantages), time/train (from handing the micro-batches over to the
loop reading the metrics), and under launcher: ray time/role/<role> for each role served apart from the policy.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from posttrain.data.collate import collate_padded, pad_id
from posttrain.data.images import SAMPLE_IMAGES, ImageEncoder, image_names, with_images
from posttrain.agents import Trajectory, agent_metrics
from posttrain.ops.logprobs import sequence_mean
from posttrain.rewards import trainer_state
from posttrain.config.schema import total_steps
from posttrain.batch import Batch, share_prefixes
from posttrain.online.dynamic_sampling import DynamicSampler
from posttrain.online.engine_link import EngineLink, Sample
from posttrain.online.in_flight import InFlight, lag_metrics, policy_lag
from posttrain.online.mismatch import engine_mismatch
from posttrain.online.partial import PartialInFlight, partial_metrics
from posttrain.online.scoring import RankFigures, UnscoredSteps, score, step_metrics
from posttrain.train.sources import SampleOrder, Source

logger = logging.getLogger(__name__)


@dataclass
class Rollouts:
    """What an algorithm's advantages hook sees: this rank's prepared micro-batches (rewards_B, log-probs, values
    attached) and the step's total rewards from every rank, in global order (rank 0's first)."""

    batches: list[Batch]
    step_rewards_B: torch.Tensor
    """Total reward of every completion of the step, all ranks; a prompt's samples are consecutive."""
    step_truncated_B: torch.Tensor
    """bool, every completion of the step: it hit max_completion_length without end of sequence."""
    offset: int
    """Where this rank's completions start in step_rewards_B."""
    samples_per_prompt: int
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    """Sums a tensor over ranks (for statistics of the whole step, e.g. advantage whitening)."""
    step_scored_B: torch.Tensor | None = None
    """bool, every completion of the step: some reward function scored it (None: all). The GRPO family leaves the
    others out of the group baselines with advantage 0, as TRL; PPO's score is then 0 (step_rewards_B)."""

    def per_batch(self, step_values_B: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of a tensor over the whole step, split like its micro-batches (on their device)."""
        sizes = [b.num_sequences for b in self.batches]
        mine = step_values_B[self.offset : self.offset + sum(sizes)].split(sizes)
        return [values.to(b.input_ids_BT.device) for values, b in zip(mine, self.batches)]


@dataclass
class Generation:
    """One generation batch of this rank: its micro-batches (prepared) and what it measured."""

    index: int
    batches: list[Batch]
    metrics: dict[str, float]
    sampled_by: int | None = None
    """The policy version its completions were sampled by (None: the policy itself, the hf engine)."""


class RolloutSource(Source):
    """The online batch of any online algorithm (the module docstring gives its phases)."""

    prepares_batches = True  # phase 4: once per generation batch, when it is taken for training

    def __init__(self, recipe, backend, models, algorithm, examples, rewards, servers=None, processor=None,
                 shared_prefix=False):
        """processor: a vision-language policy's; the prompts' images go to the engine and into the batches.
        shared_prefix: train.shared_prefix as run.py resolved it (the prepare forwards share too)."""
        t = recipe.train
        self.processor = processor
        self.shared_prefix = shared_prefix
        self.recipe, self.backend, self.models, self.algorithm = recipe, backend, models, algorithm
        self.examples, self.rewards, self.tokenizer = examples, rewards, models.tokenizer
        self.group = algorithm.samples_per_prompt
        self.micro = t.per_device_train_batch_size
        self.iterations = algorithm.steps_per_rollout
        self.prompts_per_rank = self.micro * t.gradient_accumulation_steps // self.group  # validated: whole
        self.prompts_per_step = self.prompts_per_rank * backend.data_world_size
        self.order = SampleOrder(len(examples), t.dataloader_seed if t.dataloader_seed is not None else recipe.seed)
        vision = ImageEncoder(processor) if processor is not None else None
        self.link = EngineLink(recipe, backend, models.policy, self.tokenizer, servers, vision)
        self._generation: Generation | None = None
        self._handed_out = time.perf_counter()
        self._metrics: dict[str, float] = {}
        self._unscored = UnscoredSteps()  # a run whose rewards score nothing stops
        self._trained_through = 0  # optimiser steps the policy has taken (as far as this source knows)
        # generation.max_staleness: up to k generation batches sampled ahead, in one thread, while this one trains
        self._ahead = (PartialInFlight(recipe.generation, self.iterations) if recipe.generation.partial_rollouts
                       else InFlight(recipe.generation.max_staleness, self.iterations))
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-async")
                      if recipe.generation.max_staleness else None)
        # algo.dynamic_sampling: prompts drawn until enough groups vary (train/dynamic_sampling.py)
        self.dynamic_sampling = None
        if algorithm.dynamic_sampling is not None:
            self.dynamic_sampling = DynamicSampler(algorithm.dynamic_sampling, self.prompts_per_rank, self.group,
                                                   self._draw, backend.data_all_reduce_sum,
                                                   -(-len(examples) // self.prompts_per_step))

    def before_evaluation(self) -> None:
        """Held-out evaluation measures the current policy: the generations in flight finish first (their
        batches are kept), then an engine holding its own copy of the weights gets the trainer's, whatever sync_every
        says."""
        self._ahead.settle()
        self.link.sync(self._trained_through, force=True)

    def close(self, step: int) -> None:
        """After the run: the generations in flight are let go (their batches are not needed); servers, which outlive
        the run, get the final policy (they then serve what final/ holds); the engine lets go of what it holds (a
        server engine's sync group)."""
        try:
            self._ahead.drop("the run ends")
        except Exception as e:  # the run is ending anyway; what stopped it matters more
            logger.warning("a generation batch sampled ahead (generation.max_staleness) failed: %s", e)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.link.close(step)

    def abandon(self) -> None:
        """The run failed or was stopped: the batches queued ahead are cancelled (the one sampling now ends on its
        own); a queued batch otherwise ran on, and the process waited for all of them at its exit."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def end(self) -> None:
        """After the run's last collective: an engine with a runtime of its own in this process tears it down."""
        self.link.end()

    def save_state(self, directory: Path) -> None:
        """Into a checkpoint being written (every rank): this rank's generation batches in flight (in_flight.py), and
        with dynamic sampling where the prompt order stands."""
        if self._pool is not None or len(self._ahead):
            self._ahead.save(directory, self.backend.rank)
        if self.dynamic_sampling is not None:
            self.dynamic_sampling.save(directory, self.backend.is_main)

    def load_state(self, directory: Path) -> None:
        """From the checkpoint resumed: the batches that were in flight, so none is sampled again."""
        if self.dynamic_sampling is not None:
            self.dynamic_sampling.load(directory)
        for line in self._ahead.load(directory, lambda index: self._prompts(index)[0], Trajectory):
            logger.warning("resuming from %s: %s; sampled again from the current policy", directory, line)

    def nothing_trained_hint(self) -> str:
        cut, algo = self._metrics.get("truncated_fraction", 0.0), self.recipe.algo
        if not (algo.mask_truncated_completions and cut > 0):
            return ""
        return (f"{cut:.0%} of the completions reached generation.max_completion_length="
                f"{self.recipe.generation.max_completion_length} and algo.mask_truncated_completions=true leaves those "
                "out of the loss; raise max_completion_length (multi-turn: prompts, tool output and turns share it)")

    def trainer_state(self, step: int | None = None):
        """What reward functions get as trainer_state while the completions for step `step` + 1 are scored (None:
        the steps trained so far, for evaluation)."""
        step = self._trained_through if step is None else step
        per_epoch = self.micro_batches_per_epoch()
        return trainer_state(self.recipe, step, total_steps(self.recipe.train, per_epoch),
                             per_epoch / self.recipe.train.gradient_accumulation_steps, self.backend.is_main)

    def micro_batches_per_epoch(self) -> int:
        """Per-rank micro-batches for one pass over the prompts (each reused num_iterations times)."""
        completions = len(self.examples) * self.group
        return -(-completions // (self.micro * self.backend.data_world_size)) * self.iterations

    @property
    def last_metrics(self) -> dict[str, float]:
        """The step's figures; time/train is the time since the micro-batches were handed to the loop."""
        return {**self._metrics, "time/train": time.perf_counter() - self._handed_out}

    def step_batches(self, step: int) -> list[Batch]:
        index = step // self.iterations
        self._trained_through = step + 1  # once the loop has stepped on these batches
        if self._generation is None or self._generation.index != index:
            if step % self.iterations and self._generation is None:
                logger.warning("resuming at step %d, inside generation batch %d (num_iterations=%d): the batch is "
                               "sampled again from the current policy", step, index, self.iterations)
            self._generation = self._generate(index, step)
            self._metrics = self._generation.metrics
        else:  # a reused batch: nothing was generated, scored or prepared for this step; the policy moved on
            g = self._generation
            self._metrics = {**g.metrics, "time/generate": 0.0, "time/score": 0.0, "time/ref": 0.0,
                             **lag_metrics([policy_lag(step, g.sampled_by)])}
        self._handed_out = time.perf_counter()
        return list(self._generation.batches)

    # --- the phases ------------------------------------------------------------------------------------------------

    def _prompts(self, index: int) -> tuple[list[int], list[int], list[dict]]:
        """This rank's slice of generation batch `index`: global positions, dataset rows, examples."""
        first = index * self.prompts_per_step + self.backend.data_rank * self.prompts_per_rank
        positions = list(range(first, first + self.prompts_per_rank))
        dataset_index = [self.order.index(p) for p in positions]
        return positions, dataset_index, [self.examples[i] for i in dataset_index]

    def _generate(self, index: int, step: int) -> Generation:
        backend, group = self.backend, self.group
        self.link.sync_seconds, self._seconds, self._logged = 0.0, {"generate": 0.0, "score": 0.0}, {}
        # 1-3. this rank's prompt groups, generated and scored; dynamic sampling draws until enough of them vary
        if self.dynamic_sampling is None:
            sample, dynamic_metrics = self._draw(index, step), {}
        else:
            sample, dynamic_metrics = self.dynamic_sampling.fill(index, step)
        sample = backend.same_rows(sample)  # a sequence-parallel group trains on its first rank's completions
        gather_started = time.perf_counter()
        lags = [policy_lag(step, version) for version in sample.sampled_by]
        everyone: list[RankFigures] = backend.data_all_gather_object(RankFigures.of(sample, self._logged, lags))
        global_total_B = torch.tensor([r for part in everyone for r in part.total])
        global_scored_B = torch.tensor([s for part in everyone for s in part.scored], dtype=torch.bool)
        self._unscored.check(global_scored_B, {name: sum(math.isnan(v) for part in everyone
                                                         for v in part.per_function[name])
                                               for name in everyone[0].per_function}, step)
        scored = time.perf_counter()
        self._seconds["score"] += scored - gather_started

        # 4. micro-batches, with old / reference log-probs and values taken once
        batches = self._micro_batches(sample)
        with torch.no_grad(), backend.autocast():
            batches = [self.algorithm.prepare(b.to(backend.device), self.models) for b in batches]

            # 5. advantages over the whole step
            step_truncated_B = torch.tensor([c for part in everyone for c in part.truncated], dtype=torch.bool)
            rollouts = Rollouts(batches, global_total_B, step_truncated_B, backend.data_rank * len(sample.total), group,
                                backend.data_all_reduce_sum, global_scored_B)
            batches, advantage_metrics = self.algorithm.advantages(rollouts)
            if self.link.engine.holds_copy:  # an engine apart: its log-probs against the trainer's (mismatch.py)
                advantage_metrics.update(engine_mismatch(batches, self.algorithm.clip_range(),
                                                         backend.data_all_gather_object))
        prepared = time.perf_counter()

        metrics = step_metrics(everyone, global_total_B, global_scored_B, group)
        if sample.trajectories is not None:
            metrics.update(agent_metrics([part.agent for part in everyone]))
        metrics.update({"time/generate": self._seconds["generate"], "time/score": self._seconds["score"],
                        "time/ref": prepared - scored, "time/sync": self.link.sync_seconds,
                        **lag_metrics([lag for part in everyone for lag in part.lags]), **advantage_metrics,
                        **dynamic_metrics, **self._ahead.metrics(), **self.link.figures()})
        if self.recipe.generation.partial_rollouts:
            metrics.update(partial_metrics([v for part in everyone for v in part.versions]))
        for name in ("reference", "reward_model", "critic"):  # roles served apart: their calls' seconds
            role = getattr(self.models, name)
            seconds = role.seconds() if role is not None else None
            if seconds is not None:
                metrics[f"time/role/{name}"] = seconds
        if backend.is_main:
            self._write_samples(step, sample, sequence_advantages(batches))
        versions = [v for v in sample.sampled_by if v is not None]
        return Generation(index, batches, metrics, min(versions) if versions else None)

    def _draw(self, draw: int, step: int) -> Sample:
        """Generation batch `draw` of the prompt order (this rank's slice), sampled and scored for `step`."""
        group = self.group
        positions, dataset_index, prompts = self._prompts(draw)

        # generate (an engine with its own copy of the weights gets the current policy first); with
        # generation.max_staleness the batch was sampled during earlier steps, and the next ones start now
        link = self.link
        started, synced_before = time.perf_counter(), link.sync_seconds
        ahead, refused = self._ahead.take(draw, step)
        if refused:
            logger.warning("step %d: %s; it is sampled again from the current policy", step, refused)
        if ahead is not None:
            sample = self._ahead.complete(ahead, link, step)
        else:
            link.sync(step)
            sample = link.sample(prompts, positions, dataset_index, group)
        self._ahead.settle()  # no sync ever lands under a generation (or a chunk) in flight
        generated, synced = time.perf_counter(), link.sync_seconds - synced_before
        if self._pool is not None:  # up to k batches ahead, started by the policy current now
            link.sync(step)
            self._ahead.refill(draw, step, self._prompts, link, group, self._pool)
        else:
            link.sleep()
        score_started = time.perf_counter()

        # score this rank's completions (multi-turn: every message after the prompt, as TRL's multi-turn GRPO)
        texts, scores = score(self.rewards, prompts, sample, self.tokenizer, link.with_environment,
                              self.trainer_state(step))
        for name, values in scores.logged.metrics.items():  # log_metric: averaged over the step, every draw's
            self._logged.setdefault(name, []).extend(values)
        self._seconds["generate"] += generated - started - synced
        self._seconds["score"] += time.perf_counter() - score_started
        return sample.asked(prompts, positions, dataset_index).take_scores(texts, scores)

    def _micro_batches(self, sample: Sample) -> list[Batch]:
        """The scored sample's prompt + completion rows, right padded, in micro-batches with the sampler's log-probs,
        rewards and truncation attached (a filler row, and with algo.mask_truncated_completions a truncated one,
        carries no loss)."""
        rows = sample.rows(self.recipe.algo.mask_truncated_completions)
        dataset_index = [i for i in sample.dataset_index for _ in range(sample.group)]
        rewards_B = torch.tensor(sample.total, dtype=torch.float32)
        batches = []
        for start in range(0, len(rows), self.micro):
            stop = start + self.micro
            batch = collate_padded(rows[start:stop], pad_id(self.tokenizer))
            if self.processor is not None:  # each completion row sees its prompt's images
                images = [self.examples[i].get("images", []) for i in dataset_index[start:stop]]
                batch = with_images(batch, images, self.processor)
            shape_BT = tuple(batch.input_ids_BT.shape)
            batch = replace(batch, rewards_B=rewards_B[start:stop],
                            sampler_logprobs_BT=sample.aligned(sample.logprobs, start, stop, shape_BT),
                            sampled_by_BT=sample.aligned(sample.token_versions, start, stop, shape_BT, -1, torch.long),
                            truncated_B=torch.tensor(sample.truncated[start:stop], dtype=torch.bool),
                            example_index_B=torch.tensor(dataset_index[start:stop]),
                            padding_free=self.recipe.data.packing)
            batches.append(share_prefixes(batch) if self.shared_prefix else batch)
        return batches

    def _write_samples(self, step: int, sample: Sample, advantages_B: torch.Tensor) -> None:
        """Every logging step: a few prompt groups of rank 0, appended to output_dir/samples.jsonl (with what the
        reward functions logged through log_extra). Multi-turn: each record's `trajectory` holds every message after
        the opening ones (the model's text with its tool calls as written, each tool's output or error, the
        environment's messages) and `stats` its counts. A completion no reward scored has reward null. A prompt with
        images: `images` names their files (data.images.image_names)."""
        t, groups = self.recipe.train, self.recipe.algo.log_samples
        due = [s + 1 for s in range(step, step + self.iterations) if (s + 1) % t.logging_steps == 0]
        if not due or not groups:
            return
        shown = Path(self.recipe.output_dir) / SAMPLE_IMAGES
        records = []
        for i in range(min(groups, len(sample.prompts)) * self.group):
            prompt = sample.prompts[i // self.group]
            records.append({
                "step": due[0], "prompt": prompt["prompt"],
                **({"images": image_names(prompt["images"], shown)} if prompt.get("images") else {}),
                "completion": sample.texts[i], "reward": float(sample.total[i]) if sample.scored[i] else None,
                "rewards": {k: (None if math.isnan(v[i]) else float(v[i])) for k, v in sample.per_function.items()},
                "advantage": float(advantages_B[i]), "truncated": bool(sample.truncated[i]),
                **({"token_versions": sample.token_versions[i], "dropped": sample.dropped[i]}
                   if self.recipe.generation.partial_rollouts else {}),
                **({"extra": {k: v[i] for k, v in sample.extra.items()}} if sample.extra else {}),
                **(trajectory_record(sample.trajectories[i]) if sample.trajectories is not None else {})})
        with (Path(self.recipe.output_dir) / "samples.jsonl").open("a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in records)


def trajectory_record(t: Trajectory) -> dict:
    """A trajectory for samples.jsonl: its messages after the opening ones, and its counts."""
    return {"trajectory": t.completion_messages, "stats": t.stats()}


def sequence_advantages(batches: list[Batch]) -> torch.Tensor:
    """One advantage per completion, for the samples file: the sequence's own, or its per-token mean."""
    return torch.cat([b.advantages_B if b.advantages_B is not None
                      else sequence_mean(b.advantages_BT, b.completion_mask_BT) for b in batches]).cpu()
