"""Frozen roles in actor groups of their own under `launcher: ray` (docs/ray.md).

    placement:
      colocate: [[policy], [reference, reward_model]]     # the frozen roles on a GPU (or node) of their own

A frozen role (reference, reward_model) placed apart from the policy runs as replicas: one `RoleWorker` actor per
worker slot of its unit, pinned to the node the fit chose, each holding the whole model and serving no-grad forwards.
Training rank r asks replica r % replicas. Frozen models need no collectives, so replicas need no process group of
their own, and a replica holds exactly the weights a colocated copy would (the policy's source, or the reward model's).

In the training ranks the role's model is a `RemoteModel`: called like the module (a reward model's scores, values:
small outputs), or asked for token log-probs by `algorithms.forward.policy_logprobs` (the (B, T, V) logits never
leave the replica). The algorithms call `models.reference.model` as they would a local module and do not know Ray
exists. Each RemoteModel counts the seconds its calls take (transfer included), logged per step as
`time/role/<role>`. A replica that dies stops the run naming the role, the replica and its node.

Trained roles (the critic) apart from the policy need their own process group and optimiser step in lockstep with the
policy's; that is not built yet, and the launcher says so before anything starts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

FROZEN_ROLES = ("reference", "reward_model")
LOAD_TIMEOUT_S = 600.0


class RoleWorkerDied(RuntimeError):
    """A role replica's actor is gone; `where` names the role, the replica and its node."""

    def __init__(self, where: str, cause: str):
        self.where = where
        super().__init__(f"{where}: its actor died: {cause}")


class RoleWorker:
    """One replica of a unit's frozen roles. Its methods run in the actor's process; nothing heavy is imported before
    `load`."""

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def load(self, command: str, recipe, roles: tuple[str, ...], env: dict[str, str]) -> dict[str, int]:
        """Load every model of `roles` as a run would: the reference from the policy's source (the algorithm's head),
        each `reward_model` entry of the recipe from its path. Keys: 'reference', 'reward_model:<i>' (the i-th reward
        model of algorithm.reward_models()). Returns each key's parameter count."""
        os.environ.update(env)
        import torch

        from posttrain.algorithms import ALGORITHMS
        from posttrain.run import seed_everything

        algorithm = ALGORITHMS[command][1](recipe)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Ray shows each actor its GPU
        precision = recipe.train.mixed_precision
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        seed_everything(recipe.seed)  # a seq_cls reference's fresh head is the policy's only after the same seed
        self.models: dict[str, Any] = {}
        if "reference" in roles:
            from posttrain.models.reference import make_reference

            self.models["reference"] = make_reference(recipe.model, algorithm.model_kind).to(self.device)
        if "reward_model" in roles:
            for i, scorer in enumerate(algorithm.reward_models()):
                self.models[f"reward_model:{i}"] = scorer.load_model().requires_grad_(False).to(self.device)
        return {key: sum(p.numel() for p in m.parameters()) for key, m in self.models.items()}

    def _autocast(self):
        import torch

        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def logprobs(self, key: str, batch, temperature: float):
        """Token log-probs of `batch` under the model `key` (algorithms.forward.policy_logprobs), on CPU."""
        import torch

        from posttrain.algorithms.forward import policy_logprobs

        with torch.no_grad(), self._autocast():
            return policy_logprobs(self.models[key], batch.to(self.device), temperature).float().cpu()

    def forward(self, key: str, inputs: dict):
        """The model's logits for keyword inputs (input_ids, attention_mask, ...), on CPU."""
        import torch

        with torch.no_grad(), self._autocast():
            out = self.models[key](**{k: v.to(self.device) for k, v in inputs.items()}, use_cache=False)
        return out.logits.cpu()


@dataclass
class RemoteRole:
    """A training rank's handle on its replica of one role: the actor, where it runs, the seconds its calls took."""

    role: str
    actor: Any
    where: str
    seconds: list[float] = field(default_factory=lambda: [0.0])

    def model(self, key: Optional[str] = None) -> "RemoteModel":
        return RemoteModel(self, key or self.role)


