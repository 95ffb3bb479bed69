"""The one link between the trainer and its generation engine: weight sync, policy versions, seeded sampling, adapter
checks, and the `Sample` every online path trains or scores on (GRPO, PPO, distillation, agents, batches sampled
ahead, held-out evaluation).

    link = EngineLink(recipe, backend, models.policy, tokenizer, servers)   # a source builds it
    link.sync(step)                                   # the engine gets the policy of `step` when generation.sync_every says
    sample = link.sample(prompts, positions, rows, group=G)   # G completions per prompt, seeded by position
    sample.completion_ids, sample.logprobs, sample.truncated, sample.sampled_by, sample.trajectories
    link.sleep(); link.close(final_step); link.end()

Sync policy: an engine holding its own copy of the weights (vllm, servers) gets the trainer's when the policy has
stepped `generation.sync_every` times since the last sync (always before the first, and when forced: evaluation, the
run's end). A sync streams the backend's buckets to the engine, stamps the version (`engine.set_version`), checks an
adapter-only sync by probing (generation.lora_sync=adapter), and makes every rank wait for a shared engine's sync.
A vision-language policy's frozen vision tower / projector go with the first sync only (they never change after it);
the first sync says which of them train.

Seeded sampling: each engine call (`generation.batch_size` prompts) is seeded by (seed, global position of its first
prompt), so resume and any accumulation split reproduce it; greedy calls (evaluation) take no seed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch

from posttrain.agents import AgentLoop
from posttrain.generation import SamplingParams, make_engine
from posttrain.generation.adapter_sync import check_delivery
from posttrain.models.vision import PROJECTOR_NAMES, TOWER_NAMES, sync_note
from posttrain.rewards import exact_match


def sampling_seed(seed: int, position: int) -> int:
    """The seed of a generate call whose first prompt sits at `position` of the global prompt order."""
    return (seed * 1_000_003 + position) % (2**62)


PER_PROMPT = ("prompts", "positions", "dataset_index")
PER_NAME = ("per_function", "extra")  # name -> one value per row


@dataclass
class Sample:
    """What the engine answered for a list of prompts, G rows per prompt in prompt order; the one record from the
    engine to the batch. The engine fills the rows; the rollout source adds the prompts it asked (`asked`) and what
    the rewards said (`take_scores`); dynamic sampling keeps or drops whole prompt groups (`groups`, `join`).
    Per-prompt fields hold one value per prompt, the others one per row."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    """Each row's prompt tokens (multi-turn: the trajectory's opening, templated with the tools)."""
    completion_ids: list[list[int]] = field(default_factory=list)
    """Each row's tokens after the prompt (multi-turn: the model's and the appended messages' tokens)."""
    logprobs: list[list[float]] = field(default_factory=list)
    """The sampler's log-prob of each completion token (0.0 at appended tokens)."""
    truncated: list[bool] = field(default_factory=list)
    """The row hit generation.max_completion_length without an end of sequence."""
    trajectories: Optional[list] = None
    """Multi-turn runs: each row's agents.Trajectory (messages, tool figures); None for single-turn sampling."""
    sampled_by: list[Optional[int]] = field(default_factory=list)
    """Each row's policy version (optimiser step) the engine's weights were from, its first token's where a partial
    rollout spans several (the oldest); None: the policy itself (hf)."""
    token_versions: list[list[Optional[int]]] = field(default_factory=list)
    """The policy version that sampled each completion token (generation.partial_rollouts: several per row)."""
    dropped: list[bool] = field(default_factory=list)
    """The row passed generation.partial_max_versions and was stopped there: left out of the loss."""
    # the prompts asked, one per prompt (the rollout source's `asked`)
    prompts: list[dict] = field(default_factory=list)
    """The tokenised examples ({"prompt_ids", "prompt", "columns"})."""
    positions: list[int] = field(default_factory=list)
    """Each prompt's position in the seeded global prompt order."""
    dataset_index: list[int] = field(default_factory=list)
    """Each prompt's row in the dataset."""
    # what the rewards said, one per row (`take_scores`)
    texts: list[str] = field(default_factory=list)
    """What the rewards scored (a multi-turn trajectory's last model turn)."""
    total: list[float] = field(default_factory=list)
    """The weighted total reward."""
    per_function: dict[str, list[float]] = field(default_factory=dict)
    """Each reward function's value (NaN: missing)."""
    scored: list[bool] = field(default_factory=list)
    """Some reward scored the row (False: every function returned None; advantage 0, out of the metrics)."""
    extra: dict[str, list] = field(default_factory=dict)
    """What the reward functions logged through log_extra: column -> one value per row."""
    filler: list[bool] = field(default_factory=list)
    """Rows standing in for missing groups (dynamic sampling out of draws): masked out of the loss."""

    @property
    def group(self) -> int:
        """Rows per prompt."""
        return len(self.completion_ids) // max(len(self.prompts), 1)

    @property
    def skipped(self) -> int:
        """(function, row) values missing (a reward skipped or returned None)."""
        return sum(math.isnan(v) for values in self.per_function.values() for v in values)

    def completion_masks(self) -> list[list[int]]:
        """1 at the tokens the model produced (trained), 0 at tokens appended by tools or an environment and at every
        token of a filler or dropped row."""
        if self.trajectories is not None:
            masks = [t.completion_mask for t in self.trajectories]
        else:
            masks = [[1] * len(ids) for ids in self.completion_ids]
        fillers, dropped = self.filler or [False] * len(masks), self.dropped or [False] * len(masks)
        return [[0] * len(m) if filler or gone else m for m, filler, gone in zip(masks, fillers, dropped)]

    def version_figures(self) -> list[tuple[int, int, int, bool]]:
        """Per row: (versions its tokens span, tokens sampled by a version older than its latest, tokens, dropped),
        for the partial/* figures (online/partial.py)."""
        figures = []
        for versions, dropped in zip(self.token_versions, self.dropped or [False] * len(self.token_versions)):
            known = [v for v in versions if v is not None]
            latest = max(known, default=None)
            figures.append((len(set(known)), sum(v < latest for v in known), len(versions), bool(dropped)))
        return figures

    def aligned(self, values: list[list], start: int, stop: int, shape_BT: tuple[int, int], fill=0,
                dtype=torch.float32) -> torch.Tensor:
        """A per-completion-token field (`logprobs`, `token_versions`) of rows [start, stop) as a [B, T] tensor
        aligned with their prompt + completion rows, `fill` elsewhere (None values too)."""
        out_BT = torch.full(shape_BT, fill, dtype=dtype)
        for row, (p, row_values) in enumerate(zip(self.prompt_ids[start:stop], values[start:stop])):
            out_BT[row, len(p) : len(p) + len(row_values)] = torch.tensor(
                [fill if v is None else v for v in row_values], dtype=dtype)
        return out_BT

    def completion_texts(self, tokenizer) -> list[str]:
        """What rewards score as each row's completion: the model's last turn, or the decoded completion."""
        if self.trajectories is not None:
            return [t.final_text for t in self.trajectories]
        return tokenizer.batch_decode(self.completion_ids, skip_special_tokens=True)

    def rows(self, mask_truncated: bool = False) -> list[dict]:
        """Prompt + completion rows for collation: input_ids and a completion_mask over the model's tokens (none of a
        truncated row's with `mask_truncated`)."""
        return [{"input_ids": p + c, "completion_mask": [0] * len(p) + [m * int(not (mask_truncated and cut))
                                                                          for m in mask]}
                for p, c, cut, mask in zip(self.prompt_ids, self.completion_ids, self.truncated,
                                           self.completion_masks())]

    # --- what the rollout source adds ------------------------------------------------------------------------------

    def asked(self, prompts: list[dict], positions: list[int], dataset_index: list[int]) -> "Sample":
        """The sample with the prompts it answers (their examples, prompt-order positions and dataset rows)."""
        return replace(self, prompts=prompts, positions=positions, dataset_index=dataset_index)

    def take_scores(self, texts: list[str], scores) -> "Sample":
        """The sample with what its rewards said (online/scoring.score's texts and rewards.Scores)."""
        return replace(self, texts=texts, total=scores.total_B.tolist(),
                       per_function={k: v.tolist() for k, v in scores.per_function.items()},
                       scored=scores.scored_B.tolist(), extra=dict(scores.logged.extra))

    def groups(self) -> list["Sample"]:
        """One Sample per prompt, in order."""
        g = self.group
        return [self._rows(p, slice(p * g, (p + 1) * g)) for p in range(len(self.prompts))]

    def _rows(self, prompt: int, rows: slice) -> "Sample":
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in PER_PROMPT:
                values[f.name] = value[prompt : prompt + 1]
            elif f.name in PER_NAME:
                values[f.name] = {k: v[rows] for k, v in value.items()}
            else:
                values[f.name] = None if value is None else value[rows]
        return Sample(**values)

    @classmethod
    def join(cls, parts: list["Sample"], fillers: int = 0) -> "Sample":
        """The parts, in order, as one; the rows of the last `fillers` parts are marked as fillers."""
        values = {}
        for f in fields(cls):
            if f.name in PER_NAME:  # a name one part lacks (a log_extra column logged sometimes) is None there
                names = dict.fromkeys(k for p in parts for k in getattr(p, f.name))
                values[f.name] = {k: [v for p in parts for v in getattr(p, f.name).get(k, [None] * len(p.texts))]
                                  for k in names}
            elif f.name == "trajectories":
                values[f.name] = None if parts[0].trajectories is None else [t for p in parts for t in p.trajectories]
            elif f.name != "filler":
                values[f.name] = [v for p in parts for v in getattr(p, f.name)]
        filler_rows = sum(len(p.completion_ids) for p in parts[len(parts) - fillers :]) if fillers else 0
        values["filler"] = [False] * (len(values["completion_ids"]) - filler_rows) + [True] * filler_rows
        return cls(**values)

    def metric(self, name: str, answer_column: str = "answer") -> torch.Tensor:
        """metric_B for dynamic sampling: accuracy (exact match against the answer column; NaN without a reference)
        or reward (the total); NaN for a row no reward scored, which trains on advantage 0 whatever it is."""
        if name == "reward":
            values = self.total
        else:
            g = self.group
            references = [p["columns"].get(answer_column) for p in self.prompts for _ in range(g)]
            values = exact_match(completions=self.texts, answer=references)
        return torch.tensor([math.nan if v is None or not scored else v for v, scored in zip(values, self.scored)],
                            dtype=torch.float64)


