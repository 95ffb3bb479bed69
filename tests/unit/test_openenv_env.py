"""OpenEnv through the agent loop (posttrain/agents/openenv_env.py): what the spec accepts and refuses, how an
observation becomes a turn, a local server that cannot start named with its output."""

from __future__ import annotations

import sys

import pytest

from posttrain.agents.openenv_env import docker_engine, observation_text, openenv_environment, parse_openenv
from posttrain.errors import UserError

pytest.importorskip("openenv.core")


def test_the_spec_reads_where_and_options():
    assert parse_openenv("openenv:http://127.0.0.1:8001?action_field=code") == ("http://127.0.0.1:8001",
                                                                                 {"action_field": "code"})
    assert parse_openenv("openenv:my_envs.server:app") == ("my_envs.server:app", {})


@pytest.mark.parametrize("spec, message", [
    ("openenv:docker:echo-env:latest", "start the environment's container yourself .*docker run -p 8000:8000 "
                                       "echo-env:latest.*openenv:http://127.0.0.1:8000"),
    ("openenv:http://127.0.0.1:1?action=x", "unknown option 'action'; it takes action_field and observation_field"),
    ("openenv:server", "give a server URL .* or a Python app as openenv:module:app"),
])
def test_a_bad_spec_is_refused_before_anything_starts(spec, message):
    with pytest.raises(UserError, match=message):
        parse_openenv(spec)


@pytest.mark.skipif(docker_engine(), reason="a Docker engine runs here")
def test_docker_is_refused_where_there_is_no_engine():
    with pytest.raises(UserError, match="no Docker engine runs here"):
        parse_openenv("openenv:docker:echo-env")


def test_an_observation_becomes_a_turns_text():
    assert observation_text({"text": "hi", "done": False, "reward": 1.0, "metadata": {}}, None) == "hi"
    assert observation_text({"a": 1, "b": "x", "done": True}, None) == '{"a": 1, "b": "x"}'
    assert observation_text({"a": 1, "b": "x"}, "b") == "x"
    assert observation_text({"done": True, "reward": None}, None) == ""


def test_a_local_server_that_does_not_start_is_named_with_its_output():
    with pytest.raises(UserError, match=r"(?s)openenv:no_such_module_here:app: the server did not answer .*/health "
                                        r"within 30s .*\(it exited\).*Could not import module \"no_such_module_here\""):
        openenv_environment("openenv:no_such_module_here:app", 30)


def test_a_missing_openenv_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(UserError, match=r"needs the 'openenv-core' package.*pip install 'posttrain\[envs\]'"):
        openenv_environment("openenv:http://127.0.0.1:1", 5)
