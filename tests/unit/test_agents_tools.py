"""Tools (loading, schemas, running with a deadline and an output cap), tool-call parsers, and the start-up checks of
the `rollout:` section."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing

import pytest
from transformers import AutoTokenizer

from posttrain.agents import ToolRunner, check_agent, load_tools
from posttrain.agents.parsers import parse_hermes, parse_llama3, pick_parser
from posttrain.config.schema import Recipe, AgentConfig
from posttrain.config.validate import validate
from posttrain.errors import UserError

TOOLS = '''
import os, time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def fail(message: str) -> str:
    """Raise.

    Args:
        message: The error.
    """
    raise RuntimeError(message)


def huge(n: int) -> str:
    """A long string.

    Args:
        n: Its length.
    """
    return "x" * n


def crash(code: int) -> str:
    """Kill its own process.

    Args:
        code: Exit code.
    """
    os._exit(code)


def undocumented(a, b):
    return a
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "mytools.py"
    path.write_text(TOOLS)
    return path


def specs(path, *names):
    return tuple(f"{path}:{n}" for n in names)


def test_schema_from_hints_and_docstring(tool_file):
    tools = load_tools(specs(tool_file, "add"))
    fn = tools["add"].schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first."},
                                              "b": {"type": "integer", "description": "The second."}}
    assert fn["parameters"]["required"] == ["a", "b"]


@pytest.mark.parametrize("entry, message", [
    ("{file}:undocumented", "'{file}:undocumented': no usable signature"),
    ("{file}:missing", "{file} has no attribute 'missing'"),  # the file as given, not posttrain_user_<stem>
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("no_colon", "is not an import path"),
])
def test_bad_tools_name_the_entry(tool_file, entry, message):
    with pytest.raises(UserError, match="agent.tools entry") as e:
        load_tools((entry.format(file=tool_file),))
    assert message.format(file=tool_file) in str(e.value)


def test_hung_raising_huge_and_crashing_tools_come_back_as_messages(tool_file):
    tools = load_tools(specs(tool_file, "add", "hang", "fail", "huge", "crash"))
    runner = ToolRunner(tools, timeout=1.0, max_output_chars=500, workers=8)
    calls = [{"name": "hang", "arguments": {"seconds": 600}}, {"name": "fail", "arguments": {"message": "boom"}},
             {"name": "huge", "arguments": {"n": 1_000_000}}, {"name": "crash", "arguments": {"code": 3}},
             {"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "nope", "arguments": {}},
             {"name": "add", "arguments": "2, 3"}, {"name": "add", "arguments": {"a": 1}}]
    hung, failed, huge, crashed, added, unknown, not_object, missing = runner.run(calls)
    assert hung.timed_out and hung.error and "did not return within 1s" in hung.content
    assert failed.error and not failed.timed_out and failed.content == "Error: RuntimeError: boom"
    assert huge.content == "x" * 500 and not huge.error  # 1 MB cut to the cap in the child
    assert crashed.error and "exit code 3" in crashed.content
    assert (added.content, added.error) == ("5", False)
    assert unknown.error and "unknown tool 'nope'" in unknown.content
    assert not_object.error and "must be a JSON object" in not_object.content
    assert missing.error and "TypeError" in missing.content
    assert hung.seconds >= 1.0


def test_no_tool_process_outlives_its_deadline(tool_file):
    tools = load_tools(specs(tool_file, "hang"))
    [result] = ToolRunner(tools, timeout=0.5, max_output_chars=100, workers=1).run(
        [{"name": "hang", "arguments": {"seconds": 600}}])
    assert result.timed_out
    assert multiprocessing.active_children() == []


def test_hermes_parser():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "mul", "arguments": {"x": 3}}</tool_call><tool_call>{bad json}</tool_call>')
    calls, errors = parse_hermes(text)
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "mul", "arguments": {"x": 3}}]
    assert len(errors) == 1 and "{bad json}" in errors[0]
    assert parse_hermes("The answer is 3.") == ([], [])


def test_llama3_parser():
    assert parse_llama3('{"name": "add", "parameters": {"a": 1, "b": 2}}') == (
        [{"name": "add", "arguments": {"a": 1, "b": 2}}], [])
    assert parse_llama3('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}')[0] == [
        {"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]
    assert parse_llama3("The answer is 3.") == ([], [])
    calls, errors = parse_llama3('{"name": "add", "parameters": ')
    assert calls == [] and len(errors) == 1


def custom_parser(text):
    if "CALL" not in text:
        return []
    name, _, args = text.partition("CALL ")[2].partition(" ")
    if not args:
        raise ValueError("no arguments")
    return [{"name": name, "arguments": json.loads(args)}]


def test_parser_picked_from_table_template_or_hook():
    assert pick_parser("hermes", "") is parse_hermes and pick_parser("llama3", "") is parse_llama3
    assert pick_parser("auto", "... <tool_call> ...") is parse_hermes
    assert pick_parser("auto", "{{- '<|python_tag|>' }}") is parse_llama3
    custom = pick_parser("tests.unit.test_agents_tools:custom_parser", "")
    assert custom('CALL add {"a": 1}') == ([{"name": "add", "arguments": {"a": 1}}], [])
    assert custom("CALL add") == ([], ["could not read the tool call: no arguments"])
    with pytest.raises(UserError, match="shows no tool-call format"):
        pick_parser("auto", "{{ messages }}")
    with pytest.raises(UserError, match="agent.tool_parser is 'xml'"):
        pick_parser("xml", "")


def recipe(**rollout) -> Recipe:
    return Recipe(data=dataclasses.replace(Recipe().data, train="x.jsonl"), agent=AgentConfig(**rollout))


def test_max_turns_below_one_is_refused():
    with pytest.raises(UserError, match="agent.max_turns must be > 0, got 0"):
        validate(recipe(max_turns=0))


def test_startup_checks(tool_file, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_agent(recipe(tools=specs(tool_file, "add")), tok, "grpo")  # the tiny template shows tools
    check_agent(recipe(), tok, "sft")  # off: nothing to check
    with pytest.raises(UserError, match="multi-turn rollouts run under grpo, ppo, not dpo"):
        check_agent(recipe(tools=specs(tool_file, "add")), tok, "dpo")
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = tok.chat_template[tok.chat_template.index("{%- for message"):]  # ChatML without tools
    with pytest.raises(UserError, match="the chat template ignores tools"):
        check_agent(recipe(tools=specs(tool_file, "add"), tool_parser="hermes"), plain, "grpo")
    with pytest.raises(UserError, match="agent.environment 'tests.unit.test_agents_tools:custom_parser' is a "
                                        "function"):
        check_agent(recipe(environment="tests.unit.test_agents_tools:custom_parser"), tok, "grpo")
    with pytest.raises(UserError, match="has no method step"):
        check_agent(recipe(environment="tests.unit.test_agents_tools:NoStep"), tok, "grpo")


class NoStep:
    def reset(self, row):
        return []


def test_tiny_template_renders_plain_conversations_as_before(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_the_shipped_tools_template_is_the_demos():
    from pathlib import Path

    from posttrain.demo.tools import TEMPLATE, calculator, parse_call

    root = Path(__file__).resolve().parents[2]
    assert (root / "examples" / "agents" / "tools_chatml.jinja").read_text() == TEMPLATE
    assert calculator("123 + 456") == "579" and calculator(" 7 * -2 ") == "-14"
    with pytest.raises(ValueError, match="cannot evaluate"):
        calculator("__import__('os')")
    assert parse_call("calc 12 + 3") == [{"name": "calculator", "arguments": {"expression": "12 + 3"}}]
    assert parse_call("15") == []


def test_the_demos_problems_keep_every_copy_at_a_fixed_width():
    from posttrain.demo.tools import HIGH, LOW, problems, traces

    pairs = problems(0)
    assert len(set(pairs)) == len(pairs) == (HIGH - LOW + 1) ** 2 and {len(str(a * b)) for a, b in pairs} == {4}
    tool_rows, plain_rows = traces(pairs[:200], 0.3, 0)
    slips = 0
    for (a, b), tool, plain in zip(pairs, tool_rows, plain_rows):
        _, user, call, result, answer = [m["content"] for m in tool["messages"]]
        shown = int(call.rsplit(" ", 1)[1])
        assert user == f"What is {a} * {b}?" and call == f"calc {a} * {shown}" and shown // 10 == b // 10
        assert result == answer == plain["completion"][0]["content"] == str(a * shown)  # a slip carries through
        slips += shown != b
    assert 40 <= slips <= 80  # 30% of 200


def test_the_old_rollout_section_is_read_as_agent_and_said_once(capsys):
    """`rollout:` was the agent loop's section before "rollout" came to mean the online batch only: a recipe or an
    override written that way still runs, with one note; both names at once with different values is refused."""
    from posttrain.algorithms.grpo import GRPOAlgoConfig
    from posttrain.cli import command_line_overrides
    from posttrain.config.load import load_recipe

    base = ["data.train=x.jsonl", "rewards=[{name: exact_match}]"]
    got = load_recipe(None, [*base, "rollout.max_turns=3", "rollout.tool_timeout=2.5"], GRPOAlgoConfig)
    assert (got.agent.max_turns, got.agent.tool_timeout) == (3, 2.5)
    assert capsys.readouterr().err.count("the rollout: section is now agent:") == 1
    assert command_line_overrides(["rollout.max_turns=3"], {}, GRPOAlgoConfig) == ["rollout.max_turns=3"]
    with pytest.raises(UserError, match="both rollout: and agent:"):
        load_recipe(None, [*base, "rollout.max_turns=3", "agent.max_turns=2"], GRPOAlgoConfig)
