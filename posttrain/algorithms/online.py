"""What every online algorithm (GRPO family, PPO) shares: the recipe checks of training on its own samples, its
rewards and reward models, and the core of its policy loss (the clipped surrogate, with the engine's importance
correction). run.py gives it the generic rollout source (train/rollout_source.py) and held-out evaluation by
generating (train/evaluation.py)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from posttrain.algorithms.base import Algorithm
from posttrain.config.schema import Recipe
from posttrain.errors import UserError
from posttrain.losses.policy import clipped_surrogate
from posttrain.losses.sampler_correction import SAMPLER_CORRECTIONS, sampler_importance_weights
from posttrain.models.forward import policy_logprobs_entropy
from posttrain.ops.logprobs import masked_mean
from posttrain.rewards import load_rewards
from posttrain.rewards.reward_model import load_scorer
from posttrain.batch import Batch


def check_is_correction(config, recipe: Recipe) -> None:
    """algo.vllm_is_correction needs an engine that reports its own log-probs apart from the trainer's; the mode
    and its bounds must make a weight."""
    mode, low = config.vllm_importance_sampling_mode, config.vllm_is_min
    if mode not in SAMPLER_CORRECTIONS:
        raise UserError(f"algo.vllm_importance_sampling_mode is {mode!r}; choose one of "
                        f"{', '.join(SAMPLER_CORRECTIONS)}")
    if config.vllm_is_cap < 1:
        raise UserError(f"algo.vllm_is_cap must be >= 1 (it caps pi_old / pi_sampler), got {config.vllm_is_cap}")
    if low is not None and not 0 <= low < config.vllm_is_cap:
        raise UserError(f"algo.vllm_is_min must be >= 0 and below algo.vllm_is_cap ({config.vllm_is_cap}), got {low}")
    if config.vllm_is_correction and recipe.generation.engine == "hf":
        raise UserError("algo.vllm_is_correction corrects for an engine that samples apart from the trainer; "
                        "generation.engine=hf samples with the policy itself. Use generation.engine=vllm or server, "
                        "or set algo.vllm_is_correction=false")


def check_online(config, recipe: Recipe, iterations_key: str) -> None:
    """The checks of every online algorithm's config (its `validate` calls them): the importance correction, whole
    groups of samples per device, generation.batch_size, and checkpoints on whole generation batches
    (`algo.<iterations_key>` optimiser steps each)."""
    check_is_correction(config, recipe)
    t, g = recipe.train, config.num_generations
    per_device = t.per_device_train_batch_size * t.gradient_accumulation_steps
    if per_device % g:
        raise UserError(f"train.per_device_train_batch_size ({t.per_device_train_batch_size}) x "
                        f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps}) = {per_device} "
                        f"completions per device per step, which is not a multiple of algo.num_generations ({g}): "
                        f"each prompt's {g} completions must be sampled on one device. Make the product a multiple "
                        f"of {g} (e.g. per_device_train_batch_size={g} or gradient_accumulation_steps={g}), or "
                        f"pick a num_generations that divides {per_device}")
    if recipe.generation.batch_size is not None and recipe.generation.batch_size < 1:
        raise UserError(f"generation.batch_size must be >= 1 or null, got {recipe.generation.batch_size}")
    n = getattr(config, iterations_key)
    for key, value in (("train.save_steps", t.save_steps), ("train.max_steps_per_run", t.max_steps_per_run)):
        if n > 1 and value and value % n:
            raise UserError(f"{key}={value} is not a multiple of algo.{iterations_key}={n}: a checkpoint in the "
                            f"middle of a generation batch could not resume exactly; use a multiple of {n}")


class Surrogate(NamedTuple):
    """The policy-loss core of a micro-batch (OnlineAlgorithm.surrogate)."""

    loss_BT: torch.Tensor
    """Clipped surrogate per token, times the importance weight with algo.vllm_is_correction."""
    logprobs_BT: torch.Tensor
    """The policy's log-probs of the batch's tokens (with their gradient)."""
    old_BT: torch.Tensor
    """pi_old: the batch's old log-probs, or the current ones detached (one step per generation batch)."""
    metrics: dict[str, torch.Tensor]
    """clip_fraction, entropy, and the importance weights' figures."""


