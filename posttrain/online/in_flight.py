"""Generation batches sampled ahead of training (generation.max_staleness: k), and their place in a checkpoint.

    queue = InFlight(max_staleness=2, steps_per_rollout=1)
    taken, refused = queue.take(index, step)         # batch `index`, if it was sampled ahead and its lag fits
    sample = queue.complete(taken, link, step)        # its Sample (waiting for it)
    queue.refill(index, step, prompts_of, link, group, pool)   # batches index+1 .. index+k in flight, in one thread
    queue.save(checkpoint_dir, rank)                  # every rank: rollouts_in_flight_<rank>.json
    queue.load(checkpoint_dir, positions_of)          # on resume: the same batches, whatever the world size now

Versions are optimiser steps: a batch records the policy version the trainer held when it was submitted
(`submitted_at`); its Sample, the one its engine sampled with (`sampled_by`; older with generation.sync_every > 1). A batch
submitted k generation batches ahead is trained k x steps_per_rollout steps later; `take` refuses one that waited
longer (a checkpoint written with a larger k, resumed with a smaller one): it is sampled again.

Exact resume: what the engine returned for each batch in flight, its data positions and versions go into the step-N
checkpoint, one JSON file per rank (floats round-trip exactly, no pickle), so a resumed run trains on the very tokens
and log-probs the uninterrupted run trained on. Loading gathers rows by data position from every rank's file, so a
checkpoint resumes under another world size too. Partial rollouts (online/partial.py) keep their batches here too,
with their rows so far, which rows ended and the rounds sampled.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from posttrain.errors import UserError
from posttrain.online.engine_link import Sample

FILE = "rollouts_in_flight_{rank}.json"
FORMAT = 1
FIELDS = ("prompt_ids", "completion_ids", "logprobs", "truncated", "trajectories", "sampled_by", "token_versions",
          "dropped")
"""The per-row fields of a Sample kept in the file (trajectories: None but multi-turn; sampled_by: one version for the
whole batch in files written before versions were kept per row, still read; token_versions and dropped: absent from
earlier files, read as the row's version and False)."""
LATER = ("token_versions", "dropped")
PARTIAL_ROWS = "ended"
"""A partial rollout's rows that have ended (online/partial.py); absent: the batch was saved whole."""


def files_problem(directory: Path) -> Optional[str]:
    """What is wrong with the batches-in-flight files of a checkpoint (an edited file whose manifest was recomputed
    passes the checksums), or None: checked before any model loads, so `load` only meets well-formed records."""
    for path in sorted(Path(directory).glob(FILE.format(rank="*"))):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            return f"{path.name} cannot be read ({e})"
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("batches"), list):
            return f"{path.name} is not a file of generation batches in flight of format {FORMAT}"
        for n, record in enumerate(data["batches"]):
            problem = _record_problem(record)
            if problem:
                return f"{path.name} batch {n}: {problem}"
    return None