class RemoteModel:
    """What a rank holds as the model of a role served by a replica (see the module docstring)."""

    def __init__(self, remote: RemoteRole, key: str):
        self.remote, self.key = remote, key

    def _call(self, method: str, *args):
        import ray
        from ray.exceptions import RayActorError

        started = time.perf_counter()
        try:
            return ray.get(getattr(self.remote.actor, method).remote(self.key, *args))
        except RayActorError as e:
            from posttrain.distributed.ray_launcher import last_line

            raise RoleWorkerDied(self.remote.where, last_line(str(e))) from None
        finally:
            self.remote.seconds[0] += time.perf_counter() - started

    def __call__(self, use_cache: bool = False, **inputs):
        """Like a transformers forward: an object whose .logits sit on the inputs' device."""
        from types import SimpleNamespace

        device = inputs["input_ids"].device
        logits = self._call("forward", {k: v.detach().cpu() for k, v in inputs.items()})
        return SimpleNamespace(logits=logits.to(device))

    def remote_logprobs(self, batch, temperature: float):
        """Token log-probs of `batch` (only the fields a forward reads are sent), on the batch's device."""
        from posttrain.batch import Batch

        sent = Batch(batch.input_ids_BT.cpu(), batch.completion_mask_BT.cpu(),
                     attention_mask_BT=None if batch.attention_mask_BT is None else batch.attention_mask_BT.cpu(),
                     position_ids_BT=None if batch.position_ids_BT is None else batch.position_ids_BT.cpu())
        return self._call("logprobs", sent, temperature).to(batch.input_ids_BT.device)

    def take_seconds(self) -> float:
        """Seconds this role's calls took since the last take (all keys of the role)."""
        seconds, self.remote.seconds[0] = self.remote.seconds[0], 0.0
        return seconds

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self


def check_apart(units) -> None:
    """Roles apart from the policy must be frozen; a trained one (the critic) is refused before anything starts."""
    from posttrain.errors import UserError

    for unit in units[1:]:
        trained = [r for r in unit.roles if r not in FROZEN_ROLES]
        if trained:
            raise UserError(f"placement: {', '.join(trained)} in an actor group apart from the policy is not built "
                            f"yet (trained roles need their own process group and step); colocate "
                            f"{', '.join(trained)} with the policy (placement.colocate: [[policy, "
                            f"{', '.join(trained)}], ...]). Frozen roles ({', '.join(FROZEN_ROLES)}) may sit apart")


@dataclass
class RoleGroups:
    """The replicas of every unit apart from the policy, started and loaded by the driver."""

    actors: list = field(default_factory=list)
    replicas: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    """role -> [(actor, where)] in replica order."""

    def for_rank(self, rank: int) -> dict[str, RemoteRole]:
        return {role: RemoteRole(role, *reps[rank % len(reps)]) for role, reps in self.replicas.items()}


def start_role_groups(ray, plan, command: str, recipe, env: dict[str, str],
                      options_for: Callable[[Any], dict]) -> RoleGroups:
    """Start one RoleWorker per slot of each unit apart from the policy, on its node (`options_for(slot)`: the actor
    options the launcher gives a worker there), load their models in parallel, and wait. A replica that fails to
    load stops the start naming its role and node (its own error: a UserError, e.g. a missing file, exits 2)."""
    from posttrain.distributed.ray_placement import rank_slots
    from posttrain.errors import RunStopped

    groups = RoleGroups()
    loads = []
    for placed in plan.units[1:]:
        for slot in rank_slots(placed):
            actor = ray.remote(RoleWorker).options(**options_for(slot)).remote()
            where = f"{placed.unit.name} worker {slot.rank} on node {slot.node.label}"
            groups.actors.append(actor)
            for role in placed.unit.roles:
                groups.replicas.setdefault(role, []).append((actor, where))
            loads.append((actor.load.remote(command, recipe, placed.unit.roles, env), where))
    for ref, where in loads:
        try:
            ray.get(ref, timeout=LOAD_TIMEOUT_S)
        except Exception as e:  # the actor's own error comes wrapped; its message says what went wrong
            cause = getattr(e, "cause", None) or e
            from posttrain.errors import UserError

            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            raise RunStopped(f"{where} could not load its model(s): {str(cause).strip().splitlines()[-1]}",
                             shared=False) from None
    return groups
