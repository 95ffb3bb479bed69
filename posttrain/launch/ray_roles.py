"""Roles in actor groups of their own under `launcher: ray` (docs/ray.md).

    placement:
      colocate: [[policy, reference], [critic, reward_model]]    # OpenRLHF's --colocate_actor_ref + critic_reward

A frozen role (reference, reward_model, a distillation teacher) placed apart runs as `RoleWorker` replicas, one per
worker slot, each holding the whole model; rank r asks replica r % replicas through a `RayRole`, which returns small
outputs (scores, values, log-probs: the reference's logits never travel; a teacher's do, only the rows that predict a
completion token) and times its calls as `time/role/<role>`. A trained role (PPO's critic) apart is a group of
`TrainedRoleWorker` actors with a process group of its own, one worker per policy rank (rank r drives worker r, so the
group's collectives are reached in order); its updates, checkpoints and final-<role>/ run there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
from transformers import set_seed

from posttrain.algorithms import ALGORITHMS
from posttrain.algorithms.base import Role
from posttrain.batch import Batch
from posttrain.distributed.backend import Backend
from posttrain.distributed.precision import trained_model_config
from posttrain.errors import RunStopped, UserError
from posttrain.launch.ray_actors import Worker, last_line, rank_env
from posttrain.launch.ray_placement import node_options, rank_slots
from posttrain.models.critic import load_critic
from posttrain.models.forward import policy_logits_at, policy_logprobs
from posttrain.models.load import load_tokenizer
from posttrain.models.reference import make_reference
from posttrain.roles import trained_role

FROZEN_ROLES = ("reference", "reward_model", "teacher")
LOAD_TIMEOUT_S = 600.0


class RoleWorkerDied(RuntimeError):
    """A role replica's actor is gone; `where` names the role, the replica and its node."""

    def __init__(self, where: str, cause: str):
        self.where, self.cause = where, cause
        super().__init__(f"{where}: its actor died: {cause}")


class RoleWorker(Worker):
    """One replica of a unit's frozen roles; its methods run in the actor's process."""

    def load(self, command: str, recipe, roles: tuple[str, ...], env: dict[str, str]) -> dict[str, int]:
        """Load every model of `roles` as a run would, under the keys 'reference', 'reward_model:<i>' (the i-th of
        algorithm.reward_models()) and 'teacher' (algorithm.teacher_model()). Returns each key's parameter count."""
        os.environ.update(env)
        set_seed(recipe.seed)  # a seq_cls reference's fresh head is the policy's only after the same seed
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Ray shows each actor its GPU
        return self._load_frozen(ALGORITHMS[command][1](recipe), recipe, roles, device)

    def _load_frozen(self, algorithm, recipe, roles: tuple[str, ...], device) -> dict[str, int]:
        self.device = device
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.train.mixed_precision)
        self.models: dict[str, Any] = {}
        if "reference" in roles:
            self.models["reference"] = make_reference(recipe.model, algorithm.model_kind).to(self.device)
        if "reward_model" in roles:
            for i, scorer in enumerate(algorithm.reward_models()):
                self.models[f"reward_model:{i}"] = scorer.load_model().requires_grad_(False).to(self.device)
        if "teacher" in roles:
            self.models["teacher"] = make_reference(algorithm.teacher_model()).to(self.device)
        return {key: sum(p.numel() for p in m.parameters()) for key, m in self.models.items()}

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def logprobs(self, key: str, batch, temperature: float):
        """Token log-probs of `batch` under the model `key` (algorithms.forward.policy_logprobs), on CPU."""
        with torch.no_grad(), self._autocast():
            return policy_logprobs(self.models[key], batch.to(self.device), temperature).float().cpu()

    def logits_at(self, key: str, batch, rows_n):
        """The logits of the flat rows `rows_n` of `batch` under the model `key` (models.forward.policy_logits_at),
        on CPU: a teacher's completion rows, the only ones sent back."""
        with torch.no_grad(), self._autocast():
            return policy_logits_at(self.models[key], batch.to(self.device), rows_n.to(self.device)).cpu()

    def forward(self, key: str, inputs: dict):
        """The model's logits for keyword inputs (input_ids, attention_mask, ...), on CPU."""
        with torch.no_grad(), self._autocast():
            out = self.models[key](**{k: v.to(self.device) for k, v in inputs.items()}, use_cache=False)
        return out.logits.cpu()


