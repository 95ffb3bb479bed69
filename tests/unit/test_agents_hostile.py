"""Hostile model output and user code in multi-turn rollouts (issue #37): whatever the model writes comes back to it as
an error; whatever the user's parser, environment or tool does (raise, exit, hang, start processes) ends as one
message naming it and the sample, within a deadline, with no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from posttrain.agents import AgentLoop, ToolRunner, load_tools
from posttrain.agents.environment import EnvironmentSession
from posttrain.agents.parsers import parse_hermes, parse_llama3, pick_parser
from posttrain.agents.tools import OWNER_VARIABLE
from posttrain.errors import UserError
from posttrain.generation.base import SamplingParams
from posttrain.usercode import UserCodeError
from tests.unit.test_agents_loop import ScriptedEngine

HERE = "tests.unit.test_agents_hostile"

TOOLS = '''
import os, signal, subprocess


def spawn(new_session: bool) -> str:
    """Start a long sleep and return at once (the sleep would outlive the run).

    Args:
        new_session: Start it in a session of its own, out of the tool's process group.
    """
    subprocess.Popen(["sleep", "301"], start_new_session=new_session)
    return "started"


def blocking() -> str:
    """Run a sleep to its end (the tool times out first)."""
    subprocess.run(["sleep", "302"])
    return "done"


def term_handler() -> str:
    """Whether SIGTERM has its default action here."""
    return str(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
'''


@pytest.fixture
def tools(tmp_path):
    path = tmp_path / "hostile_tools.py"
    path.write_text(TOOLS)
    return load_tools(tuple(f"{path}:{n}" for n in ("spawn", "blocking", "term_handler")))


def marked_processes() -> list[int]:
    """Processes carrying this test process's tool marker (what kill_strays looks for)."""
    mark = f"{OWNER_VARIABLE}={os.getpid()}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("name", [["probe"], {"a": 1}, 7, None])
def test_a_name_that_is_not_a_string_goes_back_to_the_model(name):
    import json

    body = json.dumps({"name": name, "arguments": {}})
    for parse, text in ((parse_hermes, f"<tool_call>{body}</tool_call>"),
                        (parse_llama3, body.replace('"arguments"', '"parameters"'))):
        calls, errors = parse(text)
        assert calls == [] and len(errors) == 1 and "name must be a string" in errors[0], (parse, errors)
    calls, errors = pick_parser(f"{HERE}:parser_from_json", "")(body)
    assert calls == [] and "name must be a string" in errors[0]
    [result] = ToolRunner({}, 1.0, 100, 1).run([{"name": name, "arguments": {}}])  # a parser that lets it through
    assert result.error and "name must be a string" in result.content


def parser_from_json(text):
    import json

    return [json.loads(text)]


def parser_raises(text):
    return {}["missing"]


def parser_returns_text(text):
    return "add(1, 2)"


def parser_hangs(text):
    time.sleep(30)


def parser_exits(text):
    os._exit(0)


def parser_sys_exits(text):
    sys.exit(3)


