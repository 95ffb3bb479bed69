"""What the loop and run.py need from an algorithm, and the model roles it works with.

An algorithm is a small plug-in, not a trainer subclass. The loop owns batching, accumulation, normalisation,
optimiser steps, logging and checkpoints; an algorithm owns its math. The whole contract is `Algorithm` below; an
algorithm subclasses it and overrides what it needs (docs/algorithms.md shows how to write one).

    count(batch)                 -> scalar tensor: loss units in this micro-batch (tokens, sequences or pairs)
    loss(model, batch, normaliser) -> (loss, metrics): sum over units / normaliser, where normaliser is the GLOBAL
                                    count over all micro-batches of the step and all ranks (computed by the loop)

Roles: `Models` holds the typed roles an algorithm may use (policy, reference, critic, reward_model, teacher). Each
`Role` says whether it trains (then it has its own optimizer and scheduler, prepared by the backend) and where it is
placed. The loop trains every role the algorithm names in `objectives()`, each with its own normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

from posttrain.batch import Batch
from posttrain.models.moe import NO_ROUTING, Routing

ROLE_NAMES = ("policy", "critic", "reference", "reward_model", "teacher")
"""Every role an algorithm may ask for; trained roles are stepped in this order."""


class Role:
    """One model of the run, as the loop, the checkpointer and the algorithms use it: a local role
    (posttrain/roles.py: the backend-prepared module in this process) or a Ray role (posttrain/launch/ray_roles.py:
    an actor group apart from the policy). Every capability has a default here, so callers ask, never probe."""

    trains: bool = False
    """It has its own optimiser and schedule, stepped by the loop."""
    placement: str = "local"
    """Where it lives: local (this process, sharded as the launcher says), offload (CPU between uses) or ray."""
    model: Any = None
    """The module in this process (what the backend returned); None for a role served elsewhere."""
    routing: Routing = NO_ROUTING
    """Its mixture-of-experts routers (aux loss, replay: models/moe.py); inert for a dense model."""

    # --- what algorithms ask (no gradient) ----------------------------------------------------------------------
    def logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """logprobs_BT of the batch's tokens under this model (models.forward.policy_logprobs alignment)."""
        raise NotImplementedError

    def logits_at(self, batch: Batch, rows_n: torch.Tensor) -> torch.Tensor:
        """logits_nV of the flat rows `rows_n` of the batch only (models.forward.policy_logits_at): a distillation
        teacher's rows that predict a completion token, without its (B, T, V) logits where the head allows."""
        raise NotImplementedError

    def forward(self, **inputs) -> Any:
        """The model's output for keyword inputs (input_ids, attention_mask, ...): an object with `.logits` (a
        critic's values, a reward model's scores)."""
        raise NotImplementedError

    def train(self, mode: bool = True) -> None:
        """Training or evaluation mode (dropout), where the model lives."""

    def seconds(self) -> Optional[float]:
        """Seconds its calls took since last asked (a role served apart: transfer included); None: not measured."""
        return None

    def release(self) -> None:
        """Give back its memory (a reference an algorithm no longer needs)."""

    # --- what the loop, the checkpointer and run.py ask of a trained role ---------------------------------------
    def update(self, step: int, objective: "Objective", micro_batches: list[Batch], normaliser: torch.Tensor,
               skip_nonfinite: bool) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
        """Loop phase 4: forward + backward per micro-batch, clip, optimiser step, LR schedule. Returns this rank's
        loss summed over micro-batches, the global grad norm and the objective's metrics summed over micro-batches."""
        raise NotImplementedError(f"a {type(self).__name__} does not train")

    def start_schedule(self, total_steps: int) -> None:
        """Build its LR schedule over the run's steps."""

    def learning_rate(self) -> float:
        raise NotImplementedError(f"a {type(self).__name__} has no learning rate")

    def nonfinite(self) -> float:
        """Parameter tensors holding NaN/inf (this rank's share; summed over ranks by the caller)."""
        return 0.0

    def schedule_state(self) -> Optional[dict[str, Any]]:
        """The LR schedule's state for trainer_state.json; None when the role saves it with its own state."""
        return None

    def save(self, path: str) -> None:
        """Save what the backend's own checkpoint does not hold (a role trained apart saves its group's state)."""

    def restore(self, path: str, schedule: Optional[dict[str, Any]]) -> None:
        """Restore what `save` and `schedule_state` kept."""

    def export(self, output_dir: str, name: str, tokenizer) -> None:
        """Write output_dir/<name> (final-critic) as a Hugging Face directory."""
        raise NotImplementedError(f"a {type(self).__name__} cannot be exported")


