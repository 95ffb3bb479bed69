"""Knowledge distillation: the student (the policy) learns to match a frozen teacher's next-token distributions on
completions from the data or sampled by the student itself (GKD, Agarwal et al. 2024).

    posttrain distill --config recipes/distill.yaml

- data: prompt + completion rows (the SFT formats: docs/distill.md); the loss covers the completion tokens.
- `algo.lmbda` and `algo.beta` (DistillAlgoConfig below): how many steps the student samples on-policy with the run's
  engine (generation.*), and which divergence (losses/distill.py); both models at `algo.temperature`.
- the teacher (`algo.teacher_model_name_or_path`) is a frozen role loaded like the reference: partitioned under
  ZeRO-3, in CPU memory between forwards with `algo.teacher_offload`, or (launcher: ray) replicas of its own placed
  apart (`placement.teacher`, `placement.colocate`), which return its logits. It must share the student's tokenizer and
  vocabulary; another is exit 2 naming both models, before any weights load. Or it is served by vLLM
  (`algo.teacher_server`): its top-k log-probs per position, fetched in `prepare` (generation/teacher_server.py).

The loss of a step is (sum of per-token divergences over all completion tokens of the step) / (their count): the
loop passes that global count as `normaliser`, so accumulation and world size do not change the update. The
teacher's logits are computed inside the loss, one micro-batch at a time, and never kept past it: only those of the
rows that predict a completion token (Role.logits_at; a Ray replica sends back only those), as the student's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from posttrain.algorithms.base import Algorithm, Models, Objective, Role
from posttrain.models.forward import policy_logits, policy_logits_at
from posttrain.batch import Batch
from posttrain.config.schema import Recipe
from posttrain.errors import UserError
from posttrain.losses.distill import distill_loss_at, predicting_rows, topk_distill_loss
from posttrain.ops.logprobs import masked_mean, masked_sum


@dataclass(frozen=True)
class DistillAlgoConfig:
    teacher_model_name_or_path: Optional[str] = None
    """The teacher: hub id or local directory of a causal LM with the student's tokenizer and vocabulary (or give
    teacher_server)."""
    teacher_model_revision: Optional[str] = None
    """Hub revision (branch, tag or commit) of the teacher."""
    beta: float = 0.5
    """Divergence, in [0, 1]: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the
    generalised JSD with mixture beta * teacher + (1 - beta) * student (TRL's convention)."""
    lmbda: float = 0.5
    """Fraction of steps whose completions the student samples itself (on-policy); 0: the data's only (supervised
    KD)."""
    temperature: Optional[float] = None
    """Softmax temperature of both models in the loss; null: generation.temperature (the one the student samples at),
    so the teacher scores the tokens at the temperature they were sampled with."""
    teacher_offload: bool = False
    """Keep the teacher's weights in CPU memory between forwards (ZeRO-3: DeepSpeed's parameter offload)."""
    teacher_server: Optional[str] = None
    """Instead of a local teacher: the URL of a `posttrain serve` vLLM server serving it (http://host:port); the loss
    is then over its top-k tokens, renormalised (an approximation: docs/distill.md)."""
    teacher_top_k: int = 20
    """With teacher_server: tokens per position the server returns (its --max-logprobs must be at least this)."""

    def loss_temperature(self, recipe: Recipe) -> float:
        return self.temperature if self.temperature is not None else recipe.generation.temperature

    def validate(self, recipe: Recipe) -> None:
        """Everything checkable before the processes start; the loader calls it after building the recipe."""
        if bool(self.teacher_model_name_or_path) == bool(self.teacher_server):
            raise UserError("name the teacher once: algo.teacher_model_name_or_path (a hub id or a local directory "
                            "sharing the student's tokenizer) or algo.teacher_server (a `posttrain serve` URL)")
        if self.teacher_server and (self.teacher_top_k < 1 or recipe.data.packing):
            raise UserError(f"algo.teacher_server needs algo.teacher_top_k >= 1 (got {self.teacher_top_k}) and "
                            "data.packing=false (the server scores each sequence on its own)")
        if not 0.0 <= self.beta <= 1.0 or not 0.0 <= self.lmbda <= 1.0:
            raise UserError(f"need algo.beta and algo.lmbda in [0, 1]; got {self.beta} and {self.lmbda}")
        if not self.loss_temperature(recipe) > 0:
            raise UserError(f"algo.temperature must be > 0 (it is generation.temperature when null), got "
                            f"{self.loss_temperature(recipe)}; set algo.temperature=1.0")
        if self.lmbda > 0:
            if not recipe.data.completion_only_loss:
                raise UserError("algo.lmbda > 0 keeps each row's prompt (the tokens before its first trained token) "
                                "and samples the completion: set data.completion_only_loss=true")
            if recipe.generation.max_staleness:
                raise UserError("generation.max_staleness (generation.async) is not supported by distill; set "
                                "generation.max_staleness=0")


class Distill(Algorithm):
    name = "distill"

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.config: DistillAlgoConfig = recipe.algo
        self.temperature = self.config.loss_temperature(recipe)
        self.teacher_config = self.server = None
        if self.config.teacher_server:  # top-k log-probs from a server (checked in preflight)
            from posttrain.generation.teacher_server import TeacherServer

            gen = recipe.generation
            self.server = TeacherServer(self.config.teacher_server, self.config.teacher_top_k, gen.request_timeout_s,
                                        gen.request_retries)
        else:
            from posttrain.models.teacher import teacher_model_config

            self.teacher_config = teacher_model_config(recipe.model, self.config.teacher_model_name_or_path,
                                                       self.config.teacher_model_revision)

    def preflight(self) -> None:
        """The teacher shares the student's vocabulary: a server answers and tokenizes like the student; a local
        teacher's config and tokenizer files match (before any weights load)."""
        if self.server is not None:
            from posttrain.models.load import check_model_source, load_tokenizer

            check_model_source(self.recipe.model)
            self.server.check(load_tokenizer(self.recipe.model), self.recipe.model.name_or_path)
        else:
            from posttrain.models.teacher import check_same_vocabulary

            check_same_vocabulary(self.recipe.model, self.teacher_config)

    def teacher_model(self):
        return self.teacher_config

    def placement(self, role: str) -> str:
        return "offload" if role == "teacher" and self.config.teacher_offload else "local"

    @property
    def source_kind(self) -> str:
        """lmbda 0: supervised KD on the dataset's completions; else the student completes a seeded share of them."""
        return "distill" if self.config.lmbda > 0 else "dataset"

    def prepare(self, batch: Batch, models: Models, training: bool = True) -> Batch:
        """A server teacher's top-k log-probs for every real token of the batch (padded layout), fetched once."""
        if self.server is None or batch.teacher_topk_ids_BTK is not None:
            return batch
        lengths = batch.attention_mask_BT.sum(-1).tolist()
        rows = [ids[:n] for ids, n in zip(batch.input_ids_BT.tolist(), lengths)]
        logprobs, ids = self.server.topk(rows)
        shape = (*batch.input_ids_BT.shape, self.config.teacher_top_k)
        logprobs_BTK, ids_BTK = torch.zeros(shape), torch.arange(shape[-1]).expand(shape).clone()
        for row, (row_logprobs_TK, row_ids_TK) in enumerate(zip(logprobs, ids)):
            logprobs_BTK[row, : lengths[row]], ids_BTK[row, : lengths[row]] = row_logprobs_TK, row_ids_TK
        device = batch.input_ids_BT.device
        return dataclasses.replace(batch, teacher_topk_logprobs_BTK=logprobs_BTK.to(device),
                                   teacher_topk_ids_BTK=ids_BTK.to(device))

    def count(self, batch: Batch) -> torch.Tensor:
        return batch.completion_mask_BT.sum()

    def objectives(self, step: int, models: Optional[Models]) -> dict[str, Objective]:
        """The policy learns against the run's teacher role (local or served apart)."""
        return {"policy": Objective(self.count, functools.partial(self.loss, teacher=models.teacher))}

    def loss(self, model, batch: Batch, normaliser: torch.Tensor,
             teacher: Optional[Role] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The divergence to the teacher's distributions over the completion tokens: a server teacher's top-k
        (fetched in prepare), or the `teacher` role's logits, computed here one micro-batch at a time."""
        mask_BT = batch.completion_mask_BT
        if batch.teacher_topk_ids_BTK is not None:
            out = topk_distill_loss(policy_logits(model, batch), batch.teacher_topk_logprobs_BTK,
                                    batch.teacher_topk_ids_BTK, batch.input_ids_BT, mask_BT, self.config.beta,
                                    self.temperature)
        else:
            # both output layers project only the rows that predict a completion token (the teacher's are kept for
            # the loss's backward; no (B, T, V) logits of either model exist where the heads allow)
            rows_n = predicting_rows(mask_BT)
            teacher_nV = teacher.logits_at(batch, rows_n)
            out = distill_loss_at(policy_logits_at(model, batch, rows_n), teacher_nV, batch.input_ids_BT, mask_BT,
                                  self.config.beta, self.temperature)
        metrics = {name: masked_mean(value_BT, mask_BT) for name, value_BT in out.metrics_BT.items()}
        return masked_sum(out.loss_BT, mask_BT) / normaliser, metrics
