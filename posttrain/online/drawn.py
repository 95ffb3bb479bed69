"""One rank's drawn prompt groups, sampled and scored: what the rollout source builds its micro-batches from.

    drawn = Drawn(...)                       # a generation batch: G consecutive completions per prompt
    groups = drawn.groups()                  # one Drawn per prompt, for dynamic sampling to keep or drop
    step = Drawn.join(kept + fillers, fillers=len(fillers))   # fillers: completions masked out of the loss

Per-prompt fields hold one value per group, the others one per completion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from posttrain.rewards import exact_match

PER_PROMPT = ("positions", "prompts", "dataset_index")
PER_NAME = ("per_function", "extra")  # name -> one value per completion


@dataclass
class Drawn:
    positions: list[int]
    """Per prompt: its position in the seeded global prompt order."""
    prompts: list[dict]
    """Per prompt: the tokenised example ({"prompt_ids", "prompt", "columns"})."""
    dataset_index: list[int]
    """Per prompt: its row in the dataset."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    """The sampler's log-prob of each completion token."""
    truncated: list[bool]
    texts: list[str]
    """What the rewards scored (a multi-turn trajectory's last model turn)."""
    total: list[float]
    """The weighted total reward."""
    per_function: dict[str, list[float]]
    """Each reward function's value (NaN: missing)."""
    lags: list[int]
    """Optimiser steps from the sampling policy to the one trained."""
    sampled_by: list[Optional[int]]
    """The policy version that sampled each completion (None: the policy itself)."""
    trajectories: Optional[list] = None
    """Multi-turn trajectories (posttrain.agents), else None."""
    extra: dict[str, list] = field(default_factory=dict)
    """What the reward functions logged through log_extra: column -> one value per completion."""
    filler: list[bool] = field(default_factory=list)
    """Completions standing in for missing groups (dynamic sampling out of draws): masked out of the loss."""
    scored: list[bool] = field(default_factory=list)
    """Some reward scored the completion (False: every function returned None; advantage 0, out of the metrics)."""

    def __post_init__(self):
        if not self.filler:
            self.filler = [False] * len(self.completion_ids)
        if not self.scored:
            self.scored = [True] * len(self.completion_ids)

    @property
    def group(self) -> int:
        return len(self.completion_ids) // max(len(self.prompts), 1)

    @property
    def skipped(self) -> int:
        """(function, completion) values missing (a reward skipped or returned None)."""
        return sum(math.isnan(v) for values in self.per_function.values() for v in values)

    def groups(self) -> list["Drawn"]:
        """One Drawn per prompt, in order."""
        g = self.group
        return [self._rows(p, slice(p * g, (p + 1) * g)) for p in range(len(self.prompts))]

    def _rows(self, prompt: int, rows: slice) -> "Drawn":
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in PER_PROMPT:
                values[f.name] = value[prompt : prompt + 1]
            elif f.name in PER_NAME:
                values[f.name] = {k: v[rows] for k, v in value.items()}
            else:
                values[f.name] = None if value is None else value[rows]
        return Drawn(**values)

    @classmethod
    def join(cls, parts: list["Drawn"], fillers: int = 0) -> "Drawn":
        """The parts, in order, as one; the last `fillers` parts are marked as fillers."""
        values = {}
        for f in fields(cls):
            if f.name in PER_NAME:  # a name one part lacks (a log_extra column logged sometimes) is None there
                names = dict.fromkeys(k for p in parts for k in getattr(p, f.name))
                values[f.name] = {k: [v for p in parts for v in getattr(p, f.name).get(k, [None] * len(p.texts))]
                                  for k in names}
            elif f.name == "trajectories":
                values[f.name] = None if parts[0].trajectories is None else [t for p in parts for t in p.trajectories]
            else:
                values[f.name] = [v for p in parts for v in getattr(p, f.name)]
        filler_rows = sum(len(p.completion_ids) for p in parts[len(parts) - fillers :]) if fillers else 0
        values["filler"] = [False] * (len(values["completion_ids"]) - filler_rows) + [True] * filler_rows
        return cls(**values)

    def figures(self, logged: dict[str, list[float]]) -> "RankFigures":
        """What this rank contributes to the step's figures (gathered from every rank); `logged`: the reward
        functions' log_metric values of every draw of the step."""
        return RankFigures(total=self.total, scored=self.scored, per_function=self.per_function, skipped=self.skipped,
                           logged=logged, lengths=[len(ids) for ids in self.completion_ids], truncated=self.truncated,
                           lags=self.lags,
                           agent=[t.stats() for t in self.trajectories] if self.trajectories is not None else None,
                           untemplated=[bool(p.get("untemplated")) for p in self.prompts])

    def metric(self, name: str, answer_column: str = "answer") -> torch.Tensor:
        """metric_B for dynamic sampling: accuracy (exact match against the answer column; NaN without a reference)
        or reward (the total); NaN for a completion no reward scored, which trains on advantage 0 whatever it is."""
        if name == "reward":
            values = self.total
        else:
            g = self.group
            references = [p["columns"].get(answer_column) for p in self.prompts for _ in range(g)]
            values = exact_match(completions=self.texts, answer=references)
        return torch.tensor([math.nan if v is None or not scored else v for v, scored in zip(values, self.scored)],
                            dtype=torch.float64)


@dataclass
class RankFigures:
    """One rank's share of a step's figures, gathered from every rank (rank 0's first) so rewards, advantages and
    metrics are computed on the whole step; one value per completion unless said."""

    total: list[float]
    """The weighted total reward."""
    scored: list[bool]
    """Some reward scored the completion."""
    per_function: dict[str, list[float]]
    """Each reward function's value (NaN: missing)."""
    skipped: int
    """(function, completion) values missing, on this rank."""
    logged: dict[str, list[float]]
    """The reward functions' log_metric values (name -> every value logged)."""
    lengths: list[int]
    """Completion tokens."""
    truncated: list[bool]
    """Hit max_completion_length without end of sequence."""
    lags: list[int]
    """Optimiser steps from the sampling policy to the one trained."""
    agent: Optional[list[dict]]
    """Multi-turn runs: each trajectory's stats (agents.Trajectory.stats); None for single-turn sampling."""
    untemplated: list[bool] = field(default_factory=list)
    """Per prompt: plain text tokenised as it is for a tokenizer with a chat template (rundir/health.py)."""

