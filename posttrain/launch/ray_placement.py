"""Where each role's workers go on a Ray cluster: pure functions over a recipe's `placement:` and a cluster description.

    placement = pick_gpu_resource(recipe.placement, ray.nodes())  # gpu_resource auto -> GPU or none
    nodes = nodes_from_ray(ray.nodes(), placement.gpu_resource)  # or by hand: [Node("a", "10.0.0.1", 4, 32)]
    units = resolve(placement, ("policy", "reference"), nodes)
    plan = fit(units, nodes, placement)                          # UserError (exit 2) saying what is short
    print(placement_table(plan))                                 # role | node | GPUs | colocated with

Nothing here imports ray at module level (node_options does when called). A *unit* is what shares GPUs: a `colocate`
group, or one role alone; it needs `num_nodes` distinct nodes with `num_gpus_per_node` GPUs (and `cpus_per_worker`
CPUs per worker) free on each, its roles sharing those GPUs in `gpu_fraction` shares (CPUs only with gpu_resource none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from posttrain.config.schema import PlacementConfig
from posttrain.errors import UserError

EPS = 1e-9


@dataclass(frozen=True)
class Node:
    """One node of the cluster as the fit sees it: its free GPUs (the `gpu_resource` count) and CPUs."""

    node_id: str
    address: str
    gpus: float = 0.0
    cpus: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class Unit:
    """Roles that share GPUs (one role when alone), the nodes x workers they span and each role's GPU share."""

    roles: tuple[str, ...]
    num_nodes: int
    workers_per_node: int
    fractions: tuple[float, ...]

    @property
    def name(self) -> str:
        return "+".join(self.roles)


@dataclass(frozen=True)
class PlacedUnit:
    unit: Unit
    nodes: tuple[Node, ...]
    """The nodes its workers are on, in rank order (workers_per_node consecutive ranks on each)."""


@dataclass(frozen=True)
class Plan:
    units: tuple[PlacedUnit, ...]
    engines: tuple[Node, ...] = ()
    """The node of each generation engine (its tensor_parallel_size GPUs all there)."""
    engine_gpus: int = 0
    gpu_resource: str = "GPU"
    cpus_per_worker: int = 1


def uses_gpus(placement: PlacementConfig) -> bool:
    if placement.gpu_resource == "auto":
        raise ValueError("placement.gpu_resource is still auto: pass the placement through pick_gpu_resource first")
    return placement.gpu_resource.lower() != "none"


def pick_gpu_resource(placement: PlacementConfig, ray_nodes: Iterable[dict[str, Any]]) -> PlacementConfig:
    """gpu_resource auto -> GPU when a live node of the cluster has one, else none (CPU-only workers, as posttrain
    runs without a GPU elsewhere); any other value is kept, so an explicit GPU on a GPU-less cluster fails the fit."""
    if placement.gpu_resource != "auto":
        return placement
    has_gpu = any(n.get("Resources", {}).get("GPU", 0) > 0 for n in ray_nodes if n.get("Alive", True))
    return dataclasses.replace(placement, gpu_resource="GPU" if has_gpu else "none")


def nodes_from_ray(ray_nodes: Iterable[dict[str, Any]], gpu_resource: str) -> list[Node]:
    """`ray.nodes()` (alive ones) -> Nodes."""
    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), float(n.get("Resources", {}).get(gpu_resource, 0.0)),
                 float(n.get("Resources", {}).get("CPU", 0.0))) for n in ray_nodes if n.get("Alive", True)]


