"""Partial rollouts (generation.partial_rollouts, with generation.max_staleness >= 1): the batches sampled ahead of
training are sampled in chunks of tokens, and a weight sync lands between chunks; a completion still running then
goes on under the new weights from its tokens so far (token-in: prompt + completion so far, nothing re-tokenised),
every token stamped with the policy version that sampled it.

    queue = PartialInFlight(recipe.generation, steps_per_rollout)   # the rollout source builds it (in_flight.py's API)
    queue.refill(index, step, prompts_of, link, group, pool)         # the batches ahead, then `pace` rounds in a thread
    batch, why = queue.take(index, step)                             # waits for the rounds granted, then as InFlight
    sample = queue.complete(batch, link, step)                       # its unfinished rows end now, after the sync

The pace: after each generation batch is drawn, the sampling thread is granted `pace` chunk rounds
(generation.partial_chunks_per_batch), each round one chunk (generation.partial_chunk_tokens new tokens) of every
unfinished row of the oldest unfinished batch ahead, in generation.batch_size calls; the next draw waits for the
rounds granted, syncs, and a batch it needs that is still unfinished ends there under the new weights. So which
tokens each version samples depends on the steps alone, never on timing, and a resumed run equals its uninterrupted
self (a checkpoint keeps the partial completions, their versions and rounds; seeds come from (row, round)).
docs/generation.md says why not a sync whenever the trainer is ready.

Figures (whole step): partial/stale_completion_fraction and partial/stale_token_fraction (completions / tokens with a
token sampled by a version older than the row's latest), partial/versions_per_completion_mean|max, partial/dropped
(completions stopped at generation.partial_max_versions); this rank's partial/chunks_on_the_spot (rounds the trainer
waited for: a batch it needed was unfinished; raise partial_chunks_per_batch when it is often above 0).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from posttrain.config.schema import partial_chunk
from posttrain.generation import SamplingParams
from posttrain.online.engine_link import Sample, sampling_seed
from posttrain.online.in_flight import InFlight


class Partial:
    """One generation batch of this rank sampled in chunks: its rows so far (a Sample), which have ended, and how
    many chunk rounds it has had. Live rows all hold `rounds` x chunk tokens (a row ends on a stop id, at
    max_completion_length, at the engine's context limit, or dropped by the version cap)."""

    def __init__(self, index: int, positions: list[int], submitted_at: int, sample: Sample, ended: list[bool],
                 rounds: int = 0):
        self.index, self.positions, self.submitted_at = index, positions, submitted_at
        self.rows, self.ended, self.rounds = sample, ended, rounds

    @classmethod
    def start(cls, index: int, positions: list[int], submitted_at: int, prompts: list[dict], group: int) -> "Partial":
        """A batch with no token sampled yet: `group` rows per prompt."""
        ids = [list(p["prompt_ids"]) for p in prompts for _ in range(group)]
        empty = lambda: [[] for _ in ids]  # noqa: E731
        rows = Sample(prompt_ids=ids, completion_ids=empty(), logprobs=empty(), truncated=[False] * len(ids),
                      sampled_by=[None] * len(ids), token_versions=empty(), dropped=[False] * len(ids))
        return cls(index, positions, submitted_at, rows, [False] * len(ids))

    @property
    def finished(self) -> bool:
        return all(self.ended)

    def round(self, link, chunk_tokens: int, max_versions: int = 0) -> None:
        """One chunk of every live row, sampled by the engine's weights now (link.synced_at), one engine call per
        generation.batch_size prompts, seeded by (the call's first prompt position, round)."""
        gen, rows, version = link.generation, self.rows, link.synced_at
        group = len(rows.completion_ids) // len(self.positions)
        per_call = (gen.batch_size or len(self.positions)) * group
        asked = min(chunk_tokens, gen.max_completion_length - self.rounds * chunk_tokens)
        for start in range(0, len(rows.completion_ids), per_call):
            live = self.cap(range(start, min(start + per_call, len(rows.completion_ids))), version, max_versions)
            if not live:
                continue
            seed = sampling_seed(link.seed, self.positions[start // group])
            seed = sampling_seed(seed, self.rounds) if self.rounds else seed  # round 0: the unchunked call's seed
            params = replace(SamplingParams.from_config(gen, seed=seed), max_new_tokens=asked)
            out = link.engine.generate([rows.prompt_ids[r] + rows.completion_ids[r] for r in live], params)
            self.absorb(live, out, version, asked, gen.max_completion_length)
        self.rounds += 1

    def cap(self, rows: range, version: Optional[int], max_versions: int) -> list[int]:
        """The live rows of `rows`; with a cap (max_versions > 0), a row whose tokens already span max_versions
        versions, none of them `version`, is dropped instead (ended, truncated, left out of the loss)."""
        live = []
        for r in rows:
            if self.ended[r]:
                continue
            seen = set(self.rows.token_versions[r])
            if max_versions and version not in seen and len(seen) >= max_versions:
                self.ended[r] = self.rows.dropped[r] = self.rows.truncated[r] = True
            else:
                live.append(r)
        return live

    def absorb(self, rows: list[int], out, version: Optional[int], asked: int, max_length: int) -> None:
        """The engine's answer (generation.base.Completions) for `rows`, each asked for `asked` more tokens: a row
        ends on a stop id (not truncated), at max_length, or short of `asked` (the engine's context limit)."""
        sample = self.rows
        for r, ids, logprobs, cut in zip(rows, out.completion_ids, out.logprobs, out.truncated):
            sample.completion_ids[r] += ids
            sample.logprobs[r] += logprobs
            sample.token_versions[r] += [version] * len(ids)
            if sample.sampled_by[r] is None:
                sample.sampled_by[r] = version
            if not cut or len(sample.completion_ids[r]) >= max_length or len(ids) < asked:
                self.ended[r], sample.truncated[r] = True, bool(cut)

    def sample(self) -> Sample:
        """The rows as a Sample (a copy: the record of a finished batch, or of one in flight for a checkpoint)."""
        rows = self.rows
        return replace(rows, completion_ids=[list(c) for c in rows.completion_ids],
                       logprobs=[list(v) for v in rows.logprobs], token_versions=[list(v) for v in rows.token_versions],
                       truncated=list(rows.truncated), sampled_by=list(rows.sampled_by), dropped=list(rows.dropped))


class PartialInFlight(InFlight):
    """InFlight for partial rollouts: its batches are Partial ones, advanced by the rounds granted at each refill."""

    def __init__(self, generation, steps_per_rollout: int):
        super().__init__(generation.max_staleness, steps_per_rollout)
        self.chunk_tokens, self.pace = partial_chunk(generation)
        self.max_versions = generation.partial_max_versions
        self._granted = None  # the rounds in progress (a Future)
        self.on_the_spot = 0  # rounds the trainer waited for since the source last read it

    def settle(self) -> None:
        """Wait for the rounds granted (before a sync, an evaluation, a checkpoint, a take)."""
        if self._granted is not None:
            granted, self._granted = self._granted, None
            granted.result()

    def drop(self, why: str) -> str:
        self.settle()
        self.batches = []
        return why

    def take(self, index: int, step: int):
        self.settle()
        return super().take(index, step)

    def complete(self, batch: Partial, link, step: int) -> Sample:
        """The batch's rows, its unfinished ones sampled to their end now, by the policy of `step` (synced first)."""
        if not batch.finished:
            link.sync(step)
        while not batch.finished:
            batch.round(link, self.chunk_tokens, self.max_versions)
            self.on_the_spot += 1
        return batch.sample()

    def refill(self, index: int, step: int, prompts_of, link, group: int, pool) -> None:
        """Start the batches up to index + max_staleness (none sampled yet), then grant the thread `pace` rounds."""
        for ahead in self.wanted(index):
            positions, _, prompts = prompts_of(ahead)
            self.push(Partial.start(ahead, positions, step, prompts, group))
        self._granted = pool.submit(self._rounds, link)

    def _rounds(self, link) -> None:
        for _ in range(self.pace):
            batch = next((b for b in self.batches if not b.finished), None)
            if batch is None:
                return
            batch.round(link, self.chunk_tokens, self.max_versions)

    def metrics(self) -> dict[str, float]:
        """This rank's figures since the last call."""
        waited, self.on_the_spot = self.on_the_spot, 0
        return {"partial/chunks_on_the_spot": float(waited)}

    # --- the checkpoint: a batch's rows so far, which have ended and its rounds --------------------------------

    def record(self, batch: Partial) -> tuple[Sample, dict]:
        return batch.sample(), {"ended": list(batch.ended), "rounds": batch.rounds}

    def restore(self, index: int, positions: list[int], meta: dict, sample: Sample, ended: Optional[list]):
        """A batch from the file (one saved whole has every row ended), or why not: its live rows must hold `rounds`
        chunks each (rows of ranks that sampled it apart, another world size now, may not)."""
        ended = list(ended) if ended is not None else [True] * len(sample.completion_ids)
        rounds = meta.get("rounds", 0)
        if any(not e and len(c) != rounds * self.chunk_tokens for e, c in zip(ended, sample.completion_ids)):
            return (f"its unfinished completions do not all hold {rounds} chunks of generation.partial_chunk_tokens="
                    f"{self.chunk_tokens} tokens (saved by another world size, or with another chunk size)")
        return Partial(index, positions, meta["submitted_at"], sample, ended, rounds)


def partial_metrics(figures: list[tuple[int, int, int, bool]]) -> dict[str, float]:
    """The step's partial/* figures from every completion's Sample.version_figures."""
    spans = [f[0] for f in figures]
    tokens = sum(f[2] for f in figures)
    return {"partial/stale_completion_fraction": sum(s > 1 for s in spans) / max(len(spans), 1),
            "partial/stale_token_fraction": sum(f[1] for f in figures) / max(tokens, 1),
            "partial/versions_per_completion_mean": sum(spans) / max(len(spans), 1),
            "partial/versions_per_completion_max": float(max(spans, default=0)),
            "partial/dropped": float(sum(f[3] for f in figures))}