@pytest.mark.parametrize("parser, did", [
    ("parser_raises", "raised KeyError: 'missing'"),
    ("parser_returns_text", "returned str; it must return a list"),
    ("parser_hangs", "did not return within 0.5s"),
    ("parser_exits", "called os._exit(0)"),
    ("parser_sys_exits", "called sys.exit(3)"),
])
def test_a_custom_parser_that_fails_stops_the_run_naming_it_and_the_turn(parser, did):
    parse = pick_parser(f"{HERE}:{parser}", "", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(UserCodeError) as e:
        parse("the model's turn")
    assert f"agent.tool_parser '{HERE}:{parser}' on the model's turn \"the model's turn\"" in str(e.value)
    assert did in str(e.value) and e.value.exit_code == 1
    assert time.monotonic() - started < 5


class RaisesInInit:
    def __init__(self):
        raise RuntimeError("no licence")

    def reset(self, row):
        return []

    def step(self, message):
        return [], 0.0, True


class Hostile:
    """reset / step do what the row's 'do' column says."""

    def reset(self, row):
        self.do = row["do"]
        if self.do == "reset raises":
            raise KeyError("target")
        return [{"role": "user", "content": "go"}]

    def step(self, message):
        if self.do == "step hangs":
            time.sleep(30)
        if self.do == "step exits":
            os._exit(0)
        if self.do == "step sys.exit":
            sys.exit(0)
        return [], {"nan reward": float("nan"), "inf reward": float("inf")}.get(self.do, 1.0), True


@pytest.mark.parametrize("cls, do, did", [
    (RaisesInInit, "", "RaisesInInit() raised RuntimeError: no licence"),
    (Hostile, "reset raises", ".reset raised KeyError: 'target'"),
    (Hostile, "step hangs", ".step did not return within 0.5s"),
    (Hostile, "step exits", ".step called os._exit(0)"),
    (Hostile, "step sys.exit", ".step called sys.exit(0)"),
    (Hostile, "nan reward", ".step returned reward nan; it must be a finite float"),
    (Hostile, "inf reward", ".step returned reward inf; it must be a finite float"),
])
def test_an_environment_that_fails_stops_the_run_naming_it_and_the_sample(cls, do, did):
    started = time.monotonic()
    with pytest.raises(UserCodeError) as e:
        session = EnvironmentSession(cls, "my:Env", 12, timeout=0.5)
        session.reset({"prompt": "p", "do": do})
        session.step({"role": "assistant", "content": "x"})
    assert str(e.value).startswith("agent.environment 'my:Env' (sample: dataset row 12)"), str(e.value)
    assert did in str(e.value) and e.value.exit_code == 1
    assert time.monotonic() - started < 5


def test_no_process_a_tool_starts_outlives_the_call(tools):
    runner = ToolRunner(tools, timeout=1.0, max_output_chars=100, workers=4)
    results = runner.run([{"name": "spawn", "arguments": {"new_session": False}},
                          {"name": "spawn", "arguments": {"new_session": True}},
                          {"name": "blocking", "arguments": {}}])
    assert [r.content for r in results[:2]] == ["started", "started"] and results[2].timed_out
    deadline = time.monotonic() + 5
    while marked_processes() and time.monotonic() < deadline:  # SIGKILL is delivered, the reaping may lag
        time.sleep(0.05)
    assert marked_processes() == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sleep 301" not in ps and "sleep 302" not in ps


def test_a_tool_gets_the_default_sigterm_handler_not_the_runs(tools):
    previous = signal.signal(signal.SIGTERM, lambda *a: None)  # what the run's Guard installs
    try:
        [result] = ToolRunner(tools, 5.0, 100, 1).run([{"name": "term_handler", "arguments": {}}])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.content == "True"


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0.0])
def test_a_tool_timeout_that_is_not_a_finite_positive_number_is_refused(timeout):
    with pytest.raises(UserError, match="agent.tool_timeout must be a finite number of seconds > 0"):
        ToolRunner({}, timeout, 100, 1)


class ToolTurn:
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, message):
        return [{"role": "tool", "content": "result"}], 0.0, False


def test_a_template_that_raises_on_a_role_mid_run_names_the_roles(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
                         "{% endif %}{{ m.role }}: {{ m.content }}" + tok.eos_token + "{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    agent = AgentLoop(tok, ScriptedEngine([[[40, tok.eos_token_id]]] * 3), budget=50, max_turns=3, environment=ToolTurn,
                         environment_name="my:ToolTurn")
    with pytest.raises(UserCodeError, match="cannot render a conversation with the roles user, assistant, tool "
                                            r"\(TemplateError: no tool role\); set model.chat_template"):
        agent.run([{"prompt": "a", "columns": {}}], [0], SamplingParams())


def test_sigterm_ends_a_wait_on_user_code_that_hangs_at_once():
    """SIGTERM during an environment step that never returns: the run stops in a second with 143, not at the
    deadline (nor, as before, only at SIGKILL)."""
    import threading

    from posttrain.errors import RunStopped
    from posttrain.train.guard import Guard

    class T:
        nonfinite, max_nonfinite_skips = "stop", 0

    class B:
        can_skip_steps = False

    session = EnvironmentSession(Hostile, "my:Env", 3, timeout=60)
    session.reset({"prompt": "p", "do": "step hangs"})
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    with pytest.raises(RunStopped) as e:
        with Guard(T, B):
            session.step({"role": "assistant", "content": "x"})
    assert time.monotonic() - started < 5 and e.value.exit_code == 143
    assert "SIGTERM while agent.environment 'my:Env' (sample: dataset row 3).step was running" in str(e.value)