def resolve(placement: PlacementConfig, roles: tuple[str, ...], nodes: list[Node]) -> list[Unit]:
    """The units the run needs (`roles`: the roles its algorithm uses, policy first), with defaults filled in:
    colocate unset puts every role with the policy (as torchrun does); a unit's layout is the policy's when the
    policy is in it, else its first member's that is set, else 1 node x 1 GPU; the policy's own unset layout takes
    every GPU node when nothing is placed apart from it, else 1 node x 1 GPU."""
    groups = [tuple(roles)] if placement.colocate is None else [
        tuple(r for r in group if r in roles) for group in placement.colocate]
    groups = [g for g in groups if g]
    grouped = {r for g in groups for r in g}
    groups += [(r,) for r in roles if r not in grouped]
    groups.sort(key=lambda g: "policy" not in g)  # the policy's unit first: it holds rank 0
    alone = len(groups) == 1
    units = []
    for group in groups:
        specs = [getattr(placement, r) for r in group]
        lead = specs[group.index("policy")] if "policy" in group else next(
            (s for s in specs if s.num_nodes is not None or s.num_gpus_per_node is not None), specs[0])
        default_nodes, default_per_node = whole_cluster(placement, nodes) if "policy" in group and alone else (1, 1)
        num_nodes = lead.num_nodes if lead.num_nodes is not None else default_nodes
        per_node = lead.num_gpus_per_node if lead.num_gpus_per_node is not None else default_per_node
        for role, spec in zip(group, specs):
            for key, value in (("num_nodes", num_nodes), ("num_gpus_per_node", per_node)):
                if getattr(spec, key) is not None and getattr(spec, key) != value:
                    raise UserError(f"placement.{role}.{key} is {getattr(spec, key)} but {role} is colocated with "
                                    f"{', '.join(r for r in group if r != role)} on {value}: colocated roles share "
                                    f"their workers, so set the same layout or take {role} out of placement.colocate")
        units.append(Unit(group, num_nodes, per_node, shares(group, [s.gpu_fraction for s in specs])))
    return units


def whole_cluster(placement: PlacementConfig, nodes: list[Node]) -> tuple[int, int]:
    """The default policy layout: every node with a GPU, as many workers per node as the smallest one has."""
    gpu_nodes = [n for n in nodes if n.gpus >= 1 - EPS]
    if not uses_gpus(placement) or not gpu_nodes:
        return 1, 1
    return len(gpu_nodes), int(min(n.gpus for n in gpu_nodes) + EPS)


def shares(group: tuple[str, ...], fractions: list[Optional[float]]) -> tuple[float, ...]:
    """Each role's GPU share: the ones set, the rest split what is left evenly."""
    unset = [f for f in fractions if f is None]
    left = 1.0 - sum(f for f in fractions if f is not None)
    if unset and left <= EPS:
        raise UserError(f"placement.colocate {list(group)}: the gpu_fraction set already takes the whole GPU; "
                        f"lower it or set every role's gpu_fraction")
    return tuple(f if f is not None else left / len(unset) for f in fractions)


