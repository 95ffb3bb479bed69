"""DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): drop the prompt groups whose completions all score the same (they
carry no group-relative advantage) and sample further prompts until the step's batch is full of groups that do.

    algo:
      dynamic_sampling: {enabled: true, metric: accuracy, max_batches: 4}

    kept_P = varied_groups(accuracy_B, group=8)            # the pure filter
    groups, stats = refill(need, draw, varied_groups, 8, max_batches=4, short_anywhere=...)   # the loop

The paper keeps a group when 0 < |{o_i : is_equivalent(a, o_i)}| < G, i.e. its accuracy is neither all 0 nor all 1:
the filter runs on the raw accuracy (`metric: accuracy`, exact match against the `answer` column), never on the shaped
reward, where an overlong or format term can make a group of all-wrong answers look varied (NeMo-RL#2431, verl-recipe
PR#125). `metric: reward` filters on the total reward instead (for tasks without a reference answer). "Varied" is
max > min, which is std > 0 (verl's `np.std(...) > 0`) without rounding. A completion no reward function scored
(TRL's unscorable completion, advantage 0) has no metric: the group varies when its other completions do, as the
advantages see it; with fewer than two such completions nothing in the group trains, and it is dropped.

As in verl's filter_groups, generation batches of `prompts per step` prompts are drawn until the kept groups fill the
step; kept groups beyond it are discarded, not carried over (so the data position is all a checkpoint needs, beside
the batches sampled ahead). After `max_batches` draws the step trains on what there is: the missing groups are filled
with dropped ones whose completions are masked out of the loss, and a warning says so (verl raises instead). With 0
(no limit) a step draws until it is full, or stops the run once it drew every prompt of the data without filling. With several processes every rank fills its own share and all draw again while any is short, so every rank
makes the same engine calls.
"""

from __future__ import annotations

import json
import logging
import math
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

import torch

from posttrain.algorithms.grpo import DynamicSamplingConfig
from posttrain.errors import RunStopped, UserError
from posttrain.online.engine_link import Sample
from posttrain.usercode import stop_requested

logger = logging.getLogger(__name__)

Group = TypeVar("Group")


def varied_groups(metric_B: torch.Tensor, group: int) -> torch.Tensor:
    """bool_P: which groups of `group` consecutive completions have a metric that varies (DAPO's kept groups). A group
    of one is kept (nothing to compare, as verl); NaN (no metric: no reference answer, or no reward scored the
    completion) is left out, so a group varies when its other values do."""
    metric_PG = metric_B.reshape(-1, group).double()
    if group == 1:
        return torch.ones(metric_PG.shape[0], dtype=torch.bool)
    known_PG = ~metric_PG.isnan()
    highest_P = torch.where(known_PG, metric_PG, -math.inf).amax(dim=1)
    lowest_P = torch.where(known_PG, metric_PG, math.inf).amin(dim=1)
    return highest_P > lowest_P


@dataclass
class Refilled:
    """One step's groups after dynamic sampling, with what it took."""

    groups: list
    """`need` groups: the kept ones first, then (only when max_batches ran out) fillers to mask out of the loss."""
    fillers: int
    """How many of `groups` (at the end) are dropped groups standing in for missing ones."""
    drawn: int
    kept: int
    """Varied groups drawn (surplus included)."""
    batches: int
    """Generation batches drawn."""


def refill(need: int, draw: Callable[[], tuple[Sequence[Group], torch.Tensor]],
           keep: Callable[[torch.Tensor, int], torch.Tensor], group: int, max_batches: int,
           short_anywhere: Callable[[int], bool] = lambda short: short > 0,
           batches_per_pass: Optional[int] = None, stop_signal: Callable[[], int] = stop_requested) -> Refilled:
    """Draw generation batches until `need` kept groups are in hand (on every rank: `short_anywhere(this rank's
    shortfall)` is true while any rank is short) or `max_batches` were drawn, and never more than `batches_per_pass`
    (every prompt of the data once; None: unbounded): more draws would only repeat the prompts that did not vary (a
    high max_batches drew for hours). With max_batches 0 (no limit) a step still short after a pass stops the run.
    A stop signal (SIGTERM, SIGINT: `stop_signal()`, agreed by every rank) stops the run between two draws.

    draw() -> (groups, metric_B): the next generation batch's groups, in prompt order, and the metric of each of
    their completions (group consecutive values per group). keep(metric_B, group) -> bool_P picks the groups."""
    kept: list = []
    dropped: list = []
    drawn = batches = 0
    limit = min(max_batches or math.inf, batches_per_pass or math.inf)
    while True:
        groups, metric_B = draw()
        batches += 1
        drawn += len(groups)
        keep_P = keep(metric_B, group).tolist()
        kept += [g for g, k in zip(groups, keep_P) if k]
        dropped += [g for g, k in zip(groups, keep_P) if not k]
        short = short_anywhere(max(0, need - len(kept)))
        if not short or batches >= limit:
            break
        signum = stop_signal()
        if signum:  # the step cannot finish soon: stop now, its last checkpoint intact
            raise RunStopped(f"{signal.Signals(signum).name} while dynamic sampling drew for a step ({batches} "
                             f"generation batches, {len(kept)} of the {need} prompt groups vary): stopped without "
                             "saving this step, the last checkpoint is intact", 128 + signum, resumable=True)
    if short and not max_batches:  # every rank knows `short` alike: all stop together
        raise RunStopped(f"dynamic sampling drew every prompt of the data once for this step ({batches} generation "
                         f"batches) and {len(kept)} of the {need} prompt groups this process needs vary: the metric "
                         "(algo.dynamic_sampling.metric) is the same for every completion of almost every prompt. "
                         "Check the reward and the data's answers, or set algo.dynamic_sampling.max_batches to train "
                         "on the groups that vary (max_batches=0 never trains on fewer)")
    fillers = max(0, need - len(kept))
    if fillers:
        why = (f"algo.dynamic_sampling.max_batches={max_batches}" if batches < (batches_per_pass or math.inf)
               else "one pass over the data, the most a step draws")
        trains = (f"training on those {len(kept)}, the other {fillers} masked out of the loss" if kept else
                  "this step trains on nothing: every completion is masked out of the loss")
        logger.warning("dynamic sampling: %d of the %d prompt groups this step needs vary after %d generation "
                       "batches (%s); %s. Raise max_batches, or use easier / harder data", len(kept), need, batches,
                       why, trains)
    return Refilled(kept[:need] + dropped[:fillers], fillers, drawn, len(kept), batches)