class TrainedRoleWorker(RoleWorker):
    """One worker of a trained role's group (its model, optimiser, schedule and Backend), driven by the policy's rank
    `RANK`; frozen roles colocated with it are served from the same worker."""

    def load(self, command: str, recipe, roles: tuple[str, ...], env: dict[str, str]) -> dict[str, int]:
        """Join the group (env: its RANK, WORLD_SIZE, MASTER_ADDR, ...), load the trained role as run.py would, then
        the frozen ones. Returns each key's parameter count."""
        os.environ.update(env)
        self.name = next(r for r in roles if r not in FROZEN_ROLES)
        if self.name != "critic":
            raise ValueError(f"no trained role {self.name!r} to run apart")
        self.algorithm = ALGORITHMS[command][1](recipe)
        self.backend = Backend(recipe)
        self.tokenizer = load_tokenizer(recipe.model)
        set_seed(recipe.seed)
        t = recipe.train
        model = load_critic(trained_model_config(self.algorithm.critic_source(), t), self.tokenizer.pad_token_id,
                            t.gradient_checkpointing)
        count = sum(p.numel() for p in model.parameters())
        self.role = trained_role(self.backend, model, t, self.algorithm.critic_learning_rate())
        self.role.train()
        frozen = self._load_frozen(self.algorithm, recipe, tuple(r for r in roles if r in FROZEN_ROLES),
                                   self.backend.device)
        return {self.name: count, **frozen}

    def schedule(self, key: str, total_steps: int) -> float:
        """The role's LR schedule over the run's steps (known once the rank has its data source)."""
        self.role.start_schedule(total_steps)
        return self.role.learning_rate()

    def forward(self, key: str, inputs: dict):
        """Values for prepare (no gradient), as a colocated critic gives them; a frozen role's logits."""
        if key != self.name:
            return super().forward(key, inputs)
        with torch.no_grad(), self.backend.autocast():
            # no KV cache: with one, transformers does not see the packed sequences of a padding-free batch
            out = self.role.model(**{k: v.to(self.backend.device) for k, v in inputs.items()}, use_cache=False)
        return out.logits.float().cpu()

    def update(self, key: str, step: int, micro_batches: list, normaliser, skip_nonfinite: bool):
        """The local role's update on this worker's share of the step -> (loss, grad norm, metric sums, LR), on CPU."""
        device = self.backend.device
        loss, grad_norm, metrics = self.role.update(step, self.algorithm.objectives(step, None)[self.name],
                                                    [b.to(device) for b in micro_batches], normaliser.to(device),
                                                    skip_nonfinite)
        return (loss.cpu(), grad_norm, {k: v.cpu() for k, v in metrics.items()}, self.role.learning_rate())

    def nonfinite(self, key: str) -> float:
        """NaN/inf parameter tensors over the whole group (agreed with one all-reduce, like guard.require_finite)."""
        bad = torch.tensor(self.role.nonfinite(), device=self.backend.device)
        return float(self.backend.all_reduce_sum(bad))

    def save(self, key: str, path: str) -> None:
        """The group's engine state into `path`, the schedule's state beside it."""
        self.backend.save_state(path)
        if self.backend.is_main:
            (Path(path) / "role_state.json").write_text(json.dumps({"scheduler": self.role.schedule_state()}))
        self.backend.barrier()

    def restore(self, key: str, path: str) -> float:
        """What `save` wrote; returns the restored learning rate."""
        self.backend.load_state(path)
        self.role.restore(path, json.loads((Path(path) / "role_state.json").read_text())["scheduler"])
        return self.role.learning_rate()

    def export(self, key: str, output_dir: str, name: str) -> None:
        """output_dir/<name> (final-critic) as a Hugging Face directory, as run.py exports a colocated one."""
        self.role.export(output_dir, name, self.tokenizer)


@dataclass(eq=False)
class RayRole(Role):
    """A role served by its actor group, as a training rank holds it (see the module docstring): its replica's actor,
    where that runs, the seconds its calls took (one timer for every key of the role) and the model `key` it asks."""

    role: str = ""
    actor: Any = None
    where: str = ""
    trains: bool = False
    timer: list[float] = field(default_factory=lambda: [0.0])
    key: str = ""
    lr: float = float("nan")
    placement: str = "ray"

    def as_role(self, key: Optional[str] = None) -> "RayRole":
        """The Role a rank holds for `key` (a reward model's 'reward_model:<i>'; default the role itself)."""
        return dataclasses.replace(self, key=key or self.role)

    def _call(self, method: str, *args, timed: bool = True):
        """The replica's `method`(key, *args); timed: counted in time/role/<role> (the loop times updates itself)."""
        import ray
        from ray.exceptions import RayActorError

        started = time.perf_counter()
        try:
            return ray.get(getattr(self.actor, method).remote(self.key, *args))
        except RayActorError as e:
            raise RoleWorkerDied(self.where, last_line(str(e))) from None
        finally:
            if timed:
                self.timer[0] += time.perf_counter() - started

    def forward(self, use_cache: bool = False, **inputs):
        """An object whose .logits sit on the inputs' device (values of a critic, scores of a reward model)."""
        device = inputs["input_ids"].device
        logits = self._call("forward", {k: v.detach().cpu() for k, v in inputs.items()})
        return SimpleNamespace(logits=logits.to(device))

    def logprobs(self, batch, temperature: float = 1.0):
        """Token log-probs of `batch` (only the fields a forward reads are sent), on the batch's device."""
        return self._call("logprobs", _forward_fields(batch), temperature).to(batch.input_ids_BT.device)

    def logits_at(self, batch, rows_n):
        """The logits of the flat rows `rows_n` of `batch`, computed by the replica (only those rows travel back), on
        the batch's device."""
        return self._call("logits_at", _forward_fields(batch), rows_n.cpu()).to(batch.input_ids_BT.device)

    def seconds(self) -> float:
        """Seconds this role's calls took since last asked (all keys of the role)."""
        seconds, self.timer[0] = self.timer[0], 0.0
        return seconds

    def start_schedule(self, total_steps: int) -> None:
        self.lr = self._call("schedule", total_steps, timed=False)

    def learning_rate(self) -> float:
        return self.lr

    def update(self, step: int, objective, micro_batches: list, normaliser, skip_nonfinite: bool):
        """Loop phase 4 for this role, run by its worker with the algorithm's own objective for `step`."""
        device = normaliser.device
        loss, grad_norm, metrics, self.lr = self._call("update", step, [b.to("cpu") for b in micro_batches],
                                                       normaliser.detach().cpu(), skip_nonfinite, timed=False)
        return loss.to(device), grad_norm, {k: v.to(device) for k, v in metrics.items()}

    def nonfinite(self) -> float:
        return self._call("nonfinite", timed=False)

    def save(self, path: str) -> None:
        self._call("save", path, timed=False)

    def restore(self, path: str, schedule) -> None:
        self.lr = self._call("restore", path, timed=False)

    def export(self, output_dir: str, name: str, tokenizer) -> None:
        self._call("export", output_dir, name, timed=False)


