"""PPO with a critic (Schulman et al. 2017; for language models Ziegler et al. 2019, Ouyang et al. 2022): actor,
critic, reference and rewards (reward model and/or reward functions).

    posttrain ppo --config recipes/ppo.yaml            # verifiable reward on the arithmetic task
    posttrain ppo --config recipes/ppo_rm.yaml         # a reward model trained by `posttrain rm`

Per generation batch (train/rollout_source.py): sample, score each completion at its end, then (prepare) the
policy's log-probs, the reference's and the critic's values, once; then (advantages) per-token rewards
-kl_coef * KL(k1 or k3) plus the score at the last completion token (minus missing_eos_penalty when the completion
was cut off), and advantages by `algo.advantage_estimator` (docs/ppo.md: the estimators, and which are whitened).
The batch is then used for `ppo_epochs` optimiser steps of both trained roles, each with its own optimiser: the
clipped surrogate for the policy and the clipped value loss for the critic (token means over the step); the policy
waits `critic_warmup_steps` steps while the critic learns first. The math lives in ops/ and losses/.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from posttrain.algorithms.base import Models, Objective
from posttrain.models.critic import check_critic_source, critic_values
from posttrain.models.load import check_model_source
from posttrain.algorithms.online import OnlineAlgorithm, check_online
from posttrain.batch import Batch
from posttrain.config.schema import ModelConfig, Recipe
from posttrain.errors import UserError
from posttrain.losses.value import clipped_value_loss
from posttrain.ops.advantages import ADVANTAGE_ESTIMATORS, masked_moments, token_rewards, whiten
from posttrain.ops.kl import KL_ESTIMATORS, KLController, kl_k3
from posttrain.ops.logprobs import masked_mean, masked_sum


@dataclass(frozen=True)
class PPOAlgoConfig:
    critic_model_name_or_path: Optional[str] = None
    """The critic's starting weights: a `posttrain rm` reward model or any model with the policy's tokenizer; null:
    the reward model of `rewards` if there is one, else the policy."""
    critic_learning_rate: Optional[float] = None
    """The critic's own peak learning rate (null: train.learning_rate)."""
    critic_warmup_steps: int = 0
    """Optimiser steps at the start where only the critic trains."""
    advantage_estimator: str = "gae"
    """gae (GAE on the critic's values), reinforce++ (discounted returns, baselined by whitening), rloo (the score minus
    the mean of the prompt's other samples) or grpo (the score standardised in its group); rloo and grpo discount it."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: Optional[bool] = None
    """Whiten advantages over the whole step (all ranks); null: the estimator's default (gae, reinforce++: on; rloo,
    grpo: off)."""
    kl_coef: float = 0.05
    """Initial weight of the per-token KL(policy || reference) penalty in the reward; 0 loads no reference."""
    kl_estimator: str = "k1"
    """KL per token: k1 (log-ratio) or k3."""
    kl_target: Optional[float] = None
    """Adaptive KL controller's target KL per sequence (null: a fixed kl_coef)."""
    kl_horizon: int = 10000
    """Adaptive KL controller's horizon (samples)."""
    num_generations: int = 1
    """Completions per prompt (>= 2 for rloo and grpo)."""
    ppo_epochs: int = 1
    """Optimiser steps each generation batch is used for."""
    epsilon: float = 0.2
    """Policy ratio clip range."""
    value_clip: Optional[float] = 0.2
    """Clip range of the value change around the rollout's values (null: unclipped)."""
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the score of a completion that hit max_completion_length without EOS."""
    mask_truncated_completions: bool = False
    """Leave truncated completions out of both losses."""
    ref_offload: bool = False
    """Keep the reference's weights in CPU memory between forwards (ZeRO-3: DeepSpeed parameter offload)."""
    reward_model_offload: bool = False
    """The same for the reward model of `rewards` (a `reward_model` entry)."""
    log_samples: int = 2
    """Prompt groups written to output_dir/samples.jsonl at each logging step (0: none)."""
    vllm_is_correction: bool = False
    """Importance sampling: weight each token's surrogate by pi_old / pi_sampler, bounded as
    vllm_importance_sampling_mode says."""
    vllm_is_cap: float = 2.0
    """The upper bound of that weight (>= 1; TRL's vllm_importance_sampling_clip_max): truncated to it, or masked
    above it, as vllm_importance_sampling_mode says."""
    vllm_importance_sampling_mode: str = "token_truncate"
    """How algo.vllm_is_correction bounds pi_old / pi_sampler: token_truncate, token_mask, sequence_truncate,
    sequence_mask (TRL's modes), geometric_mask (verl) or icepop (losses/sampler_correction.py has the table)."""
    vllm_is_min: Optional[float] = None
    """Lower bound of that ratio (TRL's vllm_importance_sampling_clip_min); null: none (icepop: 1 / vllm_is_cap)."""

    def validate(self, recipe: Recipe) -> None:
        for key, value, table in (("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS),
                                  ("kl_estimator", self.kl_estimator, ("k1", "k3"))):
            if value not in table:
                close = difflib.get_close_matches(value, list(table), n=1, cutoff=0.5)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise UserError(f"algo.{key} is {value!r}; {hint}choose one of {', '.join(table)}")
        if ADVANTAGE_ESTIMATORS[self.advantage_estimator].needs_groups and self.num_generations < 2:
            raise UserError(f"algo.advantage_estimator={self.advantage_estimator} compares samples of one prompt: set "
                            f"algo.num_generations >= 2 (got {self.num_generations})")
        if self.kl_coef < 0 or self.epsilon <= 0 or self.ppo_epochs < 1 or self.num_generations < 1:
            raise UserError("need algo.kl_coef >= 0, algo.epsilon > 0, algo.ppo_epochs >= 1, algo.num_generations >= 1")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise UserError(f"algo.gamma and algo.lam must lie in [0, 1]; got {self.gamma}, {self.lam}")
        if not recipe.rewards:
            raise UserError("ppo needs a reward: add `rewards: [{name: exact_match}]` or "
                            "`rewards: [{name: reward_model, kwargs: {path: runs/rm/final}}]` to the recipe")
        check_online(self, recipe, "ppo_epochs")


class PPO(OnlineAlgorithm):
    name = "ppo"
    needs_critic = True

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.config: PPOAlgoConfig = recipe.algo
        self.needs_reference = self.config.kl_coef > 0
        self.samples_per_prompt = self.config.num_generations
        self.steps_per_rollout = self.config.ppo_epochs
        self.kl = KLController(self.config.kl_coef, self.config.kl_target, self.config.kl_horizon)
        self.seconds = {"time/policy_logprobs": 0.0, "time/reference": 0.0, "time/values": 0.0}

    def preflight(self) -> None:
        """The rewards load (a reward model that is not a sequence classifier fails here); the policy and the critic
        exist and share a vocabulary."""
        super().preflight()
        check_model_source(self.recipe.model)
        what = "algo.critic_model_name_or_path"
        check_critic_source(self.critic_source(), what, _vocab_size(self.recipe.model.name_or_path))

    def critic_source(self) -> ModelConfig:
        path = self.config.critic_model_name_or_path
        if path is None:  # the reward model, when it reads the policy's token ids (else its text is re-encoded)
            path = next((r.kwargs.get("path") for r in self.recipe.rewards if r.name == "reward_model"), None)
            if path is not None and _vocab_size(path) != _vocab_size(self.recipe.model.name_or_path):
                path = None
        m = self.recipe.model
        return dataclasses.replace(m, name_or_path=path or m.name_or_path, tokenizer_name_or_path=None, revision=None,
                                   lora=dataclasses.replace(m.lora, enabled=False))

    def placement(self, role: str) -> str:
        offload = {"reference": self.config.ref_offload, "reward_model": self.config.reward_model_offload}
        return "offload" if offload.get(role) else "local"

    def critic_learning_rate(self) -> Optional[float]:
        return self.config.critic_learning_rate

    def state_dict(self) -> dict:
        return {"kl_coef": self.kl.value}

    def load_state_dict(self, state: dict) -> None:
        self.kl.value = state.get("kl_coef", self.kl.value)

    # --- once per generation batch (the rollout source calls these) -------------------------------------------------

    def prepare(self, batch: Batch, models: Models, training: bool = True) -> Batch:
        tasks = {"old_logprobs_BT": ("time/policy_logprobs", lambda: models.policy.logprobs(batch, self.temperature)),
                 "ref_logprobs_BT": ("time/reference", lambda: models.reference.logprobs(batch, self.temperature)),
                 "old_values_BT": ("time/values", lambda: critic_values(models.critic.forward, batch))}
        if not self.needs_reference:
            del tasks["ref_logprobs_BT"]
        updates = {}
        for field, (clock, compute) in tasks.items():
            if getattr(batch, field) is None:
                started = time.perf_counter()
                updates[field] = compute()
                self.seconds[clock] += time.perf_counter() - started  # this rank's seconds, for bench/ppo.py
        return dataclasses.replace(batch, **updates) if updates else batch

    def advantages(self, rollouts) -> tuple[list[Batch], dict[str, float]]:
        cfg = self.config
        estimator = ADVANTAGE_ESTIMATORS[cfg.advantage_estimator]
        score_B = rollouts.step_rewards_B.float()  # 0 where no reward scored: no group to leave it out of (GAE)
        if cfg.missing_eos_penalty is not None:
            score_B = score_B - cfg.missing_eos_penalty * rollouts.step_truncated_B.float()
        score_B = estimator.baseline(score_B, cfg.num_generations)
        out, kl_sums = [], []
        for batch, batch_score_B in zip(rollouts.batches, rollouts.per_batch(score_B)):
            mask_BT = batch.completion_mask_BT
            kl_BT = (KL_ESTIMATORS[cfg.kl_estimator](batch.old_logprobs_BT, batch.ref_logprobs_BT)
                     if self.needs_reference else torch.zeros_like(batch.old_logprobs_BT))
            kl_sums.append(masked_sum(kl_BT, mask_BT).reshape(1))
            rewards_BT = token_rewards(batch_score_B, kl_BT, mask_BT, self.kl.value)
            advantages_BT, returns_BT = estimator.token_advantages(rewards_BT, batch.old_values_BT, mask_BT, cfg.gamma,
                                                                   cfg.lam)
            out.append(dataclasses.replace(batch, advantages_BT=advantages_BT, returns_BT=returns_BT))
        sequences = float(len(rollouts.step_rewards_B))
        kl_per_sequence = float(rollouts.all_reduce_sum(torch.cat(kl_sums).sum())) / sequences
        metrics = {"kl": kl_per_sequence, "kl_coef": self.kl.value, **self.seconds}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.kl.update(kl_per_sequence, int(sequences))
        if estimator.whiten if cfg.whiten_advantages is None else cfg.whiten_advantages:
            moments = rollouts.all_reduce_sum(sum(masked_moments(b.advantages_BT, b.completion_mask_BT) for b in out))
            out = [dataclasses.replace(b, advantages_BT=whiten(b.advantages_BT, b.completion_mask_BT, moments))
                   for b in out]
        return out, metrics

    # --- what the loop calls ------------------------------------------------------------------------------------------

    def objectives(self, step: int, models: Optional[Models]) -> dict[str, Objective]:
        critic = {"critic": Objective(self.count, self.value_loss)}
        return critic if step < self.config.critic_warmup_steps else {"policy": Objective(self.count, self.loss), **critic}

    def count(self, batch: Batch) -> torch.Tensor:
        return batch.completion_mask_BT.sum()

    def loss(self, model, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The shared clipped surrogate (OnlineAlgorithm.surrogate) on per-token advantages, token mean over the
        step."""
        mask_BT = batch.completion_mask_BT
        loss_BT, logprobs_BT, old_BT, metrics = self.surrogate(model, batch, batch.advantages_BT, *self.clip_range())
        with torch.no_grad():
            metrics["approx_kl"] = masked_mean(kl_k3(logprobs_BT, old_BT), mask_BT)
        return masked_sum(loss_BT, mask_BT) / normaliser, metrics

    def value_loss(self, model, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped value loss against the rollout's returns, token mean over the step."""
        mask_BT = batch.completion_mask_BT
        values_BT = critic_values(model, batch)
        loss_BT, clip_fraction = clipped_value_loss(values_BT, batch.old_values_BT, batch.returns_BT, mask_BT,
                                                    self.config.value_clip)
        metrics = {"value_clip_fraction": clip_fraction, "values/mean": masked_mean(values_BT.detach(), mask_BT),
                   "returns/mean": masked_mean(batch.returns_BT, mask_BT)}
        return masked_sum(loss_BT, mask_BT) / normaliser, metrics


def _vocab_size(name_or_path: str) -> int:
    from transformers import AutoConfig

    path = Path(name_or_path).expanduser()
    config = AutoConfig.from_pretrained(str(path) if path.exists() else name_or_path)
    return config.get_text_config().vocab_size  # a vision-language model's is its language model's
