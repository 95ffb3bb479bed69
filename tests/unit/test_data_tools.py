"""Tool-calling data in TRL's format: the `tools` column is rendered by the chat template for SFT, DPO and prompts,
assistant tool calls train and tool messages do not (as TRL's assistant masks have it), prompts cut with their tools
turn are counted, and templates that would drop tools or tool calls are refused with the row named."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from posttrain.config import DataConfig
from posttrain.data import load_rows, tokenize_preference, tokenize_prompts, tokenize_sft
from posttrain.errors import UserError
from tests.unit.test_data_tokenizers import rows


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "22C"},
        {"role": "assistant", "content": "It is 22C."}]
# plain ChatML without tools or tool calls (SmolLM2-Instruct's kind): `content` of a tool-calling turn renders as ""
PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def plain(tok):
    other = copy.deepcopy(tok)
    other.chat_template = PLAIN_CHATML
    return other


def decoded_runs(tok, ids, mask) -> list[str]:
    runs, current = [], []
    for token, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [tok.decode(current)], []
    return runs


@pytest.mark.parametrize("tools", [[WEATHER], json.dumps([WEATHER])], ids=["schemas", "json"])
def test_the_tools_column_is_rendered_in_sft_rows(tok, tools):
    (example,), _ = tokenize_sft(rows({"messages": CHAT, "tools": tools}), tok, DataConfig(max_length=1024))
    expected = tok.apply_chat_template(CHAT, tools=[WEATHER], tokenize=False)
    assert tok.decode(example["input_ids"]) == expected and "<tools>" in expected and "Current weather" in expected
    (without,), _ = tokenize_sft(rows({"messages": CHAT}), tok, DataConfig(max_length=1024))
    assert len(example["input_ids"]) > len(without["input_ids"]) + 20


def test_assistant_only_loss_trains_tool_calls_not_tool_output_as_trl_masks_them(tok):
    """The mask equals TRL's assistant mask ({% generation %} in the tiny template) token for token."""
    (example,), _ = tokenize_sft(rows({"messages": CHAT, "tools": [WEATHER]}), tok,
                                 DataConfig(max_length=1024, assistant_only_loss=True))
    trl = tok.apply_chat_template(CHAT, tools=[WEATHER], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert example["input_ids"] == trl["input_ids"]
    assert example["completion_mask"] == trl["assistant_masks"]
    assert decoded_runs(tok, example["input_ids"], example["completion_mask"]) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 22C.<|im_end|>"]


def test_arrow_merged_keys_do_not_reach_the_template(tok, tmp_path):
    """Rows whose tools and call arguments differ in shape: Arrow gives each row the other's keys as null."""
    other_tool = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    other_call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    second = [CHAT[0], {"role": "assistant", "tool_calls": [other_call]}, {"role": "tool", "content": "3"},
              {"role": "assistant", "content": "3"}]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": CHAT, "tools": [WEATHER]}) + "\n"
                    + json.dumps({"messages": second, "tools": [other_tool]}) + "\n")
    examples, _ = tokenize_sft(load_rows(str(path)), tok, DataConfig(max_length=1024))
    texts = [tok.decode(e["input_ids"]) for e in examples]
    assert "null" not in texts[0] + texts[1]
    assert texts[1] == tok.apply_chat_template(second, tools=[other_tool], tokenize=False)


def test_a_template_that_drops_tool_calls_is_refused_naming_the_row(tok):
    data = rows({"messages": [CHAT[0], {"role": "assistant", "content": "Sunny."}], "tools": None},
                {"messages": CHAT, "tools": None})
    with pytest.raises(UserError, match=r"data.train row 1: message 1 calls get_weather but the chat template drops"):
        tokenize_sft(data, plain(tok), DataConfig(max_length=1024))


def test_a_template_that_ignores_the_tools_column_is_refused(tok):
    with pytest.raises(UserError, match="row 0: the row has a 'tools' column but the chat template ignores tools"):
        tokenize_sft(rows({"messages": CHAT[:1] + CHAT[3:], "tools": [WEATHER]}), plain(tok), DataConfig())


def test_a_bad_tools_value_is_refused_naming_row_and_item(tok):
    with pytest.raises(UserError, match=r"row 0: column 'tools' item 0: a tool schema is an object with a name"):
        tokenize_sft(rows({"messages": CHAT, "tools": json.dumps([{"description": "x"}])}), tok, DataConfig())
    with pytest.raises(UserError, match="column 'tools' is a string but not JSON"):
        tokenize_sft(rows({"messages": CHAT, "tools": "[{"}), tok, DataConfig())


def test_preference_rows_render_their_tools_in_the_prompt(tok):
    data = rows({"prompt": CHAT[:1], "chosen": CHAT[1:2], "rejected": [{"role": "assistant", "content": "No idea."}],
                 "tools": [WEATHER]})
    (example,), _ = tokenize_preference(data, tok, DataConfig(max_length=1024))
    assert tok.decode(example["prompt_ids"]) == tok.apply_chat_template(CHAT[:1], tools=[WEATHER], tokenize=False,
                                                                        add_generation_prompt=True)
    assert tok.decode(example["chosen_ids"]).startswith("<tool_call>\n{\"name\": \"get_weather\"")
    with pytest.raises(UserError, match="row 0: message 1 calls get_weather"):
        tokenize_preference(data.remove_columns("tools"), plain(tok), DataConfig(max_length=1024))


def test_prompts_show_row_and_rollout_tools_and_cuts_are_counted(tok):
    data = rows({"prompt": CHAT[:1], "tools": [WEATHER]}, {"prompt": CHAT[:1], "tools": None})
    calc = {"type": "function", "function": {"name": "calculator", "description": "Calculate.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}
    examples, stats = tokenize_prompts(data, tok, DataConfig(max_length=1024), rollout_tools=[calc])
    assert [[tool_name["function"]["name"] for tool_name in e["tools"]] for e in examples] == [
        ["get_weather", "calculator"], ["calculator"]]
    full = [tok(tok.apply_chat_template(CHAT[:1], tools=e["tools"], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"] for e in examples]
    assert [e["prompt_ids"] for e in examples] == full and stats["truncated"] == 0
    assert examples[0]["messages"] == CHAT[:1]
    # the tools turn counts toward the limit (data.max_length when no max_prompt_length, as the rollout uses)
    limit = len(full[1]) + 1
    examples, stats = tokenize_prompts(data, tok, DataConfig(max_length=limit), rollout_tools=[calc])
    assert stats["truncated"] == 1 and examples[0]["prompt_ids"] == full[0][-limit:]
    # a string prompt opens a chat as one user message for a rollout; single-turn it stays text
    (opened,), _ = tokenize_prompts(rows({"prompt": "Weather in Paris?"}), tok, DataConfig(), rollout_tools=[])
    assert opened["messages"] == [{"role": "user", "content": "Weather in Paris?"}] and opened["prompt_ids"] == \
        tok(tok.apply_chat_template(opened["messages"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False)["input_ids"]
    (single,), _ = tokenize_prompts(rows({"prompt": "Weather in Paris?"}), tok, DataConfig())
    assert "messages" not in single and tok.decode(single["prompt_ids"], skip_special_tokens=True) == "Weather in Paris?"
