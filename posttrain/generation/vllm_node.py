"""`generation.placement: node`: one vLLM engine per node, shared by the node's training ranks.

    generation: {engine: vllm, placement: node, vllm: {tensor_parallel_size: 8}}   # one engine over a node's 8 GPUs

The node's first rank (LOCAL_RANK 0) starts the engine as a child process (`posttrain serve` on 127.0.0.1, output in
`<output_dir>/engines/vllm-node<k>.log`); every rank of the node generates on it as the server engine does
(generation/server.py), and the first rank pushes the weight syncs. Why a process of its own: vLLM built inside a
training process adopts the trainers' torch.distributed world and runs start-up collectives over it, which the ranks
without an engine would never join (docs/generation.md, "One engine per node").
"""

from __future__ import annotations

import atexit
import os
import secrets
from pathlib import Path

import torch

from posttrain.errors import RunStopped, UserError
from posttrain.generation.server import ServerEngine
from posttrain.generation.server_process import LOG_DIR, ServerProcess, serve_args, server_env


def node_position(rank: int, world_size: int) -> tuple[int, int]:
    """(node index, rank within the node) of a training process, from torchrun's variables (GROUP_RANK,
    LOCAL_RANK, LOCAL_WORLD_SIZE; accelerate launch and posttrain's Ray workers set them too). One process: (0, 0)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, local_world)))
    node = os.environ.get("GROUP_RANK")
    return (int(node) if node is not None else rank // max(1, local_world)), local_rank


class NodeEngine(ServerEngine):
    """`GenerationEngine` for `placement: node`: the server engine over the engine the node's first rank started.
    Built on every rank at the same point (its start-up is a collective: each rank learns its node's URL)."""

    outlives_run = False  # the engine ends with the run: no final sync

    def __init__(self, recipe, backend, tokenizer):
        self.backend = backend
        self.node, local_rank = node_position(backend.rank, backend.world_size)
        self.server = ServerProcess() if local_rank == 0 else None
        self.log = Path(recipe.output_dir).resolve() / LOG_DIR / f"vllm-node{self.node}.log"
        answer = self._start(recipe) if self.server is not None else {}
        leaders = {node: found for node, rank, found in backend.all_gather_object((self.node, local_rank, answer))
                   if rank == 0}
        failed = sorted(node for node, found in leaders.items() if "error" in found)
        if failed:
            self.end()  # this node's engine, if it did start
            found = leaders[failed[0]]
            log = self.log.with_name(f"vllm-node{failed[0]}.log")
            tail = f"; the end of its log ({log} on that node):\n{found['tail']}" if found.get("tail") else ""
            message = f"the vLLM engine of node {failed[0]} (generation.placement=node): {found['error']}{tail}"
            raise UserError(message) if found.get("code") == 2 else RunStopped(message)
        mine = leaders.get(self.node)
        if mine is None:
            raise RunStopped(f"node {self.node} has no rank with LOCAL_RANK 0 to start its vLLM engine "
                             "(generation.placement=node needs torchrun's LOCAL_RANK / GROUP_RANK)")
        super().__init__(recipe.generation, tokenizer, sends_weights=self.server is not None,
                         servers=[mine["url"]], token=mine["token"])
        self.sleep_mode = recipe.generation.vllm.enable_sleep_mode and torch.cuda.is_available()
        self._asleep = False
        if self.server is not None:
            ranks = backend.world_size // len(leaders)
            print(f"posttrain: node {self.node}: vLLM engine at {mine['url']} for its {ranks} rank(s) "
                  f"(generation.placement=node), log {self.log}", flush=True)

    def _start(self, recipe) -> dict:
        cfg = recipe.generation.vllm
        args = serve_args(recipe, cfg.tensor_parallel_size) + ["--seed", str(recipe.seed + self.backend.rank)]
        if cfg.enable_sleep_mode and torch.cuda.is_available():
            args.append("--enable-sleep-mode")
        token = secrets.token_hex(16)
        answer = self.server.launch("127.0.0.1", args, str(self.log), server_env(recipe, token))
        atexit.register(self.end)  # a run that stops on an error takes its engine with it
        return {**answer, "token": token}

    def name(self, url: str) -> str:
        return f"the vLLM engine of node {self.node} ({url}, log {self.log})"

    # --- GenerationEngine: sleep and wake on the node's engine --------------------------------------------------

    def generate(self, prompt_ids, params, images=None):
        self.wake()
        return super().generate(prompt_ids, params, images)

    def load_weights(self, buckets) -> None:
        self.wake()
        super().load_weights(buckets)

    def sleep(self) -> None:
        """Every rank calls it after generating (a collective): the first rank frees the engine's GPU memory once
        all of the node's ranks are done with it. A no-op without sleep mode (and on a CPU)."""
        if not self.sleep_mode or self._asleep:
            return
        self.backend.barrier()
        if self.server is not None:
            self._rpc(self.servers[0], "/sleep?level=1", {})
        self._asleep = True

    def wake(self) -> None:
        if not self._asleep:
            return
        if self.server is not None:
            self._rpc(self.servers[0], "/wake_up", {})
        self.backend.barrier()  # no rank sends a request to a sleeping engine
        self._asleep = False

    def end(self) -> None:
        """Stop this node's engine (the first rank; a no-op elsewhere and when stopped already)."""
        if self.server is not None:
            self.server.stop()
