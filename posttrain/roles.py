"""The run's roles built with one call, and the local role: a model in this process.

    models = build_roles(recipe, algorithm, backend, tokenizer, eval_examples, remote_roles)

`LocalRole` is the backend-prepared module (a plain module, DDP, a DeepSpeed engine or an FSDP2 module), with its
optimiser and LR schedule when it trains; the loop, the checkpointer and the algorithms call its methods
(algorithms.base.Role). Roles served by Ray actor groups apart from the policy come in as `remote_roles` from the
launch wing (posttrain/launch/ray_roles.py) and answer the same methods; nothing here knows what they are.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Optional

import torch

from posttrain.algorithms.base import Models, Objective, Role
from posttrain.batch import Batch
from posttrain.rundir.checkpoint import export_final
from posttrain.distributed.precision import trained_model_config
from posttrain.models.critic import load_critic
from posttrain.models.forward import policy_logits_at, policy_logprobs
from posttrain.models.moe import NO_ROUTING, Routing, moe_routing, sparse_block_classes
from posttrain.models.reference import make_reference
from posttrain.train.loop import update_role
from posttrain.train.optim import make_optimizer, make_scheduler


@dataclass(eq=False)
class LocalRole(Role):
    model: Any = None
    backend: Any = None
    trains: bool = False
    optimizer: Any = None
    """Its own optimiser, when it trains."""
    scheduler: Any = None
    """Its own LR schedule, when it trains."""
    placement: str = "local"
    train_config: Any = None
    """recipe.train, for the schedule."""
    routing: Routing = NO_ROUTING

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        return policy_logprobs(self.model, batch, temperature)

    def logits_at(self, batch: Batch, rows_n: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return policy_logits_at(self.model, batch, rows_n)

    def forward(self, **inputs) -> Any:
        return self.model(**inputs)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def release(self) -> None:
        destroy = getattr(self.model, "destroy", None)  # a DeepSpeed engine frees its partitions first
        if callable(destroy):
            with contextlib.suppress(Exception):
                destroy()
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def update(self, step: int, objective: Objective, micro_batches: list[Batch], normaliser: torch.Tensor,
               skip_nonfinite: bool):
        return update_role(self.backend, self, objective, micro_batches, normaliser, skip_nonfinite)

    def start_schedule(self, total_steps: int) -> None:
        self.scheduler = make_scheduler(self.optimizer, self.train_config, total_steps)

    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def nonfinite(self) -> float:
        return float(self.backend.nonfinite_parameters(self.model))

    def schedule_state(self) -> Optional[dict[str, Any]]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def restore(self, path: str, schedule: Optional[dict[str, Any]]) -> None:
        """The backend restored the weights and optimiser; this restores the schedule and the optimiser's LR."""
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **schedule})
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def export(self, output_dir: str, name: str, tokenizer) -> None:
        export_final(self.backend, self.model, tokenizer, output_dir, name=name)


def trained_role(backend, model, train_config, learning_rate: Optional[float] = None,
                 routing: Optional[Routing] = None) -> LocalRole:
    """A model that trains: prepared with its own optimiser by the backend (routing: hooks already on its routers)."""
    model, optimizer = backend.prepare(model, make_optimizer(model, train_config, learning_rate),
                                       leaf_modules=sparse_block_classes(model))
    return LocalRole(model, backend, trains=True, optimizer=optimizer, train_config=train_config,
                     routing=routing or NO_ROUTING)


def build_roles(recipe, algorithm, backend, tokenizer, policy, eval_examples=None,
                remote_roles: Optional[dict] = None) -> Models:
    """Every role the algorithm asks for: the policy (already loaded, prepared here), the reference, the teacher, the
    reward models and the critic, each local (partitioned, offloaded as the algorithm says) unless the launch wing
    serves it (`remote_roles`: role name -> a handle whose .as_role(key) is that role's Role). The Models record is the
    only owner of the reference, so an algorithm's setup may free it, and precompute for eval_examples too."""
    t = recipe.train
    remote = remote_roles or {}
    routing = moe_routing(policy, recipe.model.router_aux_loss_coef)  # hooked before the engine wraps the model
    if (recipe.model.router_aux_loss_coef or 0) > 0:
        routing.require(policy, "model.router_aux_loss_coef")
    models = Models(policy=trained_role(backend, policy, t, routing=routing), tokenizer=tokenizer,
                    eval_examples=eval_examples)

    def frozen(role: str, model) -> LocalRole:  # a frozen role on this process
        where = algorithm.placement(role)
        return LocalRole(backend.prepare_frozen(model, offload=where == "offload",
                                                leaf_modules=sparse_block_classes(model)), backend, placement=where)

    if algorithm.needs_reference:
        models.reference = (remote["reference"].as_role() if "reference" in remote
                            else frozen("reference", make_reference(recipe.model, algorithm.model_kind)))
    if (teacher := algorithm.teacher_model()) is not None:
        models.teacher = (remote["teacher"].as_role() if "teacher" in remote
                          else frozen("teacher", make_reference(teacher)))
    for i, scorer in enumerate(algorithm.reward_models()):
        role = (remote["reward_model"].as_role(f"reward_model:{i}") if "reward_model" in remote
                else frozen("reward_model", scorer.load_model()))
        scorer.place(role.forward, backend.device)
        models.reward_model = models.reward_model or role
    if algorithm.needs_critic and "critic" in remote:  # trained by its own actor group
        models.critic = remote["critic"].as_role()
    elif algorithm.needs_critic:
        critic = load_critic(trained_model_config(algorithm.critic_source(), t), tokenizer.pad_token_id,
                             t.gradient_checkpointing)
        models.critic = trained_role(backend, critic, t, algorithm.critic_learning_rate())
    return models
