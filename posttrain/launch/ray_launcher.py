"""`launcher: ray`: the training processes as Ray actors placed by the recipe's `placement:` (docs/ray.md).

    ray start --head --num-gpus 4                                  # or an existing cluster; none: a local one
    posttrain grpo --config recipes/grpo.yaml --ray placement.policy.num_gpus_per_node=4

The driver (this process) fits the placement to the cluster, prints the placement table, then starts one actor per
rank on the node the fit chose. Each runs `posttrain.run.run` as one rank of a torch.distributed group with the
environment torchrun would give it, so a Ray run and a torchrun run with the same seed and world size train the same
weights. Roles placed apart (placement.colocate) run in actor groups of their own (ray_roles.py) and generation
engines in actors of their own (ray_engines.py), both started before the ranks. A rank that fails or an actor that
dies stops the run: the driver names the rank, its node and its last error, and stops the others.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from posttrain.algorithms import ALGORITHMS
from posttrain.config.schema import Recipe
from posttrain.plan.preflight import check_recipe
from posttrain.launch.ray_inputs import absolute_paths, worker_env
from posttrain.launch.ray_engines import Engines, check_engines, start_engines
from posttrain.launch.ray_placement import (Plan, RankSlot, fit, node_options, nodes_from_ray, pick_gpu_resource,
                                            placement_table, rank_slots, resolve, roles_needed)
from posttrain.launch.ray_actors import Worker, import_ray, kill_all, last_line, rank_env
from posttrain.launch.ray_roles import RoleWorkerDied, check_apart, start_role_groups
from posttrain.errors import RunStopped, UserError
from posttrain.rundir.claim import RAY_SESSION_DIR, check_output_dir
from posttrain.run import Launched, run

START_TIMEOUT_S = 300.0  # actors not started by then: their resources are held by something else
GRACE_S = 10.0  # after the first failure, how long the others get to report theirs (a survivor's error is noise)
SOCKET_TAIL = "/session_2026-11-26_15-50-51_699182_4194304/sockets/plasma_store.99"  # the longest Ray adds


class RankWorker(Worker):
    """One training rank."""

    def run(self, command: str, recipe: Recipe, cwd: str, env: dict[str, str], remote_roles: dict,
            servers: list[str]) -> dict[str, Any]:
        """The ordinary run as rank env["RANK"], with `remote_roles` served apart and the engines at `servers`.
        Errors come back as data, so the driver can name the rank (or the replica that died)."""
        os.environ.update(env)
        os.chdir(cwd)
        try:
            result = run(command, recipe, Launched(remote_roles, tuple(servers)))
            return {"code": 0, "final_dir": str(result.final_dir) if result.final_dir else None, "steps": result.steps}
        except UserError as e:
            return {"code": 2, "error": str(e)}
        except RoleWorkerDied as e:
            return {"code": 1, "died": True, "where": e.where, "error": e.cause}
        except RunStopped as e:
            return {"code": e.exit_code, "error": str(e), "stopped": True}
        except BaseException:  # the traceback goes back to the driver, which stops the others
            return {"code": 1, "error": traceback.format_exc()}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def placed_world(recipe: Recipe) -> int:
    """The policy's training ranks as the recipe places them (placement.policy.num_nodes x num_gpus_per_node); where
    the cluster decides (either is unset), the sequence-parallel size, so the shape checks pass on the world and the
    ranks check it again once placed."""
    p = recipe.placement.policy
    if p.num_nodes is not None and p.num_gpus_per_node is not None:
        return p.num_nodes * p.num_gpus_per_node
    return recipe.train.sequence_parallel_size


def run_on_ray(command: str, recipe: Recipe) -> int:
    """Place, start, wait, report. Returns the exit code (0 done, 2 input, 1 failure or a rank's own code)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("launcher: ray starts its own processes: run `posttrain ...` once, not under torchrun or "
                        "accelerate launch")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # rank 0's and rank 1's lines are not duplicates to fold
    ray = import_ray()
    algorithm = ALGORITHMS[command][1](recipe)
    algorithm.preflight()  # the algorithm's own checks, before a cluster is touched
    check_recipe(recipe, algorithm, world=placed_world(recipe))  # the recipe's shapes, as a run and the planner
    roles = roles_needed(algorithm, recipe)
    recipe = absolute_paths(recipe)  # a relative path means the same in every actor, on every node
    address = recipe.placement.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:  # the cluster's session goes into output_dir: refuse one the run could not use first
        check_output_dir(recipe, command)
    start_ray(ray, address, Path(recipe.output_dir))
    actors: list = []
    engines = Engines()
    try:
        p = pick_gpu_resource(recipe.placement, ray.nodes())
        nodes = nodes_from_ray(ray.nodes(), p.gpu_resource)
        units = resolve(p, roles, nodes)
        check_apart(units)  # what this build cannot run, or contradicts the recipe, before any actor starts
        check_engines(recipe)
        plan = fit(units, nodes, p)
        print(f"posttrain ray placement ({len(nodes)} node(s), cluster {address or 'local'}):\n"
              f"{placement_table(plan)}", flush=True)
        forwarded = worker_env(os.environ, recipe)
        engines = start_engines(ray, plan, recipe, forwarded)  # placement.generation.num_engines servers, if any
        groups = start_role_groups(ray, plan, command, recipe, forwarded)  # load before the ranks start
        actors += groups.actors
        slots = rank_slots(plan.units[0])
        ranks = [ray.remote(RankWorker).options(**node_options(slot.node, plan)).remote() for slot in slots]
        actors += ranks
        wait_started(ray, ranks, slots)
        master_addr, master_port = ray.get(ranks[0].rendezvous.remote(len(slots)))
        env = {s.rank: {**forwarded, **engines.env, **rank_env(s, len(slots), len(plan.units[0].nodes), master_addr,
                                                               master_port, plan)} for s in slots}
        futures = {ranks[s.rank].run.remote(command, recipe, os.getcwd(), env[s.rank], groups.for_rank(s.rank),
                                            engines.urls): s for s in slots}
        return wait_for_ranks(ray, futures, plan)
    finally:
        engines.stop()
        kill_all(ray, actors)
        ray.shutdown()