@dataclass
class Models:
    """The roles of a run. `policy` always exists; the others are None unless the algorithm asked for them."""

    policy: Role
    tokenizer: Any = None
    reference: Optional[Role] = None
    critic: Optional[Role] = None
    reward_model: Optional[Role] = None
    teacher: Optional[Role] = None
    """Distillation: the frozen model the policy learns to match (algorithms/distill.py)."""
    eval_examples: Optional[list] = None
    """The tokenised eval set, for algorithms that precompute something for it (DPO's reference table)."""

    def trained(self) -> list[tuple[str, Role]]:
        """(name, role) of every role that trains, in ROLE_NAMES order."""
        roles = [(name, getattr(self, name)) for name in ROLE_NAMES]
        return [(name, role) for name, role in roles if role is not None and role.trains]


@dataclass(frozen=True)
class ModelsNeeded:
    """What a run of an algorithm holds while it trains, as `posttrain plan` and the logged estimate count it
    (plan/workload.py asks `Algorithm.models_needed`, never re-derives it)."""

    task: str = "causal_lm"
    """The policy's head: causal_lm or seq_cls."""
    rows_per_unit: int = 1
    """Rows through the policy per loss unit (2 for a preference pair)."""
    reference: bool = False
    """A frozen copy of the policy, resident while training."""
    critic: bool = False
    """A value model trained beside the policy (about the policy's size)."""
    reward_models: int = 0
    """Reward models loaded as frozen roles."""
    teacher: bool = False
    """A frozen teacher (counted at the policy's size)."""
    generation: bool = False
    """It samples completions with the run's engine."""
    samples_per_prompt: int = 1
    """Completions per prompt when it samples."""
    logprobs_only: bool = False
    """Its loss needs log-probs only (a fusable head then never makes the logits)."""

    @property
    def frozen(self) -> int:
        """Frozen full models kept besides the trained ones."""
        return int(self.reference) + self.reward_models + int(self.teacher)

    @property
    def trained(self) -> int:
        """Models with gradients and optimiser state: the policy, and a critic."""
        return 1 + int(self.critic)

    @property
    def loaded(self) -> int:
        return self.trained + self.frozen


