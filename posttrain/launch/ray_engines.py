"""Generation engines as Ray actors under `launcher: ray` (`placement.generation.num_engines > 0`, docs/ray.md).

    engines = start_engines(ray, plan, recipe, env)     # one `posttrain serve` per engine, on the node the fit chose
    ranks run with Launched(servers=engines.urls)       # posttrain.run: the server engine over their URLs
              and engines.env                           # the servers' token
    engines.stop()                                      # every server, its vLLM processes and the actors

Each engine is an `EngineWorker` actor pinned to its planned node with tensor_parallel_size GPUs, running `posttrain
serve` as a child process, so the ranks use the server engine unchanged (weight syncs, versions, retries; the banner
maps each URL to its engine and node). A server does not outlive its actor: serve gets SIGTERM when the actor's
process ends, vLLM when serve's does. Nothing here imports ray at import time: the launcher passes the module in.
"""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.config.schema import Recipe
from posttrain.launch.ray_actors import kill_all, last_line
from posttrain.launch.ray_placement import Node, Plan, node_options
from posttrain.errors import RunStopped, UserError
from posttrain.generation.server_process import LOG_DIR, READY_TIMEOUT_S, ServerProcess, serve_args, server_env
from posttrain.generation.server_worker import TOKEN_ENV

SCHEDULE_TIMEOUT_S = 300.0  # Ray places the actor: longer means its resources are held by another job
STOP_TIMEOUT_S = 30.0  # `posttrain serve` gives vLLM 10 s after SIGTERM, the actor gives serve as long again


def check_engines(recipe: Recipe) -> None:
    """What contradicts engines as actors, said before anything starts: an in-process tensor-parallel size other than
    the engines'."""
    placed, vllm = recipe.placement.generation, recipe.generation.vllm
    if placed.num_engines and vllm.tensor_parallel_size not in (1, placed.tensor_parallel_size):
        raise UserError(f"generation.vllm.tensor_parallel_size={vllm.tensor_parallel_size} sizes in-process engines; "
                        f"engines as actors (placement.generation.num_engines) span "
                        f"placement.generation.tensor_parallel_size={placed.tensor_parallel_size} GPUs: set that one")


class EngineWorker(ServerProcess):
    """One generation engine: a `posttrain serve` process on this actor's node (tasks run on the actor's main thread,
    the one whose end the server's death signal watches)."""

    def start(self, args: list[str], log: str, env: dict[str, str]) -> dict:
        """Start the server on this node's address (ServerProcess.launch) and wait until it answers."""
        import ray

        return self.launch(ray.util.get_node_ip_address(), args, log, env)


@dataclass
class Engines:
    """The engines of a run: their actors, server URLs, nodes and logs, and the token the servers take."""

    actors: list = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    token: str = ""
    ray: Any = None

    @property
    def env(self) -> dict[str, str]:
        """What the training ranks need to talk to the servers."""
        return {TOKEN_ENV: self.token} if self.actors else {}

    def banner(self) -> str:
        """The start-up lines: which URL is which engine on which node, and where its log is."""
        lines = [f"posttrain ray generation: {len(self.urls)} engine(s) started with `posttrain serve`; the ranks "
                 "generate on them (generation.placement=ray)"]
        lines += [f"engine {i}  {node.label}  {url}  log: {log}"
                  for i, (node, url, log) in enumerate(zip(self.nodes, self.urls, self.logs))]
        return "\n".join(lines)

    def stop(self, report: bool = True) -> None:
        """Stop every server (in parallel), then the actors. `report`: name each engine that had ended before, with
        its node and log (the ranks only saw its URL stop answering)."""
        if not self.actors:
            return
        from ray.exceptions import RayActorError

        refs = [actor.stop.remote() for actor in self.actors]
        for i, ref in enumerate(refs):
            try:
                ended = self.ray.get(ref, timeout=STOP_TIMEOUT_S)
            except RayActorError as e:
                ended = f"its actor died: {last_line(str(e))}"
            except Exception as e:  # best effort: the actor is killed next, and its server with it
                ended = f"stopping it failed: {e}"
            if ended and report:
                print(f"posttrain: generation engine {i} on node {self.nodes[i].label} ({self.urls[i]}) had stopped "
                      f"before the run ended: {ended}; log: {self.logs[i]}", file=sys.stderr, flush=True)
        kill_all(self.ray, self.actors)
        self.actors = []


def start_engines(ray, plan: Plan, recipe: Recipe, env: dict[str, str]) -> Engines:
    """Start every planned engine at once, wait until each server answers and print the banner. `env`: the driver's
    variables the workers get. On a failure the others are stopped and RunStopped names the engine, node and log."""
    if not plan.engines:
        return Engines()
    logs = [Path(recipe.output_dir).resolve() / LOG_DIR / f"engine-{i}.log" for i in range(len(plan.engines))]
    worker = ray.remote(EngineWorker)
    actors = [worker.options(**node_options(node, plan, plan.engine_gpus)).remote() for node in plan.engines]
    engines = Engines(actors, [""] * len(actors), list(plan.engines), logs, secrets.token_hex(16), ray)
    args = serve_args(recipe, recipe.placement.generation.tensor_parallel_size)
    env = {**env, **server_env(recipe, engines.token)}
    refs = {actor.start.remote(args, str(log), env): i for i, (actor, log) in enumerate(zip(actors, logs))}
    try:
        wait_ready(ray, refs, engines)
    except BaseException:
        engines.stop(report=False)  # the error names the engine that failed
        raise
    print(engines.banner(), flush=True)
    return engines


def wait_ready(ray, refs: dict, engines: Engines) -> None:
    """Fill engines.urls as the servers answer; RunStopped at the first that fails or is late."""
    from ray.exceptions import RayActorError

    pending = list(refs)
    deadline = time.monotonic() + SCHEDULE_TIMEOUT_S + READY_TIMEOUT_S
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            late = refs[pending[0]]
            raise RunStopped(f"generation engine {late} on node {engines.nodes[late].label}: not started within "
                             f"{SCHEDULE_TIMEOUT_S + READY_TIMEOUT_S:.0f} s (its resources held by another job? see "
                             f"`ray status`); log: {engines.logs[late]}", shared=False)
        i = refs[done[0]]
        try:
            answer = ray.get(done[0])
        except RayActorError as e:
            answer = {"error": f"its actor died: {last_line(str(e))}"}
        if "error" in answer:
            tail = f"; the end of its log:\n{answer['tail']}" if answer.get("tail") else ""
            message = (f"generation engine {i} on node {engines.nodes[i].label}: {answer['error']}; log: "
                       f"{engines.logs[i]}{tail}")
            if answer.get("code") == 2:  # posttrain serve refused its input (the model, a vLLM option)
                raise UserError(message)
            raise RunStopped(message, shared=False)
        engines.urls[i] = answer["url"]
