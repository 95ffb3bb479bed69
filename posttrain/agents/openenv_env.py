"""OpenEnv environments through posttrain's agent loop: `agent.environment: openenv:<where>`.

    agent:
      environment: openenv:my_envs.server:app?action_field=message     # a local server, started by the run
      environment: openenv:http://127.0.0.1:8001                      # or one you serve
      max_turns: 4

A local server is an ASGI app (what openenv's `create_app(Env, Action, Observation)` returns) named `module:app`;
the run starts it with uvicorn on 127.0.0.1, on a free port, waits for its /health (agent.user_code_timeout), and
stops it when the run's process ends. A `docker:<image>` is refused: start the container yourself and give its URL.

Each trajectory opens one session (openenv's WebSocket client, `GenericEnvClient`: no environment package needed on
this side) with connect and message deadlines of agent.user_code_timeout, on top of the deadline posttrain puts on
every reset and step (agents/environment.py). reset: the row's prompt, then the reset observation's text as a user
turn; step: the model's text goes in the action's `action_field` (default `message`), and the observation's text
comes back as a user turn with its reward and done. An observation's text is its `observation_field` if given, else
its only field besides done / reward / metadata, else those fields as JSON. The session closes when the episode is
done. The server must take one session per trajectory at once (SUPPORTS_CONCURRENT_SESSIONS and create_app's
max_concurrent_envs at least the batch's number of trajectories). Needs the `envs` extra.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from posttrain.errors import UserError, require_package

PREFIX = "openenv:"
SKIPPED = ("done", "reward", "metadata")


def is_openenv_spec(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(PREFIX)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`module:app` served by uvicorn on 127.0.0.1 in a child process, up once /health answers."""

    def __init__(self, app: str, timeout: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="posttrain-openenv-", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port",
                                         str(self.port), "--log-level", "warning"], stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        tail = open(self.log.name, encoding="utf-8", errors="replace").read()[-1500:]
        exited = " (it exited)" if self.process.poll() is not None else ""
        raise UserError(f"agent.environment openenv:{app}: the server did not answer {self.url}/health within "
                        f"{timeout:g}s (agent.user_code_timeout){exited}; its output:\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


_SERVERS: dict[str, LocalServer] = {}


def docker_engine() -> bool:
    """A docker client and an engine it can reach (its socket, or DOCKER_HOST)."""
    return shutil.which("docker") is not None and (os.path.exists("/var/run/docker.sock")
                                                   or bool(os.environ.get("DOCKER_HOST")))


def parse_openenv(spec: str) -> tuple[str, dict]:
    """'openenv:<where>?options' -> (where, options); UserError for a container or a bad option."""
    where, _, query = spec[len(PREFIX):].partition("?")
    options = dict(urllib.parse.parse_qsl(query))
    unknown = sorted(set(options) - {"action_field", "observation_field"})
    if unknown:
        raise UserError(f"agent.environment {spec!r}: unknown option {unknown[0]!r}; it takes action_field and "
                        "observation_field")
    if where.startswith("docker:"):
        engine = "posttrain does not start containers" if docker_engine() else "no Docker engine runs here"
        raise UserError(f"agent.environment {spec!r}: {engine}; start the environment's container yourself "
                        f"(docker run -p 8000:8000 {where[len('docker:'):]}) and give its URL "
                        "(openenv:http://127.0.0.1:8000), or serve its Python app (openenv:module:app)")
    if not where.startswith(("http://", "https://", "ws://", "wss://")) and ":" not in where:
        raise UserError(f"agent.environment {spec!r}: give a server URL (openenv:http://host:port) or a Python app "
                        "as openenv:module:app")
    return where, options


def server_url(where: str, timeout: float) -> str:
    """The URL to connect to: `where` itself, or the local server started for it (once per process)."""
    if where.startswith(("http://", "https://", "ws://", "wss://")):
        return where
    if where not in _SERVERS:
        _SERVERS[where] = LocalServer(where, timeout)
    return _SERVERS[where].url


def observation_text(observation: dict, field: str | None) -> str:
    if field:
        return str(observation.get(field, ""))
    kept = {k: v for k, v in observation.items() if k not in SKIPPED}
    if len(kept) == 1:
        return str(next(iter(kept.values())))
    return json.dumps(kept, default=str) if kept else ""


def openenv_environment(spec: str, timeout: float) -> type:
    """An Environment class (agents/environment.py) over the OpenEnv server `spec` names (started now if local)."""
    require_package("openenv.core", f"agent.environment {spec!r}", "openenv-core")
    where, options = parse_openenv(spec)
    url = server_url(where, timeout)
    action_field = options.get("action_field", "message")
    observation_field = options.get("observation_field")

    class OpenEnvEnvironment:
        def __init__(self):
            from openenv.core.generic_client import GenericEnvClient

            self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout).sync()

        def reset(self, row: dict) -> list[dict]:
            result = self.client.reset()
            prompt = row["prompt"]
            opening = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            text = observation_text(_as_dict(result.observation), observation_field)
            return opening + ([{"role": "user", "content": text}] if text else [])

        def step(self, assistant_message: dict) -> tuple[list[dict], float, bool]:
            result = self.client.step({action_field: assistant_message["content"]})
            done = bool(result.done)
            if done:
                self.client.close()
            text = observation_text(_as_dict(result.observation), observation_field)
            return [{"role": "user", "content": text}], float(result.reward or 0.0), done

    OpenEnvEnvironment.__name__ = f"OpenEnvEnvironment[{where}]"
    return OpenEnvEnvironment


def _as_dict(observation) -> dict:
    return observation.model_dump() if hasattr(observation, "model_dump") else dict(observation or {})