class EngineLink:
    """The trainer's side of its generation engine (see the module docstring)."""

    def __init__(self, recipe, backend, policy, tokenizer, servers=None, vision=None):
        """vision: a vision-language policy's data.images.ImageEncoder (prompts' images -> pixel tensors), which the
        engine then takes with the prompts."""
        self.backend, self.policy, self.generation, self.seed = backend, policy, recipe.generation, recipe.seed
        self.engine = make_engine(recipe, backend, policy.model, tokenizer, servers)
        self.vision_modules: tuple[str, ...] = ()  # a VLM's: their frozen tensors go with the first sync only
        if vision is not None:
            self.engine.take_images(vision)
            self.vision_modules = TOWER_NAMES + PROJECTOR_NAMES
        self.agent: Optional[AgentLoop] = None  # agent.tools / agent.environment: multi-turn trajectories
        if recipe.agent.enabled:
            in_step = None
            if self.engine.collective:  # ranks whose trajectories all ended keep joining the others' calls
                in_step = lambda n: int(backend.all_reduce_sum(torch.tensor(float(n))).item())  # noqa: E731
            self.agent = AgentLoop.from_recipe(recipe, tokenizer, self.engine, in_step)
        self.synced_at: Optional[int] = None
        """The step whose policy the engine last received (None: never synced, or it is the policy itself)."""
        self.sync_seconds = 0.0
        """Seconds spent syncing since the caller last set it to 0."""

    @classmethod
    def over(cls, engine, backend, generation, seed: int = 0, agent: Optional[AgentLoop] = None) -> "EngineLink":
        """A link over an engine built elsewhere (one-process evaluation, tests): it samples and scores alike, and
        syncs nothing (no policy to take weights from)."""
        link = cls.__new__(cls)
        link.backend, link.policy, link.generation, link.seed = backend, None, generation, seed
        link.engine, link.agent, link.synced_at, link.sync_seconds = engine, agent, None, 0.0
        link.vision_modules = ()
        return link

    @property
    def with_environment(self) -> bool:
        """A multi-turn run whose environment adds its own reward."""
        return self.agent is not None and self.agent.environment is not None

    def sync(self, step: int, force: bool = False) -> None:
        """Before generating for `step`: the engine gets the trainer's weights if it holds its own copy and the
        policy has stepped generation.sync_every times since the last sync (always the first time, and with
        `force`)."""
        engine, gen = self.engine, self.generation
        if not engine.holds_copy or self.synced_at == step:
            return
        if not force and self.synced_at is not None and step - self.synced_at < gen.sync_every:
            return
        started = time.perf_counter()
        if engine.shared:  # servers: every rank's own generations (a batch sampled ahead) end before the sync lands
            self.backend.barrier()
        buckets = self.backend.weight_buckets(self.policy.model, gen.sync_bucket_mb, engine.adapter_only,
                                              self._frozen_out())
        engine.load_weights(buckets)  # one load, streamed bucket by bucket as the backend gathers them
        engine.set_version(step)
        if engine.adapter_only:  # generation.lora_sync=adapter: the syncing ranks probe their servers, all ranks check
            probes = [p for part in self.backend.all_gather_object(engine.delivery_probes()) for p in part]
            check_delivery(probes, self.policy, self.backend.device, gen.lora_check_atol, step)
        if engine.shared:  # servers: no rank generates before rank 0's sync has landed
            self.backend.barrier()
        self.synced_at = step
        self.sync_seconds += time.perf_counter() - started

    def _frozen_out(self) -> tuple[str, ...]:
        """The vision modules whose frozen tensors this sync leaves out: none at the first sync, which sends every
        tensor (an engine started from other weights still ends up with the trainer's) and says which train."""
        if not self.vision_modules:
            return ()
        if self.synced_at is None:
            if self.backend.is_main:
                print(f"posttrain: weight sync: {sync_note(self.backend.unwrap(self.policy.model))}", flush=True)
            return ()
        return self.vision_modules

    def sample(self, prompts: list[dict], positions: list[int], rows: Optional[list[int]] = None, group: int = 1,
               greedy: bool = False) -> Sample:
        """`group` completions per prompt ({"prompt_ids", "prompt", "columns"}), `generation.batch_size` prompts
        per engine call, each call seeded by the global position of its first prompt (`positions`), or greedy.
        `rows`: each prompt's dataset row, for an environment (default: positions). Every rank makes the same
        number of calls (equal prompts per rank), as ZeRO-3's parameter gathering needs."""
        gen, rows = self.generation, rows if rows is not None else positions
        per_call = gen.batch_size or len(prompts)
        out = Sample(trajectories=[] if self.agent is not None else None)
        for start in range(0, len(prompts), per_call):
            chunk = [p for p in prompts[start : start + per_call] for _ in range(group)]
            if greedy:
                params = SamplingParams(max_new_tokens=gen.max_completion_length, temperature=0.0)
            else:
                params = SamplingParams.from_config(gen, seed=sampling_seed(self.seed, positions[start]))
            with self.backend.autocast():
                if self.agent is None:
                    prompt_ids = [p["prompt_ids"] for p in chunk]
                    images = {"images": [p.get("images", []) for p in chunk]} if self.engine.takes_images else {}
                    completions = self.engine.generate(prompt_ids, params, **images)
                    completion_ids, logprobs, truncated = (completions.completion_ids, completions.logprobs,
                                                           completions.truncated)
                else:  # multi-turn: the trajectories' own prompt and completion tokens
                    turns = self.agent.run(chunk, [r for r in rows[start : start + per_call] for _ in range(group)],
                                           params)
                    out.trajectories += turns
                    prompt_ids, completion_ids = [t.prompt_ids for t in turns], [t.completion_ids for t in turns]
                    logprobs, truncated = [t.logprobs for t in turns], [t.truncated for t in turns]
            out.prompt_ids += prompt_ids
            out.completion_ids += completion_ids
            out.logprobs += logprobs
            out.truncated += truncated
        out.sampled_by = [self.synced_at] * len(out.completion_ids)
        out.token_versions = [[self.synced_at] * len(ids) for ids in out.completion_ids]
        out.dropped = [False] * len(out.completion_ids)
        return out

    def figures(self) -> dict[str, float]:
        """This rank's engine figures since the last call: generation/prefix_cache_hit_fraction (the share of prompt
        tokens its prefix cache served, where the engine counts them: in-process, generation.vllm.enable_prefix_caching)."""
        hits = self.engine.prefix_cache_hits()
        return {} if hits is None else {"generation/prefix_cache_hit_fraction": hits[0] / max(hits[1], 1)}

    def sleep(self) -> None:
        """Training gets the engine's accelerator memory back (vLLM sleep mode on a GPU)."""
        self.engine.sleep()

    def close(self, step: int) -> None:
        """After the run: an engine that outlives it (servers) gets the final policy, then lets go of what it holds
        for syncing."""
        if self.engine.outlives_run:
            self.sync(step, force=True)
        self.engine.close()

    def end(self) -> None:
        """After the run's last collective: an engine with a runtime of its own in this process tears it down."""
        self.engine.end()