def _whole(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _record_problem(record) -> str:
    if not isinstance(record, dict):
        return "not an object"
    missing = [k for k in ("index", "positions", "submitted_at", *FIELDS) if k not in record and k not in LATER]
    if missing:
        return f"no {', '.join(missing)}"
    positions, rows = record["positions"], record["prompt_ids"]
    if not _whole(record["index"]) or not _whole(record["submitted_at"]):
        return "index and submitted_at must be whole numbers >= 0"
    if not (isinstance(positions, list) and positions and all(_whole(p) for p in positions)):
        return "positions must be a non-empty list of whole numbers >= 0"
    if len(set(positions)) != len(positions):
        return "a prompt position is listed twice"
    if not isinstance(rows, list) or not rows or len(rows) % len(positions):
        return f"{len(rows) if isinstance(rows, list) else rows!r:.40} rows for {len(positions)} prompt positions"
    for key in (*FIELDS, PARTIAL_ROWS):
        if key not in record:
            continue
        value = record[key]
        if (value is None and key != "prompt_ids") or (key == "sampled_by" and _whole(value)):
            continue
        if not isinstance(value, list) or len(value) != len(rows):
            return f"{key} must be a list of {len(rows)} rows"
    if record["trajectories"] is not None and not all(isinstance(t, dict) for t in record["trajectories"]):
        return "trajectories must be objects"
    versions, completions = record.get("token_versions", []), record["completion_ids"]
    if versions is None or (versions and not all(isinstance(v, list) and isinstance(c, list) and len(v) == len(c)
                                                 for v, c in zip(versions, completions))):
        return "token_versions must hold one version per completion token"
    if "rounds" in record and not _whole(record["rounds"]):
        return "rounds must be a whole number >= 0"
    return ""


@dataclass
class Sampled:
    """One generation batch of this rank sampled ahead of training."""

    index: int
    """Which generation batch (train step index x steps_per_rollout starts it)."""
    positions: list[int]
    """This rank's prompts: positions in the seeded global prompt order."""
    submitted_at: int
    """The trainer's policy version (optimiser steps) when the batch was submitted."""
    future: Optional[Future] = None
    """The sampling in progress (EngineLink.sample); None once `result` is set."""
    result: Optional[Sample] = None
    """The engine's answer, G rows per position."""

    def wait(self) -> Sample:
        """The engine's answer (waiting for it when it is still being sampled)."""
        if self.result is None:
            self.result, self.future = self.future.result(), None
        return self.result


def policy_lag(step: int, sampled_by: Optional[int]) -> int:
    """Optimiser steps between the policy that sampled a completion and the one trained on it at `step`."""
    return 0 if sampled_by is None else step - sampled_by


def lag_metrics(lags: list[int]) -> dict[str, float]:
    """Policy lag of every completion of the step (policy_lag): policy_lag (the mean, as logged before
    rollout/*) and rollout/policy_lag_mean|max."""
    mean = sum(lags) / max(len(lags), 1)
    return {"policy_lag": float(mean), "rollout/policy_lag_mean": float(mean),
            "rollout/policy_lag_max": float(max(lags, default=0))}


class InFlight:
    """The batches sampled ahead, oldest first; a plain list the rollout source's one worker thread fills in order."""

    def __init__(self, max_staleness: int, steps_per_rollout: int):
        self.max_staleness = max_staleness
        self.steps_per_rollout = steps_per_rollout
        self.batches: list[Sampled] = []

    def __len__(self) -> int:
        return len(self.batches)

    def take(self, index: int, step: int) -> tuple[Optional[Sampled], Optional[str]]:
        """(batch `index`, None) when it was sampled ahead and may be trained at `step`; else (None, why not, or
        None when nothing was in flight). What is not taken is dropped: sampled for another batch (a run that
        skipped ahead), or too stale for this run's generation.max_staleness; later batches then go too (they would
        be consumed out of order)."""
        if not self.batches:
            return None, None
        head = self.batches[0]
        if head.index != index:
            return None, self.drop(f"the batch in flight is generation batch {head.index}, not {index}")
        limit = self.max_staleness * self.steps_per_rollout
        if step - head.submitted_at > limit:
            return None, self.drop(f"generation batch {index} was submitted at step {head.submitted_at}, "
                                   f"{step - head.submitted_at} steps before step {step}, more than "
                                   f"generation.max_staleness={self.max_staleness} generation batches ({limit} steps)")
        return self.batches.pop(0), None

    def drop(self, why: str) -> str:
        """Let every batch in flight go (waiting for any still sampling: the engine is not synced under it)."""
        for batch in self.batches:
            if batch.future is not None:
                batch.future.result()
        self.batches = []
        return why

    def wanted(self, index: int) -> list[int]:
        """Generation batches to submit, in order, once batch `index` is taken: up to index + max_staleness."""
        last = self.batches[-1].index if self.batches else index
        return list(range(last + 1, index + self.max_staleness + 1))

    def push(self, batch: Sampled) -> None:
        if self.batches and batch.index != self.batches[-1].index + 1:
            raise ValueError(f"generation batch {batch.index} submitted after {self.batches[-1].index}")
        self.batches.append(batch)

    def settle(self) -> None:
        """Wait until nothing is being sampled (before a weight sync, an evaluation, a checkpoint)."""
        for batch in self.batches:
            batch.wait()

    def complete(self, batch: Sampled, link, step: int) -> Sample:
        """The Sample of a batch taken (waiting for it: whole batches finish under the weights they started with)."""
        return batch.wait()

    def refill(self, index: int, step: int, prompts_of: Callable, link, group: int, pool) -> None:
        """Once batch `index` is taken and the engine synced to the policy of `step`: submit the batches up to
        index + max_staleness to `pool`, each sampled whole by `link`; `prompts_of(j)`: batch j's positions, dataset
        rows and prompts."""
        for ahead in self.wanted(index):
            positions, rows, prompts = prompts_of(ahead)
            self.push(Sampled(ahead, positions, step, pool.submit(link.sample, prompts, positions, rows, group)))

    def metrics(self) -> dict[str, float]:
        """This rank's figures of the batches ahead since the last call (partial rollouts have some)."""
        return {}

    def record(self, batch) -> tuple[Sample, dict]:
        """What the checkpoint keeps of a batch: its Sample, and the extra fields of a partial one."""
        return batch.wait(), {}

    def restore(self, index: int, positions: list[int], meta: dict, sample: Sample, ended: Optional[list]):
        """A batch from the checkpoint, or why it cannot be restored here (a partial one with rows still running)."""
        if ended is not None and not all(ended):
            return "it holds partial completions (generation.partial_rollouts), which this run does not continue"
        return Sampled(index, positions, meta["submitted_at"], result=sample)

    # --- the checkpoint ----------------------------------------------------------------------------------------

    def save(self, directory: Path, rank: int) -> Path:
        """Write this rank's batches in flight (waiting for them) to `directory`/rollouts_in_flight_<rank>.json."""
        self.settle()
        records = []
        for b in self.batches:
            sample, extra = self.record(b)
            records.append({"index": b.index, "positions": b.positions, "submitted_at": b.submitted_at,
                            **{k: getattr(sample, k) for k in FIELDS}, **extra,
                            "trajectories": None if sample.trajectories is None
                            else [dataclasses.asdict(t) for t in sample.trajectories]})
        path = Path(directory) / FILE.format(rank=rank)
        path.write_text(json.dumps({"format": FORMAT, "rank": rank, "batches": records}))
        return path

    def load(self, directory: Path, positions_of: Callable[[int], list[int]],
             trajectory: Optional[Callable[..., object]] = None) -> list[str]:
        """Restore the batches in flight saved in `directory` (every rank's file), this rank's rows of each:
        `positions_of(index)` names them. Returns what could not be restored (a batch whose rows are not all
        there), one line each; such a batch and those after it are sampled again. `trajectory` rebuilds a
        multi-turn trajectory from its saved fields."""
        saved: dict[int, dict] = {}
        for path in sorted(Path(directory).glob(FILE.format(rank="*"))):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"{path} cannot be read ({e}): resume from an earlier checkpoint") from e
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise UserError(f"{path} is not a file of generation batches in flight of format {FORMAT} (written "
                                "by another posttrain release?): resume from an earlier checkpoint")
            for record in data["batches"]:
                upgrade(record)
                batch = saved.setdefault(record["index"], {"meta": record, "rows": {}})
                group = len(record["prompt_ids"]) // max(len(record["positions"]), 1)
                for i, position in enumerate(record["positions"]):
                    rows = slice(i * group, (i + 1) * group)
                    batch["rows"][position] = {k: (record[k][rows] if record.get(k) is not None else None)
                                               for k in (*FIELDS, PARTIAL_ROWS)}
        self.batches = []
        for index in sorted(saved):
            meta, rows = saved[index]["meta"], saved[index]["rows"]
            positions = positions_of(index)
            missing = [p for p in positions if p not in rows]
            if missing:
                return [f"generation batch {index}: the rows of prompt positions {missing[:4]} are not in "
                        f"{directory}"]
            columns = {k: [v for p in positions for v in rows[p][k]] if rows[positions[0]][k] is not None else None
                       for k in (*FIELDS, PARTIAL_ROWS)}
            ended = columns.pop(PARTIAL_ROWS)
            if columns["trajectories"] is not None:
                try:
                    columns["trajectories"] = [trajectory(**t) for t in columns["trajectories"]]
                except TypeError as e:  # fields another release (or an editor) wrote
                    raise UserError(f"{directory}: a saved trajectory of generation batch {index} cannot be "
                                    f"rebuilt ({e}): resume from an earlier checkpoint") from None
            batch = self.restore(index, positions, meta, Sample(**columns), ended)
            if isinstance(batch, str):
                return [f"generation batch {index}: {batch}"]
            self.batches.append(batch)
        return []


def upgrade(record: dict) -> None:
    """A record of an earlier file with the per-row fields of now: one version for the batch as each row's, each
    token's version its row's, nothing dropped."""
    rows = len(record["prompt_ids"])
    if not isinstance(record["sampled_by"], list):
        record["sampled_by"] = [record["sampled_by"]] * rows
    if "token_versions" not in record:
        record["token_versions"] = [[v] * len(c) for v, c in zip(record["sampled_by"], record["completion_ids"])]
    record.setdefault("dropped", [False] * rows)