def _forward_fields(batch: Batch) -> Batch:
    """The batch's fields a forward reads, on CPU (what a replica is sent)."""
    return Batch(batch.input_ids_BT, batch.completion_mask_BT, attention_mask_BT=batch.attention_mask_BT,
                 position_ids_BT=batch.position_ids_BT, padding_free=batch.padding_free).to("cpu")


def check_apart(units) -> None:
    """A trained role apart from the policy (the critic) needs as many workers as the policy has ranks; said before
    anything starts."""
    policy = units[0]
    for unit in units[1:]:
        trained = [r for r in unit.roles if r not in FROZEN_ROLES]
        workers, ranks = unit.num_nodes * unit.workers_per_node, policy.num_nodes * policy.workers_per_node
        if trained and workers != ranks:
            raise UserError(f"placement: {unit.name} apart from the policy has {workers} worker(s) but the policy has "
                            f"{ranks}: a trained role's group has one worker per training rank (each rank drives its "
                            f"own); set placement.{trained[0]}.num_nodes / num_gpus_per_node to the policy's layout")


@dataclass
class RoleGroups:
    """The replicas of every unit apart from the policy, started and loaded by the driver."""

    actors: list = field(default_factory=list)
    replicas: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    """role -> [(actor, where)] in replica order."""

    def for_rank(self, rank: int) -> dict[str, RayRole]:
        """Rank r's replica of each role: r % replicas (a trained role's group has one worker per rank)."""
        return {role: RayRole(role, *reps[rank % len(reps)], trains=role not in FROZEN_ROLES)
                for role, reps in self.replicas.items()}


def start_role_groups(ray, plan, command: str, recipe, env: dict[str, str]) -> RoleGroups:
    """One worker per slot of each unit apart from the policy, on its node, loading in parallel (none when every role
    is with the policy). A replica that fails to load stops the start naming its role and node (UserError: exit 2)."""
    groups = RoleGroups()
    loads = []
    for placed in plan.units[1:]:
        trained = any(r not in FROZEN_ROLES for r in placed.unit.roles)
        slots = rank_slots(placed)
        worker = ray.remote(TrainedRoleWorker if trained else RoleWorker)
        actors = [worker.options(**node_options(slot.node, plan)).remote() for slot in slots]
        group_env = [{} for _ in slots]
        if trained:  # a torch.distributed group of its own, joined by every worker's load at once
            address, port = ray.get(actors[0].rendezvous.remote(len(slots)))
            group_env = [rank_env(slot, len(slots), len(placed.nodes), address, port, plan) for slot in slots]
        for slot, actor, own in zip(slots, actors, group_env):
            where = f"{placed.unit.name} worker {slot.rank} on node {slot.node.label}"
            groups.actors.append(actor)
            for role in placed.unit.roles:
                groups.replicas.setdefault(role, []).append((actor, where))
            loads.append((actor.load.remote(command, recipe, placed.unit.roles, {**env, **own}), where))
    for ref, where in loads:
        try:
            ray.get(ref, timeout=LOAD_TIMEOUT_S)
        except Exception as e:  # the actor's own error comes wrapped; its message says what went wrong
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            raise RunStopped(f"{where} could not load its model(s): {str(cause).strip().splitlines()[-1]}",
                             shared=False) from None
    return groups
