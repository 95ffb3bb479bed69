"""GRPO family: sample G completions per prompt, score them, train on group-relative advantages.

    posttrain grpo --config recipes/grpo.yaml

Covers GRPO (Shao et al. 2024), DAPO's token-level loss and clip-higher (Yu et al. 2025), Dr. GRPO (Liu et al.
2025) and GSPO's sequence-level ratio (Zheng et al. 2025), picked by `algo.loss_type`, `algo.epsilon_high`,
`algo.scale_rewards` and `algo.importance_sampling_level`. Sampling, scoring and batching live in
`posttrain.online.rollout_source`; the math lives in `ops.advantages`, `losses.policy`; this file wires them.

Batch semantics (stated here once; the checks below enforce them):
- `train.per_device_train_batch_size` counts COMPLETIONS (sequences) per device per micro-batch.
- completions per device per step = per_device_train_batch_size x gradient_accumulation_steps; it must be a
  multiple of `algo.num_generations`, because a prompt's G completions are generated, scored and given advantages on
  one device (no collective inside a group). prompts per device per step = that / num_generations.
- completions per step, all devices = per_device_train_batch_size x gradient_accumulation_steps x world size;
  unique prompts per step = that / num_generations.
- with `num_iterations` = n > 1, one such generation batch is reused for n optimiser steps (its old log-probs taken
  once, before the first of them), so checkpoints must fall on multiples of n.

Per step: tokens are scored at the sampling temperature, the clipped surrogate (+ beta * k3 KL to the reference) is
aggregated by `loss_type` with the global normaliser the loop computes from `count`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from posttrain.algorithms.base import Models
from posttrain.models.load import disable_adapter
from posttrain.algorithms.online import OnlineAlgorithm, check_online
from posttrain.config.schema import Recipe
from posttrain.errors import UserError
from posttrain.losses.policy import IMPORTANCE_LEVELS, LOSS_AGGREGATIONS, add_kl_penalty
from posttrain.ops.advantages import REWARD_SCALES, group_advantages
from posttrain.ops.logprobs import masked_mean
from posttrain.batch import Batch

DYNAMIC_SAMPLING_METRICS = ("accuracy", "reward")


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (posttrain/online/dynamic_sampling.py)."""

    enabled: bool = False
    """Drop prompt groups whose metric does not vary and draw more prompts until the step's batch is full."""
    metric: str = "accuracy"
    """accuracy: exact match against the data's `answer` column (the raw signal, DAPO's choice); reward: the total
    reward (shaped terms included)."""
    max_batches: int = 4
    """Most generation batches drawn per step; then the step trains on the groups it has. 0: no limit (a step that
    drew every prompt once without filling stops the run instead)."""

    def validate(self) -> None:
        if self.metric not in DYNAMIC_SAMPLING_METRICS:
            raise UserError(f"algo.dynamic_sampling.metric is {self.metric!r}; choose one of "
                            f"{', '.join(DYNAMIC_SAMPLING_METRICS)}")
        if self.max_batches < 0:
            raise UserError(f"algo.dynamic_sampling.max_batches must be >= 0 (0: no limit), got {self.max_batches}")


ROUTING_REPLAY = ("none", "old_policy")


