"""The short version of bench/chaos.py that CI runs: kill -9 an SFT run twice (during a checkpoint write, then during
the export), resume it with `auto` each time, and end bitwise equal to the uninterrupted run with no checkpoint ever
left corrupt. The 20-kill figures come from the full script (see its docstring)."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kills_mid_save_and_mid_export_resume_bitwise_equal(tmp_path):
    result = load_chaos().main(["--kills", "2", "--steps", "4", "--kinds", "checkpoint,export", "--out", str(tmp_path)])
    assert result["failures"] == 0, result["problems"]
    assert result["kills"] == 2 and result["resumes"] == 2 and result["episodes"] == 1, result
    assert result["kinds"] == {"checkpoint": 1, "export": 1}, result["kinds"]
    assert result["max_abs_dw"] == 0.0


# --- user code that hangs or exits (issue #37) -------------------------------------------------------------------------

USER_CODE = '''
import os, subprocess, time


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: For example "2 + 3".
    """
    return "2"


def stray(expression: str) -> str:
    """Start a sleep in a session of its own, then hang.

    Args:
        expression: Ignored.
    """
    subprocess.Popen(["sleep", "303"], start_new_session=True)
    time.sleep(600)


def every_turn_calls(text):
    return [{"name": "calculator", "arguments": {"expression": "1 + 1"}}]


def every_turn_strays(text):
    return [{"name": "stray", "arguments": {"expression": "1"}}]


def hanging_parser(text):
    time.sleep(600)


def exiting_reward(prompts, completions, **columns):
    os._exit(0)


def length(prompts, completions, **columns):
    return [len(str(c)) / 40 for c in completions]


class Env:
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, message):
        return [{"role": "user", "content": "again"}], 0.5, False


class ExitingEnv(Env):
    def step(self, message):
        os._exit(0)


class HangingEnv(Env):
    def step(self, message):
        time.sleep(600)
'''

USER_CODE_CASES = {  # what the user code does: (overrides, exit code, what the message says)
    "a reward calls os._exit(0)": (["rewards=[{name: '{f}:exiting_reward'}]"], 1,
                                   "reward 'exiting_reward' called os._exit(0)"),
    "a tool hangs and leaves a process": (["agent.tools=['{f}:stray']", "agent.tool_parser={f}:every_turn_strays",
                                           "agent.tool_timeout=1"], 0, ""),
    "a parser hangs": (["agent.tools=['{f}:calculator']", "agent.tool_parser={f}:hanging_parser"], 1,
                       "agent.tool_parser '{f}:hanging_parser' on the model's turn"),
    "an environment calls os._exit(0)": (["agent.environment={f}:ExitingEnv"], 1,
                                         "agent.environment '{f}:ExitingEnv' (sample: dataset row"),
    "an environment hangs": (["agent.environment={f}:HangingEnv"], 1, "step did not return within 2s"),
}


@pytest.mark.parametrize("case", USER_CODE_CASES)
def test_user_code_that_hangs_or_exits_is_named_and_leaves_nothing_running(tiny_model_dir, tmp_path, capsys, case):
    from posttrain.demo.tasks import write_example_data
    from tests.integration.helpers import run_cli, run_overrides

    data = write_example_data(tmp_path / "data", n_train=4, n_eval=1)
    code = tmp_path / "chaos_code.py"
    code.write_text(USER_CODE)
    extra, exit_code, says = USER_CODE_CASES[case]
    extra = [e.replace("{f}", str(code)) for e in extra]
    if not any(e.startswith("rewards=") for e in extra):
        extra.append(f"rewards=[{{name: '{code}:length'}}]")
    started = time.monotonic()
    argv = run_overrides(tiny_model_dir, data["prompts_train"], tmp_path / "out", "train.max_steps=1",
                         "train.per_device_train_batch_size=2", "algo.num_generations=2", "agent.max_turns=2",
                         "agent.max_turn_tokens=4", "generation.max_completion_length=32", "data.max_length=512",
                         "agent.user_code_timeout=2", *extra)
    assert run_cli("grpo", *argv) == exit_code
    err = capsys.readouterr().err
    assert says.replace("{f}", str(code)) in err, err[-3000:]
    assert time.monotonic() - started < 120  # deadlines of 1-2 s, not the 600 s the user code asks for
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sleep 303" not in ps  # killed with the tool's process group / found by its marker