def fit(units: list[Unit], nodes: list[Node], placement: PlacementConfig) -> Plan:
    """Choose nodes for every unit (and engine) from the free resources; UserError naming what is short otherwise.
    Units go in order (the policy's first), each on the nodes with the most GPUs free, then the most CPUs."""
    gpu = uses_gpus(placement)
    free = {n.node_id: [n.gpus if gpu else 0.0, n.cpus] for n in nodes}

    def take(what: str, num_nodes: int, per_node: int, need_gpus: float, need_cpus: float) -> tuple[Node, ...]:
        fitting = [n for n in nodes if free[n.node_id][0] + EPS >= need_gpus and free[n.node_id][1] + EPS >= need_cpus]
        fitting.sort(key=lambda n: (-free[n.node_id][0], -free[n.node_id][1]))  # stable: ties keep the nodes' order
        if len(fitting) < num_nodes:
            gpus = f"{need_gpus:g} {placement.gpu_resource} GPU(s) and " if need_gpus else ""
            left = "; ".join(f"{n.label}: {free[n.node_id][0]:g} GPU, {free[n.node_id][1]:g} CPU" for n in nodes)
            hint = "" if not need_gpus or any(n.gpus for n in nodes) else (
                f" The cluster has no '{placement.gpu_resource}' resource at all: start nodes with GPUs, name the "
                "resource standing in for them (placement.gpu_resource=...), or placement.gpu_resource=none for CPUs.")
            raise UserError(f"the placement does not fit the Ray cluster: {what} needs {num_nodes} node(s) with {gpus}"
                            f"{need_cpus:g} CPU(s) free each ({num_nodes * per_node} worker(s)), but only "
                            f"{len(fitting)} node(s) have that left. Free after the roles placed before it: "
                            f"{left or 'no nodes'}. Lower placement.<role>.num_nodes / num_gpus_per_node, colocate "
                            f"roles (placement.colocate), or add nodes.{hint}")
        for n in fitting[:num_nodes]:
            free[n.node_id][0] -= need_gpus
            free[n.node_id][1] -= need_cpus
        return tuple(fitting[:num_nodes])

    placed = [PlacedUnit(u, take(u.name, u.num_nodes, u.workers_per_node, u.workers_per_node if gpu else 0,
                                 u.workers_per_node * placement.cpus_per_worker)) for u in units]
    tp, count = placement.generation.tensor_parallel_size, placement.generation.num_engines
    engines = [take(f"generation engine {i + 1} of {count}", 1, 1, tp if gpu else 0, placement.cpus_per_worker)[0]
               for i in range(count)]
    return Plan(tuple(placed), tuple(engines), tp if gpu else 0, placement.gpu_resource, placement.cpus_per_worker)


def placement_table(plan: Plan) -> str:
    """The start-up banner's table: one row per (role, node)."""
    rows = [("role", "node", "workers", f"GPUs ({plan.gpu_resource})", "colocated with")]
    gpus_used = plan.gpu_resource.lower() != "none"
    for placed in plan.units:
        unit = placed.unit
        for role, fraction in zip(unit.roles, unit.fractions):
            others = ", ".join(r for r in unit.roles if r != role) or "-"
            for n in placed.nodes:
                gpus = f"{unit.workers_per_node} x {fraction:g}" if gpus_used else "0 (CPU)"
                rows.append((role, n.label, str(unit.workers_per_node), gpus, others))
    for i, n in enumerate(plan.engines):
        rows.append((f"engine {i}", n.label, "1", str(plan.engine_gpus), "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def node_options(node: Node, plan: Plan, gpus: float = 1) -> dict[str, Any]:
    """A Ray actor's options on `node`: cpus_per_worker CPUs and `gpus` GPUs (or of the resource standing in for them),
    pinned by hard node affinity (a local test cluster's nodes share one IP, so placement-group bundles could not be
    told apart); the fit already checked the resources are there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = dict(num_cpus=plan.cpus_per_worker, max_restarts=0,
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
    if plan.gpu_resource == "GPU":
        options["num_gpus"] = gpus
    elif plan.gpu_resource.lower() != "none":
        options["resources"] = {plan.gpu_resource: gpus}
    return options


@dataclass(frozen=True)
class RankSlot:
    """One training worker of a unit: its rank, the node it runs on and its rank on that node."""

    rank: int
    node: Node
    local_rank: int
    node_rank: int


def rank_slots(placed: PlacedUnit) -> list[RankSlot]:
    """Ranks as torchrun numbers them: workers_per_node consecutive ranks per node, nodes in plan order."""
    per = placed.unit.workers_per_node
    return [RankSlot(i * per + j, n, j, i) for i, n in enumerate(placed.nodes) for j in range(per)]


def roles_needed(algorithm, recipe) -> tuple[str, ...]:
    """The roles a run of `algorithm` uses, policy first."""
    needed = {"policy": True, "reference": algorithm.needs_reference, "critic": algorithm.needs_critic,
              "reward_model": any(r.name == "reward_model" for r in recipe.rewards),
              "teacher": algorithm.teacher_model() is not None}  # a server teacher (algo.teacher_server) is no role
    return tuple(role for role, wanted in needed.items() if wanted)