@dataclass(frozen=True)
class GRPOAlgoConfig:
    num_generations: int = 8
    """G: completions sampled per prompt (the group the advantages are relative to); >= 2."""
    beta: float = 0.0
    """Weight of the k3 KL(policy || reference) penalty; 0 loads no reference model."""
    loss_type: str = "dapo"
    """Aggregation of per-token losses: dapo (token mean over the step), grpo (mean of sequence means), dr_grpo
    (token sum / (sequences x max_completion_length)) or bnpo (token mean per micro-batch)."""
    epsilon: float = 0.2
    """Lower clip range of the importance ratio: 1 - epsilon."""
    epsilon_high: Optional[float] = None
    """Upper clip range: 1 + epsilon_high (DAPO's clip-higher uses 0.28); null: the same as epsilon."""
    scale_rewards: str = "group"
    """Divide centred rewards by the group's std (group), the std of the whole step (batch) or nothing (none)."""
    num_iterations: int = 1
    """Optimiser steps per generation batch (PPO epochs, mu); > 1 takes old log-probs once per batch."""
    importance_sampling_level: str = "token"
    """Importance ratio per token (GRPO) or one length-normalised ratio per sequence (GSPO)."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length without EOS out of the loss (DAPO)."""
    log_samples: int = 2
    """Prompt groups written to output_dir/samples.jsonl at each logging step (0: none)."""
    vllm_is_correction: bool = False
    """Weight each token's surrogate by pi_old / pi_sampler, bounded as vllm_importance_sampling_mode says:
    importance sampling for an engine that samples with other numerics (vllm, server) or an older policy
    (generation.max_staleness)."""
    vllm_is_cap: float = 2.0
    """The upper bound of that weight (>= 1; TRL's vllm_importance_sampling_clip_max): truncated to it, or masked
    above it, as vllm_importance_sampling_mode says."""
    vllm_importance_sampling_mode: str = "token_truncate"
    """How algo.vllm_is_correction bounds pi_old / pi_sampler: token_truncate, token_mask, sequence_truncate,
    sequence_mask (TRL's modes), geometric_mask (verl) or icepop (losses/sampler_correction.py has the table)."""
    vllm_is_min: Optional[float] = None
    """Lower bound of that ratio (TRL's vllm_importance_sampling_clip_min); null: none (icepop: 1 / vllm_is_cap)."""
    routing_replay: str = "none"
    """Mixture-of-experts models: old_policy routes every training forward through the experts the old policy's
    forward chose for each token (R2 routing replay, models/moe.py; needs num_iterations >= 2), logging
    routing_agreement; none routes with the current router."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: drop groups whose accuracy (or reward) does not vary, draw more prompts to refill."""

    def validate(self, recipe: Recipe) -> None:
        """Everything checkable before the processes start; the loader calls it after building the recipe."""
        choices = {"loss_type": LOSS_AGGREGATIONS, "scale_rewards": REWARD_SCALES,
                   "importance_sampling_level": IMPORTANCE_LEVELS}
        for key, table in choices.items():
            if getattr(self, key) not in table:
                raise UserError(f"algo.{key} is {getattr(self, key)!r}; choose one of {', '.join(table)}")
        if self.num_generations < 2:
            raise UserError(f"algo.num_generations must be >= 2 (advantages compare completions of one prompt), "
                            f"got {self.num_generations}")
        if self.beta < 0 or self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise UserError(f"need algo.beta >= 0, algo.epsilon > 0 and algo.epsilon_high >= 0; got {self.beta}, "
                            f"{self.epsilon}, {self.epsilon_high}")
        if self.routing_replay not in ROUTING_REPLAY:
            raise UserError(f"algo.routing_replay is {self.routing_replay!r}; choose one of {', '.join(ROUTING_REPLAY)}")
        if self.routing_replay == "old_policy" and self.num_iterations < 2:
            raise UserError("algo.routing_replay=old_policy replays the routing of the old policy's forward, which "
                            "is the training forward's own when each generation batch is used for one step "
                            "(algo.num_iterations=1): set algo.num_iterations >= 2, or algo.routing_replay=none")
        self.dynamic_sampling.validate()
        if self.num_iterations < 1 or self.log_samples < 0:
            raise UserError(f"need algo.num_iterations >= 1 and algo.log_samples >= 0; got {self.num_iterations}, "
                            f"{self.log_samples}")
        if not recipe.rewards and recipe.agent.environment is None:  # an environment may score alone
            raise UserError("grpo needs at least one reward: add `rewards: [{name: exact_match}]` to the recipe "
                            "(built-ins: exact_match, format, length_penalty, overlong, judge, reward_model; or "
                            "'module:function')")
        if recipe.generation.temperature == 0:
            raise UserError("generation.temperature=0 samples greedily: every completion of a prompt is the same and "
                            "GRPO learns nothing; set generation.temperature > 0 (1.0 is usual)")
        check_online(self, recipe, "num_iterations")


