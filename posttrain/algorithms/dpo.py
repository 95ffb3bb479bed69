"""Direct preference optimisation and its family: sigmoid (DPO), ipo, hinge, robust (label smoothing / cDPO), simpo.

    posttrain dpo --config recipes/dpo.yaml
    posttrain dpo --config recipes/dpo_simpo.yaml          # reference-free, length-normalised

Per pair, with sequence log-probs summed (or, for ipo and simpo, averaged) over the completion tokens:

    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)   # simpo: policy_chosen - policy_rejected
    loss   = PREFERENCE_LOSSES[loss_type](logits) + rpo_alpha * (mean token NLL of the chosen completion)

The step's loss is the sum over its pairs / the global pair count (the loop's normaliser), so accumulation and world
size do not change the update. Chosen and rejected go through the model in one concatenated forward.

The reference is a frozen copy of the starting model (loaded by run.py), or, with model.lora.enabled, the policy
with its adapter switched off (no copy), or, with algo.precompute_ref_logprobs, a table of its log-probs computed
once before training and cached in the run directory (the copy is then freed). simpo needs none.

Metrics: rewards/chosen, rewards/rejected (beta x log-ratio, the implicit reward), rewards/margins,
rewards/accuracies (chosen reward > rejected), logps/chosen, logps/rejected (the policy's, as the loss sees them),
logps/accuracies (the policy's own preference: summed log p(chosen) > log p(rejected); at step 0 it is the starting
model's, where rewards/accuracies is 0 because every pair is a tie). demo.metrics.preference_accuracy computes
either outside a run (the demo's before/after number).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from posttrain.algorithms import preference_logps as pl
from posttrain.algorithms.base import Algorithm, Models
from posttrain.config.schema import Recipe
from posttrain.errors import UserError
from posttrain.losses.preference import PREFERENCE_LOSSES, implicit_rewards, preference_logits
from posttrain.batch import Batch

USES_LABEL_SMOOTHING = ("sigmoid", "robust", "simpo")


@dataclass(frozen=True)
class DPOAlgoConfig:
    """The DPO family's knobs (algo.*)."""

    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, hinge, robust (label-noise robust DPO) or simpo (reference-free, length-normalised)."""
    beta: float = 0.1
    """Strength of the implicit KL to the reference (DPO's beta; IPO's tau; SimPO's reward scale, typically 2-10)."""
    label_smoothing: float = 0.0
    """Assumed fraction of flipped preference labels, in [0, 0.5): cDPO for sigmoid, robust DPO for robust, simpo."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (loss_type simpo only)."""
    rpo_alpha: float = 0.0
    """Weight of an SFT term on the chosen completion (RPO): its mean token NLL per pair; 0 turns it off."""
    precompute_ref_logprobs: bool = False
    """Score every pair with the reference once before training, cache it (ref_logprobs.safetensors), free the copy."""

    def validate(self, recipe: Recipe) -> None:
        if self.loss_type not in PREFERENCE_LOSSES:
            raise UserError(f"algo.loss_type is {self.loss_type!r}; choose one of {', '.join(PREFERENCE_LOSSES)}")
        if not self.beta > 0:
            raise UserError(f"algo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"algo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing > 0 and self.loss_type not in USES_LABEL_SMOOTHING:
            raise UserError(f"algo.label_smoothing={self.label_smoothing} has no effect with loss_type "
                            f"{self.loss_type}; it applies to {', '.join(USES_LABEL_SMOOTHING)}. Set it to 0 or "
                            "change algo.loss_type")
        if self.rpo_alpha < 0:
            raise UserError(f"algo.rpo_alpha must be >= 0, got {self.rpo_alpha}")
        if self.simpo_gamma < 0:
            raise UserError(f"algo.simpo_gamma must be >= 0, got {self.simpo_gamma}")


class DPO(Algorithm):
    name = "dpo"
    data_kind = "preference"
    headline_metrics = ("rewards/accuracies", "rewards/margins")
    logprobs_only = True

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.config: DPOAlgoConfig = recipe.algo
        self.spec = PREFERENCE_LOSSES[self.config.loss_type]
        self.lora = recipe.model.lora.enabled
        self.tables: Optional[dict[str, torch.Tensor]] = None

    def models_needed(self):
        """With precompute_ref_logprobs the reference is freed before training (its table replaces it)."""
        needed = super().models_needed()
        return dataclasses.replace(needed, reference=needed.reference and not self.config.precompute_ref_logprobs)

    @property
    def uses_reference(self) -> bool:
        return not self.spec.reference_free

    @property
    def needs_reference(self) -> bool:
        """A frozen copy for run.py to load: not for simpo, and not with LoRA (the adapter-off policy is the base)."""
        return self.uses_reference and not self.lora

    # --- before training ------------------------------------------------------------------------------------------
    def setup(self, backend, models: Models, train_examples, collate, out) -> None:
        """With precompute_ref_logprobs, fill the reference table (or reuse the run directory's cache) and free the
        copy."""
        if not (self.uses_reference and self.config.precompute_ref_logprobs):
            return
        splits = {"train": train_examples}
        if models.eval_examples:
            splits["eval"] = models.eval_examples
        path = Path(out) / pl.CACHE_FILE
        identity = pl.cache_identity(self.recipe, splits)
        tables = pl.load_cached_tables(path, identity) if backend.is_main else None
        tables = backend.broadcast_object(tables)
        if tables is None:
            batch_size = self.recipe.train.per_device_eval_batch_size
            tables = {name: pl.compute_reference_table(backend, models, examples, collate, batch_size, self.lora)
                      for name, examples in splits.items()}
            if backend.is_main:
                pl.save_tables(path, tables, identity)
            backend.barrier()
        self.tables = tables
        if models.reference is not None:  # the table replaces the frozen copy: give its memory back
            models.reference.release()
            models.reference = None

    # --- the loop's three calls -----------------------------------------------------------------------------------
    def prepare(self, batch: Batch, models: Models, training: bool = True) -> Batch:
        """The reference's log-prob sums of every row: from the precomputed table of the batch's split (train or
        eval batches index their own examples), or a forward of the reference (under the loop's autocast)."""
        if not self.uses_reference or batch.ref_logprobs_B is not None:
            return batch
        if self.tables is not None:
            split = "train" if training else "eval"
            if split not in self.tables:
                raise RuntimeError(f"no precomputed reference log-probs for the {split} examples")
            return dataclasses.replace(batch, ref_logprobs_B=pl.lookup(self.tables[split], batch))
        return dataclasses.replace(batch, ref_logprobs_B=pl.reference_sums(models, batch, self.lora))

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(float(batch.num_pairs), device=batch.input_ids_BT.device)

    def loss(self, model, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c, p = self.config, batch.num_pairs
        sums_B, counts_B = pl.sequence_logps(model, batch)
        chosen_sums_P, rejected_sums_P = pl.split_pairs(sums_B, p)
        policy_B = pl.reduce_logps(sums_B, counts_B, self.spec.length_normalised)
        policy_chosen_P, policy_rejected_P = pl.split_pairs(policy_B, p)
        ref_chosen_P = ref_rejected_P = None
        if self.uses_reference:
            if batch.ref_logprobs_B is None:
                raise RuntimeError("DPO.loss needs batch.ref_logprobs_B; call prepare first")
            ref_B = pl.reduce_logps(batch.ref_logprobs_B.to(sums_B.dtype), counts_B, self.spec.length_normalised)
            ref_chosen_P, ref_rejected_P = pl.split_pairs(ref_B, p)
        logits_P = preference_logits(policy_chosen_P, policy_rejected_P, ref_chosen_P, ref_rejected_P)
        loss_P = self.spec.loss(logits_P, beta=c.beta, label_smoothing=c.label_smoothing, simpo_gamma=c.simpo_gamma)
        metrics: dict[str, torch.Tensor] = {}
        if c.rpo_alpha > 0:
            nll_P = -chosen_sums_P / pl.split_pairs(counts_B, p)[0].clamp(min=1)
            loss_P = loss_P + c.rpo_alpha * nll_P
            metrics["nll_loss"] = nll_P.detach().mean()
        chosen_rewards_P, rejected_rewards_P = implicit_rewards(policy_chosen_P, policy_rejected_P, ref_chosen_P,
                                                                ref_rejected_P, beta=c.beta)
        metrics.update({"rewards/chosen": chosen_rewards_P.mean(), "rewards/rejected": rejected_rewards_P.mean(),
                        "rewards/margins": (chosen_rewards_P - rejected_rewards_P).mean(),
                        "rewards/accuracies": (chosen_rewards_P > rejected_rewards_P).float().mean(),
                        "logps/chosen": policy_chosen_P.detach().mean(),
                        "logps/rejected": policy_rejected_P.detach().mean(),
                        "logps/accuracies": (chosen_sums_P > rejected_sums_P).float().mean()})
        return loss_P.sum() / normaliser, metrics