class Objective(NamedTuple):
    """How one trained role learns: its loss units and its loss (see the module docstring)."""

    count: Callable[[Batch], torch.Tensor]
    loss: Callable[[Any, Batch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Algorithm:
    """The base every algorithm subclasses. Class attributes describe it; methods are the hooks run.py and the loop
    call, in this order: __init__(recipe) (no I/O: the planner builds algorithms too), preflight (input checks that
    read files or import user code, before any model loads), setup, then per step prepare -> count/loss of each
    objective."""

    name: str = ""
    """The CLI command (sft, rm, dpo, grpo, ppo)."""
    source_kind: str = "dataset"
    """Where its micro-batches come from (run.SOURCES): dataset (the data as it is), rollout (it trains on its own
    samples, scored: train/rollout_source.py, and is evaluated by generating) or distill (the dataset's rows, the
    student completing a seeded share of them: train/distill_source.py)."""
    data_kind: str = "sft"
    """What rows it trains on: 'sft' (text/messages/prompt-completion), 'preference' or 'prompt'."""
    model_kind: str = "causal_lm"
    """The policy's head: 'causal_lm' or 'seq_cls'."""
    needs_reference: bool = False
    """run.py loads a frozen copy of the policy as `models.reference`."""
    needs_critic: bool = False
    """run.py loads a value model as `models.critic` (trained, with its own optimiser)."""
    samples_per_prompt: int = 1
    """Online algorithms: completions sampled per prompt (GRPO's group); a prompt's samples stay on one rank."""
    steps_per_rollout: int = 1
    """Online algorithms: optimiser steps each generation batch is used for (GRPO num_iterations, PPO ppo_epochs)."""
    logprobs_only: bool = False
    """Its loss needs the policy's log-probs only, not the logits (SFT, DPO): what the planner assumes of memory."""
    routing_replay: bool = False
    """Mixture-of-experts: prepare records the old policy's routing, which the training forward replays
    (models/moe.py)."""
    headline_metrics: tuple[str, ...] = ()
    """The metrics the console shows after loss, grad_norm and learning_rate (TRL's console shows its trainer's):
    what says whether this algorithm is learning."""
    dynamic_sampling = None
    """Online algorithms: a grpo.DynamicSamplingConfig when the rollout source drops prompt groups whose metric does
    not vary and draws more (DAPO); None: every drawn group is trained on."""

    def placement(self, role: str) -> str:
        """Where run.py puts a frozen role (reference, reward_model): 'local' (on the device, partitioned under
        ZeRO-3) or 'offload' (its weights in CPU memory between forwards)."""
        return "local"

    def teacher_model(self):
        """A config.schema.ModelConfig for run.py to load as the frozen `models.teacher` (like the reference); None:
        no teacher."""
        return None

    def reward_models(self) -> list:
        """The reward models the algorithm scores with (rewards.RewardModelScorer), for run.py to place as the
        reward_model role once the backend exists."""
        return []

    def reward_model_count(self) -> int:
        """How many reward models `reward_models` will load, read from the recipe alone (no I/O)."""
        return 0

    def models_needed(self) -> ModelsNeeded:
        """What a run holds while it trains (the planner's question), from what the algorithm declares."""
        return ModelsNeeded(task=self.model_kind, rows_per_unit=2 if self.data_kind == "preference" else 1,
                            reference=self.needs_reference, critic=self.needs_critic,
                            reward_models=self.reward_model_count(), teacher=self.teacher_model() is not None,
                            generation=self.source_kind in ("rollout", "distill"),
                            samples_per_prompt=self.samples_per_prompt, logprobs_only=self.logprobs_only)

    def preflight(self) -> None:
        """Input checks that read files, reach servers or import user code (rewards, a teacher's tokenizer, a critic's
        config); run once by run.py and the Ray launcher before any model loads. A bad input is a UserError."""

    def check_data(self, train_examples: list[dict], eval_examples: Optional[list[dict]]) -> None:
        """Once the data is read, before any model loads: what the algorithm reads from the data's columns is there
        (online: the columns the rewards read by name). A UserError names the column and the data."""

    def setup(self, backend, models: Models, train_examples, collate, out) -> None:
        """After models are prepared and a checkpoint restored (e.g. to precompute reference log-probs)."""

    def advantages(self, rollouts) -> tuple[list[Batch], dict[str, float]]:
        """Online algorithms: the step's scored, prepared rollouts (train/rollout_source.Rollouts) -> this rank's
        micro-batches with advantages attached, and figures to log."""
        raise NotImplementedError(f"{self.name} does not generate rollouts")

    def prepare(self, batch: Batch, models: Models, training: bool = True) -> Batch:
        """Add what needs no gradient (reference log-probs, advantages). Runs under torch.no_grad() and the backend's
        autocast; `training` False for a batch of the eval set (the loop's held-out loss)."""
        return batch

    def count(self, batch: Batch) -> torch.Tensor:
        """The policy's loss units in this micro-batch; summed by the loop over micro-batches and ranks."""
        raise NotImplementedError

    def loss(self, model: Any, batch: Batch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's forward + objective. Returns (loss to backpropagate, detached per-micro-batch metrics)."""
        raise NotImplementedError

    def objectives(self, step: int, models: Optional[Models]) -> dict[str, Objective]:
        """Role name -> how it learns at optimiser step `step` (0-based); a trained role left out of the dict is not
        stepped (PPO's critic warm-up). Most algorithms train the policy only. `models`: the run's roles, for a loss
        that needs a frozen one (distillation's teacher); None inside a Ray actor group training a role apart (its
        objective needs no other role)."""
        return {"policy": Objective(self.count, self.loss)}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold for the algorithm (a KL controller's coefficient); JSON-serialisable."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