class GRPO(OnlineAlgorithm):
    name = "grpo"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.config: GRPOAlgoConfig = recipe.algo
        self.aggregation = LOSS_AGGREGATIONS[self.config.loss_type]
        # with LoRA the reference is the policy with its adapters off: no second copy
        self.needs_reference = self.config.beta > 0 and not recipe.model.lora.enabled
        self.samples_per_prompt = self.config.num_generations
        self.steps_per_rollout = self.config.num_iterations
        self.routing_replay = self.config.routing_replay == "old_policy"
        self.dynamic_sampling = self.config.dynamic_sampling if self.config.dynamic_sampling.enabled else None
        # pi_old is taken once per generation batch when it is reused for several steps, and when an engine samples
        # apart from the trainer (its mismatch is measured against it: online/mismatch.py, as TRL does with vLLM);
        # otherwise the first step's own forward is pi_old
        self.takes_old_logprobs = self.config.num_iterations > 1 or recipe.generation.engine != "hf"

    # --- the rollout source calls it once per generation batch --------------------------------------------------

    def advantages(self, rollouts) -> tuple[list[Batch], dict[str, float]]:
        """Group-relative advantages over the whole step's rewards (every rank computes the same), this rank's rows;
        a completion no reward scored is left out of its group's statistics with advantage 0, as in TRL."""
        advantages_B = group_advantages(rollouts.step_rewards_B, self.config.num_generations,
                                        self.config.scale_rewards, rollouts.step_scored_B).float()
        return [dataclasses.replace(b, advantages_B=a) for b, a in
                zip(rollouts.batches, rollouts.per_batch(advantages_B))], {}

    # --- what the loop calls -------------------------------------------------------------------------------------

    def prepare(self, batch: Batch, models: Models, training: bool = True) -> Batch:
        """Old log-probs (num_iterations > 1, or an engine apart) and reference log-probs (beta > 0), unless the batch
        has them.

        The rollout source calls this once per generation batch, when the batch is taken for training (right after
        sampling, or, with generation.max_staleness, when a batch sampled ahead by an older policy comes up), so
        reused batches keep pi_old of their first step; the loop's own call then finds them present. The
        sampler's own log-probs ride in sampler_logprobs_BT: losses/sampler_correction.py explains the two.
        """
        updates = {}
        if self.takes_old_logprobs and batch.old_logprobs_BT is None:
            with models.policy.routing.recording() if self.routing_replay else contextlib.nullcontext() as routed:
                updates["old_logprobs_BT"] = models.policy.logprobs(batch, self.temperature)
            if self.routing_replay:  # the loop's training forwards of this batch route through these experts
                updates["routed_experts_BTLK"] = routed.experts_BTLK(batch)
        if self.config.beta > 0 and batch.ref_logprobs_BT is None:
            updates["ref_logprobs_BT"] = self._reference_logprobs(models, batch)
        return dataclasses.replace(batch, **updates) if updates else batch

    def setup(self, backend, models: Models, train_examples, collate, out) -> None:
        if self.routing_replay:
            models.policy.routing.require(models.policy.model, "algo.routing_replay")

    def _reference_logprobs(self, models: Models, batch: Batch) -> torch.Tensor:
        if models.reference is not None:
            return models.reference.logprobs(batch, self.temperature)
        with disable_adapter(models.policy.model) if self.recipe.model.lora.enabled else contextlib.nullcontext():
            return models.policy.logprobs(batch, self.temperature)

    def clip_range(self) -> tuple[float, float]:
        """(1 - epsilon, 1 + epsilon_high): DAPO's clip-higher when epsilon_high is set."""
        cfg = self.config
        return cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high

    def count(self, batch: Batch) -> torch.Tensor:
        return self.aggregation.count(batch.completion_mask_BT, self.recipe.generation.max_completion_length)

    def loss(self, model, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The shared clipped surrogate (OnlineAlgorithm.surrogate) + beta x k3 KL, aggregated by loss_type."""
        cfg, mask_BT = self.config, batch.completion_mask_BT
        loss_BT, logprobs_BT, _, metrics = self.surrogate(model, batch, batch.advantages_B, *self.clip_range(),
                                                          level=cfg.importance_sampling_level)
        if batch.sampler_logprobs_BT is not None:  # how far the engine's sampling policy is from the trainer's
            metrics["sampler_logprob_gap"] = masked_mean((logprobs_BT.detach() - batch.sampler_logprobs_BT).abs(),
                                                         mask_BT)
        if cfg.beta > 0:
            loss_BT, kl_BT = add_kl_penalty(loss_BT, logprobs_BT, batch.ref_logprobs_BT, cfg.beta)
            metrics["kl"] = masked_mean(kl_BT.detach(), mask_BT)
        return self.aggregation.aggregate(loss_BT, mask_BT, normaliser), metrics
