"""What every posttrain Ray actor shares: the ray import, the actor base (its node, a rendezvous address), the
variables torchrun would give a worker, and Ray's actor-death messages made short. Nothing here imports ray at import
time: the launcher's callers work without the ray extra until a Ray run is asked for."""

from __future__ import annotations

import contextlib
import re

from posttrain.errors import UserError
from posttrain.launch.ray_placement import Plan, RankSlot

INSTALL = "pip install 'posttrain[ray]' (or pip install 'ray[default]>=2.40')"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torch.distributed: the rendezvous store is hosted elsewhere
STORE_TIMEOUT_S = 1800.0  # the store's own requests (torch.distributed's default process-group timeout)


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError(f"launcher: ray needs the ray package, which is not installed: {INSTALL}") from None
    return ray


class Worker:
    """What every posttrain actor answers: its node, and (asked of a group's first worker) a rendezvous address."""

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous(self, world_size: int) -> tuple[str, int]:
        """Host the torch.distributed store of this worker's group on this node's address only, and return that
        address and the store's port (MASTER_ADDR / MASTER_PORT of the group). Every rank joins it as a client
        (USE_AGENT_STORE in rank_env, as under torchrun, whose agent hosts it): a store rank 0 started itself would
        listen on every interface."""
        import ray

        from posttrain.distributed.sync_group import SyncStore

        self._store = SyncStore(ray.util.get_node_ip_address(), world_size, STORE_TIMEOUT_S)  # lives with the actor
        return self._store.addr, self._store.port


def rank_env(slot: RankSlot, world_size: int, num_nodes: int, master_addr: str, master_port: int,
             plan: Plan) -> dict[str, str]:
    """What torchrun gives a worker. With real GPUs Ray shows each actor only its own GPU (CUDA_VISIBLE_DEVICES), so
    its local device is cuda:0."""
    local_rank = 0 if plan.gpu_resource == "GPU" else slot.local_rank
    return {"RANK": str(slot.rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(world_size // num_nodes), "GROUP_RANK": str(slot.node_rank),
            "GROUP_WORLD_SIZE": str(num_nodes), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            USE_AGENT_STORE: "True"}


def kill_all(ray, actors: list) -> None:
    """Kill every actor, best effort (one already gone is no error)."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)


def last_line(message: str) -> str:
    """Ray's actor-death message without its generic advice: what happened and the worker's exit detail."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return re.split(r"\s*Some common causes", text, maxsplit=1)[0]