class DynamicSampler:
    """The rollout source's dynamic sampling: where the next draw starts in the prompt order (saved in checkpoints),
    and one step's refill.

    draw(d, step) -> Sample: generation batch d of the prompt order (this rank's slice), sampled and scored.
    all_reduce_sum: sums a tensor over ranks (the shortfall, the step's counts)."""

    FILE = "dynamic_sampling.json"

    def __init__(self, config: DynamicSamplingConfig, need: int, group: int, draw: Callable[[int, int], Sample],
                 all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], batches_per_pass: int):
        self.config, self.need, self.group, self._draw, self._sum = config, need, group, draw, all_reduce_sum
        self.batches_per_pass = batches_per_pass
        """Generation batches that draw every prompt of the data once (max_batches=0's bound per step)."""
        self.next_draw: Optional[int] = None
        """The generation batch of the prompt order the next draw takes (None: the first step's own)."""

    def fill(self, index: int, step: int) -> tuple[Sample, dict[str, float]]:
        """This rank's `need` groups for generation batch `index` (trained from `step`) and the step's
        dynamic_sampling/* figures (all ranks)."""
        rewards: list[float] = []
        if self.next_draw is None:  # a new run, or one resumed from a checkpoint written without dynamic sampling
            self.next_draw = index

        def draw():
            sample = self._draw(self.next_draw, step)
            self.next_draw += 1
            rewards.extend(sample.total)
            return sample.groups(), sample.metric(self.config.metric)

        agreed = [0]  # the stop signal some rank received, agreed in the shortfall's all-reduce (one collective)

        def short_anywhere(short: int) -> bool:
            short_sum, signals = self._sum(torch.tensor([float(short), float(stop_requested())])).tolist()
            agreed[0] = stop_requested() or (int(signal.SIGTERM) if signals else 0)  # a peer's: launchers send TERM
            return short_sum > 0

        out = refill(self.need, draw, varied_groups, self.group, self.config.max_batches, short_anywhere,
                     self.batches_per_pass, lambda: agreed[0])
        counts = self._sum(torch.tensor([out.drawn, out.kept, out.fillers, sum(rewards), len(rewards)],
                                        dtype=torch.float64)).tolist()
        drawn, kept, fillers, reward_sum, completions = counts
        if not kept and out.batches >= self.batches_per_pass:  # every rank alike: the counts are summed
            raise RunStopped(f"dynamic sampling drew every prompt of the data once for step {step + 1} ({out.batches} "
                             "generation batches) and no prompt group varies: no step of this run can train. Check "
                             "the reward and the data's answers (algo.dynamic_sampling.metric="
                             f"{self.config.metric})")
        metrics = {"dynamic_sampling/groups_drawn": drawn, "dynamic_sampling/groups_kept": kept,
                   "dynamic_sampling/groups_dropped": drawn - kept, "dynamic_sampling/kept_fraction": kept / drawn,
                   "dynamic_sampling/filler_groups": fillers, "dynamic_sampling/batches": float(out.batches),
                   "dynamic_sampling/drawn_reward_mean": reward_sum / max(completions, 1.0)}
        return Sample.join(out.groups, out.fillers), metrics

    def save(self, directory: Path, is_main: bool) -> None:
        if is_main:
            (Path(directory) / self.FILE).write_text(json.dumps({"next_draw": self.next_draw}))

    def load(self, directory: Path) -> None:
        """From a checkpoint: where the prompt order stands. A checkpoint of a run without dynamic sampling has no
        such file: the draws then start at the resumed step's own generation batch."""
        path = Path(directory) / self.FILE
        if not path.is_file():
            logger.warning("%s has no %s (written without algo.dynamic_sampling): the draws start at the resumed "
                           "step's generation batch", directory, self.FILE)
            return
        try:
            self.next_draw = int(json.loads(path.read_text())["next_draw"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path} cannot be read ({e}): resume from an earlier checkpoint") from e