class OnlineAlgorithm(Algorithm):
    source_kind = "rollout"
    data_kind = "prompt"
    headline_metrics = ("reward/mean",)
    logprobs_only = True  # the surrogate's log-probs and entropy come from the fused head (policy_logprobs_entropy)

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.temperature = recipe.generation.temperature
        self._rewards = None

    def preflight(self) -> None:
        """The rewards import and load here (a bad reward fails before any model is loaded)."""
        self._rewards = load_rewards(self.recipe.rewards)

    def check_data(self, train_examples: list[dict], eval_examples: Optional[list[dict]]) -> None:
        """The columns the rewards read by name are in data.train and data.eval (a multi-turn run adds
        `trajectory`)."""
        added = ["trajectory"] if self.recipe.agent.enabled else []
        for where, examples in (("data.train", train_examples), ("data.eval", eval_examples)):
            if examples:
                self.rewards.check_columns([*examples[0]["columns"], *added], where)

    @property
    def rewards(self):
        """The recipe's RewardSet (loaded by preflight, or on first use)."""
        if self._rewards is None:
            self.preflight()
        return self._rewards

    def reward_models(self) -> list:
        """The scorers of the recipe's `reward_model` entries (one per directory and settings; see load_scorer); one
        given its own `device` kwarg stays where it is."""
        scorers = [load_scorer(**r.kwargs) for r in self.recipe.rewards if r.name == "reward_model"]
        return [s for s in dict.fromkeys(scorers) if not s.device_given]

    def reward_model_count(self) -> int:
        """Distinct `reward_model` entries that load a model beside the policy (as reward_models dedupes them; one
        given its own `device` stays out)."""
        entries = {tuple(sorted((k, str(v)) for k, v in r.kwargs.items())) for r in self.recipe.rewards
                   if r.name == "reward_model" and r.kwargs.get("device") is None}
        return len(entries)

    def clip_range(self) -> tuple[float, float]:
        """(epsilon_low, epsilon_high) of the clipped surrogate: the phantom clipping of online/mismatch.py uses it."""
        return self.config.epsilon, self.config.epsilon

    def surrogate(self, model, batch: Batch, advantages, epsilon_low: float, epsilon_high: float,
                  level: str = "token") -> Surrogate:
        """The forward and clipped surrogate GRPO and PPO share (Schulman et al. 2017), at the sampling temperature;
        with algo.vllm_is_correction each token is weighted by pi_old / pi_sampler bounded as
        algo.vllm_importance_sampling_mode says (losses/sampler_correction.py)."""
        cfg, mask_BT = self.config, batch.completion_mask_BT
        # a fusable output layer gives both without making the (B, T, V) logits (models/forward.py)
        logprobs_BT, entropy_BT = policy_logprobs_entropy(model, batch, self.temperature)
        # one step per generation batch: the sampling policy is the current one, so the ratio is 1 with the right
        # gradient
        old_BT = batch.old_logprobs_BT if batch.old_logprobs_BT is not None else logprobs_BT.detach()
        # outside the completions logprobs_BT is 0 (never scored): no ratio exp(0 - old) that could overflow there
        old_BT = torch.where(mask_BT.bool(), old_BT, logprobs_BT.detach())
        loss_BT, clip_fraction = clipped_surrogate(logprobs_BT, old_BT, advantages, mask_BT, epsilon_low,
                                                   epsilon_high, level=level)
        metrics = {"clip_fraction": clip_fraction}
        if cfg.vllm_is_correction:
            weights_BT, is_metrics = sampler_importance_weights(old_BT, batch.sampler_logprobs_BT, mask_BT,
                                                                cfg.vllm_importance_sampling_mode, cfg.vllm_is_cap,
                                                                cfg.vllm_is_min)
            loss_BT = loss_BT * weights_BT
            metrics.update(is_metrics)
        metrics["entropy"] = masked_mean(entropy_BT, mask_BT)
        return Surrogate(loss_BT, logprobs_BT, old_BT, metrics)