def start_ray(ray, address: str | None, output_dir: Path) -> None:
    """Join the cluster at `address`, or start one for the run: every process of it (GCS, raylet, workers, agents,
    this driver) listening on 127.0.0.1 only, its session (logs, sockets) in session_root(output_dir).

    ray.init turns a node address of 127.0.0.1 into the machine's reachable one (services.resolve_ip_for_localhost)
    unless Ray takes clusters for unsupported on this OS (ray_constants.ENABLE_RAY_CLUSTER, from
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when ray is imported): then the node is 127.0.0.1, and the GCS, raylet and
    workers bind 127.0.0.1 instead of every interface, the agents the node's address. Held only while ray.init
    resolves the address (tests/integration/test_recipes.py checks every listener of a run, recipes/ppo_ray.yaml)."""
    options = init_options(address, output_dir)
    if address is not None:
        ray.init(**options)
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
    root = options.get("_temp_dir")
    if root is not None:
        os.chmod(root, 0o700)  # Ray makes it world-writable (for users sharing /tmp/ray); this one is the run's
    where = root or "Ray's default, /tmp/ray (output_dir's and ~/.cache's paths are too long for Ray's sockets)"
    print(f"posttrain ray: a local cluster for this run, on 127.0.0.1 only; its logs under {where}", flush=True)


def init_options(address: str | None, output_dir: Path) -> dict[str, Any]:
    """ray.init's options: join the cluster at `address`, or start one for the run with its session under
    session_root(output_dir)."""
    options = dict(address=address, include_dashboard=False, configure_logging=False, log_to_driver=True)
    root = None if address else session_root(output_dir)
    return options if root is None else {**options, "_temp_dir": str(root)}


def session_root(output_dir: Path) -> Path | None:
    """Where a local cluster keeps its sessions: <output_dir>/ray, or ~/.cache/posttrain/ray where Ray's socket
    paths (<root>/session_<time>_<pid>/sockets/plasma_store) would not fit the 107 bytes of a Unix socket path;
    None (Ray's own /tmp/ray) where neither fits."""
    for root in (output_dir.resolve() / RAY_SESSION_DIR, Path.home() / ".cache" / "posttrain" / "ray"):
        if len(str(root).encode()) + len(SOCKET_TAIL) <= 107:
            return root
    return None


def wait_started(ray, actors: list, slots: list[RankSlot]) -> None:
    """Every actor up on its planned node, or a clear error (the fit counts a node's total resources; another job
    may be holding some of them)."""
    from ray.exceptions import GetTimeoutError

    refs = [a.node.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT_S)
    if len(ready) < len(refs):
        late = [s for s, ref in zip(slots, refs) if ref not in ready]
        raise RunStopped(f"Ray did not start rank(s) {', '.join(str(s.rank) for s in late)} within "
                         f"{START_TIMEOUT_S:.0f} s on node(s) {', '.join(s.node.label for s in late)}: their resources "
                         "are probably held by another job (see `ray status`)", shared=False)
    try:
        placed = ray.get(refs, timeout=10)
    except GetTimeoutError:
        placed = []
    for slot, node_id in zip(slots, placed):
        if node_id != slot.node.node_id:  # hard node affinity makes this impossible; a guard, not a branch
            raise RunStopped(f"Ray started rank {slot.rank} on node {node_id[:8]}, not {slot.node.label}", shared=False)


def wait_for_ranks(ray, futures: dict, plan: Plan) -> int:
    """Every rank's result; on the first failure, the others get GRACE_S to report, then the worst is named."""
    from ray.exceptions import RayActorError

    pending = list(futures)
    results: dict[int, dict[str, Any]] = {}
    deadline = None
    while pending and (deadline is None or time.monotonic() < deadline):
        timeout = None if deadline is None else max(0.1, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        for ref in done:
            slot = futures[ref]
            try:
                results[slot.rank] = ray.get(ref)
            except RayActorError as e:
                results[slot.rank] = {"code": 1, "died": True, "error": last_line(str(e))}
            except Exception as e:  # the task itself failed (e.g. the recipe could not be unpickled there)
                results[slot.rank] = {"code": 1, "error": str(e)}
            if results[slot.rank]["code"] != 0 and deadline is None:
                deadline = time.monotonic() + GRACE_S
    failed = {r: res for r, res in results.items() if res["code"] != 0}
    if not failed and not pending:
        if results[0].get("final_dir"):
            print(f"final model: {results[0]['final_dir']}", flush=True)
        return 0
    rank, cause = pick_cause(failed)
    slot = next(s for s in futures.values() if s.rank == rank)
    role = "+".join(plan.units[0].unit.roles)
    where = cause.get("where") or f"rank {rank} ({role} worker on node {slot.node.label})"
    if cause.get("code") == 2:
        print(f"posttrain: error: {cause['error']}", file=sys.stderr, flush=True)
        return 2
    if cause.get("stopped"):
        print(f"posttrain: stopped ({where}): {cause['error']}", file=sys.stderr, flush=True)
        return cause["code"]
    # Ray's generic advice is cut whichever way the death was reported
    what, error = ("its actor died", last_line(cause["error"])) if cause.get("died") else ("it failed", cause["error"])
    print(f"posttrain: error: {where}: {what}: {error.rstrip()}\nThe other ranks were stopped. Checkpoints "
          "already saved are complete; continue with train.resume_from_checkpoint=auto", file=sys.stderr, flush=True)
    return cause["code"] or 1


def pick_cause(failed: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The failure to report: a user error, else an actor that died (its peers only saw the connection drop), else a
    rank's own error whose traceback does not just say a peer went away, else the lowest rank."""
    def rank_of(r_res):
        r, res = r_res
        peer_noise = any(s in res.get("error", "") for s in ("Connection closed by peer", "Connection reset by peer",
                                                             "Broken pipe", "connection refused"))
        return (res.get("code") != 2, not res.get("died"), peer_noise, r)

    return min(failed.items(), key=rank_of)
