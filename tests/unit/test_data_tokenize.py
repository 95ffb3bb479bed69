"""Tokenisation: loss masks cover exactly the trained text (checked by decoding), for a ChatML and a Llama-3 template;
truncation and dropped rows are counted; nothing trainable left is a UserError."""

from __future__ import annotations

import copy

import pytest

from posttrain.config import DataConfig
from posttrain.data import tokenize_preference, tokenize_prompts, tokenize_sft
from posttrain.errors import UserError
from tests.unit.test_data_tokenizers import CONVERSATION, chatml_tokenizer, llama3_tokenizer, rows

TEMPLATES = {"chatml": (chatml_tokenizer, "<|im_end|>"), "llama3": (llama3_tokenizer, "<|eot_id|>")}


@pytest.fixture(params=sorted(TEMPLATES))
def tok_end(request):
    """(tokenizer, its end-of-turn token) for each chat template."""
    make, end = TEMPLATES[request.param]
    return make(), end


def trained_text(tok, example) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    runs, current = [], []
    for token, masked in zip(example["input_ids"], example["completion_mask"]):
        if masked:
            current.append(token)
        elif current:
            runs, current = runs + [tok.decode(current)], []
    return runs + ([tok.decode(current)] if current else [])


# --- SFT: standard rows -----------------------------------------------------------------------------------------------


def test_text_rows_train_every_token_after_the_first_and_end_with_eos():
    tok = llama3_tokenizer()
    (example,), stats = tokenize_sft(rows({"text": "Hello there"}), tok, DataConfig())
    ids = example["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert example["completion_mask"] == [0] + [1] * (len(ids) - 1)
    assert stats == dict(rows=1, examples=1, tokens=len(ids), completion_tokens=len(ids) - 1,
                         truncated=0, dropped_no_completion=0, dropped_empty=0)


@pytest.mark.parametrize("completion_only", [True, False])
def test_prompt_completion_masks_the_prompt_when_asked(tok_end, completion_only):
    tok, end = tok_end
    data = rows({"prompt": "What is 2 + 2?", "completion": " 4"})
    (example,), _ = tokenize_sft(data, tok, DataConfig(completion_only_loss=completion_only))
    assert tok.decode(example["input_ids"]).endswith("What is 2 + 2? 4" + end)
    if completion_only:
        assert trained_text(tok, example) == [" 4" + end]
    else:
        assert example["completion_mask"] == [0] + [1] * (len(example["input_ids"]) - 1)


# --- SFT: conversations -----------------------------------------------------------------------------------------------


def test_multi_turn_mask_covers_exactly_the_assistant_turns_and_their_end_token(tok_end):
    tok, end = tok_end
    (example,), stats = tokenize_sft(rows({"messages": CONVERSATION}), tok, DataConfig())
    assert tok.decode(example["input_ids"]) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert trained_text(tok, example) == ["Hi! How are you?" + end, "The answer is 4." + end]
    assert stats["completion_tokens"] == sum(example["completion_mask"])


def test_mask_equals_the_generation_markers_of_the_tiny_model_template():
    """An independent check: the tiny model's ChatML template wraps each assistant turn's content + <|im_end|> in
    {% generation %}, and transformers' own assistant mask must agree with ours token for token."""
    from posttrain.models.tiny import train_tokenizer

    tok = train_tokenizer()
    (example,), _ = tokenize_sft(rows({"messages": CONVERSATION}), tok, DataConfig())
    marked = tok.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    assert example["input_ids"] == marked["input_ids"]
    assert example["completion_mask"] == marked["assistant_masks"] and sum(marked["assistant_masks"]) > 0


def test_mask_offsets_are_characters_not_bytes(tok_end):
    tok, end = tok_end
    messages = [{"role": "user", "content": "Ünïcode ✓?"}, {"role": "assistant", "content": "日本語 ✓ ok"},
                {"role": "user", "content": "é"}, {"role": "assistant", "content": "Ça va"}]
    (example,), _ = tokenize_sft(rows({"messages": messages}), tok, DataConfig())
    assert trained_text(tok, example) == ["日本語 ✓ ok" + end, "Ça va" + end]


def test_assistant_only_loss_off_trains_every_token_after_the_first(tok_end):
    tok, _ = tok_end
    (example,), _ = tokenize_sft(rows({"messages": CONVERSATION}), tok, DataConfig(assistant_only_loss=False))
    assert example["completion_mask"] == [0] + [1] * (len(example["input_ids"]) - 1)


COMPLETION = [{"role": "assistant", "content": "Let me check."}, {"role": "tool", "content": "4"},
              {"role": "assistant", "content": "The answer is 4."}]


@pytest.mark.parametrize(
    "completion_only, assistant_only, expected",
    [
        (True, True, ["Let me check.{end}", "The answer is 4.{end}"]),
        (False, True, ["Hi! How are you?{end}", "Let me check.{end}", "The answer is 4.{end}"]),
        (True, False, None),  # one run: the whole rendered completion, tool turn included
    ],
)
def test_conversational_prompt_completion_masks(tok_end, completion_only, assistant_only, expected):
    tok, end = tok_end
    prompt = CONVERSATION[:4]
    cfg = DataConfig(completion_only_loss=completion_only, assistant_only_loss=assistant_only)
    (example,), _ = tokenize_sft(rows({"prompt": prompt, "completion": COMPLETION}), tok, cfg)
    if expected is None:
        prompt_text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(prompt + COMPLETION, tokenize=False)
        assert trained_text(tok, example) == [full[len(prompt_text):].rstrip()]
    else:
        assert trained_text(tok, example) == [e.format(end=end) for e in expected]


def with_template(tok, template):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


def test_template_without_the_prefix_property_is_refused():
    # It writes the number of turns first, so a conversation's start depends on its end.
    tok = with_template(chatml_tokenizer(), "{{ messages | length }} turns\n" + chatml_tokenizer().chat_template)
    message = r"data.train row 0: the chat template does not render .* set data.assistant_only_loss=false"
    with pytest.raises(UserError, match=message):
        tokenize_sft(rows({"messages": CONVERSATION}), tok, DataConfig())
    cfg = DataConfig(assistant_only_loss=False)
    with pytest.raises(UserError, match=r"set data.completion_only_loss=false"):
        tokenize_sft(rows({"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]}), tok, cfg)
    (example,), _ = tokenize_sft(rows({"messages": CONVERSATION}), tok, cfg)  # no mask asked: nothing to find
    assert sum(example["completion_mask"]) == len(example["input_ids"]) - 1


def test_conversation_without_assistant_turn_is_dropped_not_trained_on_everything(tok_end):
    tok, _ = tok_end
    data = rows({"messages": CONVERSATION}, {"messages": CONVERSATION[:2]})
    examples, stats = tokenize_sft(data, tok, DataConfig())
    assert len(examples) == 1 and stats["dropped_no_completion"] == 1 and stats["examples"] == 1


def test_an_assistant_turn_that_opens_the_conversation_is_not_trained(tok_end):
    tok, end = tok_end
    greeting = [{"role": "assistant", "content": "Hello there, how are you?"}]
    data = rows({"messages": greeting + CONVERSATION[1:]}, {"messages": greeting})
    (example,), stats = tokenize_sft(data, tok, DataConfig())
    assert trained_text(tok, example) == ["Hi! How are you?" + end, "The answer is 4." + end]
    assert stats["dropped_no_completion"] == 1


def test_truncation_is_counted_and_rows_cut_before_their_completion_are_dropped():
    tok = chatml_tokenizer()
    long_prompt = "Tell me a joke about cats. " * 10
    data = rows({"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": long_prompt, "completion": " no"},
                {"prompt": "Hi", "completion": " Hello there, how are you today?"})
    examples, stats = tokenize_sft(data, tok, DataConfig(max_length=8))
    assert stats["truncated"] == 2 and stats["dropped_no_completion"] == 1 and stats["examples"] == 2
    assert all(len(e["input_ids"]) <= 8 for e in examples)
    assert trained_text(tok, examples[1])[0].startswith(" Hello")


def test_no_row_left_to_train_is_a_user_error():
    data = rows({"prompt": "Tell me a joke about cats. " * 10, "completion": " no"})
    message = r"data.train: no row has a token to train on within data.max_length=4 \(1 rows, 0 with an empty .*, 1 truncated\)"
    with pytest.raises(UserError, match=message):
        tokenize_sft(data, chatml_tokenizer(), DataConfig(max_length=4))


def test_conversations_need_a_chat_template():
    tok = with_template(chatml_tokenizer(), None)
    with pytest.raises(UserError, match=r"data.train holds conversations .* set model.chat_template"):
        tokenize_sft(rows({"messages": CONVERSATION}), tok, DataConfig())


def test_sft_refuses_preference_rows():
    message = r"data.train: SFT needs text, messages or prompt \+ completion rows; this dataset is preference data"
    with pytest.raises(UserError, match=message):
        tokenize_sft(rows({"chosen": "a", "rejected": "b"}), chatml_tokenizer(), DataConfig())


# --- prompts for generation -------------------------------------------------------------------------------------------


def test_standard_prompts_keep_bos_and_the_other_columns():
    tok = llama3_tokenizer()
    (example,), stats = tokenize_prompts(rows({"prompt": "2 + 2 =", "answer": "4"}), tok, DataConfig())
    assert example["prompt_ids"] == tok("2 + 2 =")["input_ids"] and example["prompt_ids"][0] == tok.bos_token_id
    assert example["prompt"] == "2 + 2 =" and example["columns"] == {"answer": "4"}
    assert stats == dict(rows=1, tokens=len(example["prompt_ids"]), truncated=0, dropped_empty=0)


def test_conversational_prompts_end_with_the_generation_prompt(tok_end):
    tok, _ = tok_end
    (example,), _ = tokenize_prompts(rows({"prompt": CONVERSATION[:2], "answer": "4"}), tok, DataConfig())
    text = tok.decode(example["prompt_ids"])
    assert text == tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert text.endswith("assistant\n") or text.endswith("assistant<|end_header_id|>\n\n")
    assert example["prompt"] == CONVERSATION[:2]


def test_long_prompts_keep_their_last_tokens_and_are_counted():
    tok = chatml_tokenizer()
    data = rows({"prompt": "Tell me a joke about cats. " * 5}, {"prompt": "Hi"})
    examples, stats = tokenize_prompts(data, tok, DataConfig(max_prompt_length=6))
    full = tok("Tell me a joke about cats. " * 5)["input_ids"]
    assert examples[0]["prompt_ids"] == full[-6:] and examples[1]["prompt_ids"] == tok("Hi")["input_ids"]
    assert stats["truncated"] == 1


def test_prompts_need_a_prompt_column():
    message = r"data.train: generation needs a 'prompt' column; this dataset is preference data"
    with pytest.raises(UserError, match=message):
        tokenize_prompts(rows({"chosen": "a b", "rejected": "a c"}), chatml_tokenizer(), DataConfig())


# --- rows that would train on nothing (issue #25) ---------------------------------------------------------------------


def test_empty_texts_completions_and_assistant_turns_are_dropped_and_counted(tok_end):
    tok, _ = tok_end
    good = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    blank = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "  "}]
    multi = good + [{"role": "user", "content": "and 3 + 3?"}, {"role": "assistant", "content": ""}]
    examples, stats = tokenize_sft(rows({"messages": good}, {"messages": blank}, {"messages": multi}), tok,
                                   DataConfig())
    assert len(examples) == 1 and stats["dropped_empty"] == 2
    examples, stats = tokenize_sft(rows({"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": " "}), tok,
                                   DataConfig())
    assert len(examples) == 1 and stats["dropped_empty"] == 1
    with pytest.raises(UserError, match=r"\(2 rows, 2 with an empty text, completion or assistant turn"):
        tokenize_sft(rows({"text": ""}, {"text": " \n"}), tok, DataConfig())


def test_a_tool_call_turn_without_text_is_not_empty(tok_end):
    from posttrain.data.tokenize import _blank_turn

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": {}}}]}
    assert not _blank_turn([call]) and _blank_turn([{"role": "assistant", "content": [{"type": "text", "text": ""}]}])


def test_empty_prompts_are_dropped_and_all_empty_is_an_error():
    tok = llama3_tokenizer()
    examples, stats = tokenize_prompts(rows({"prompt": "2 + 2 ="}, {"prompt": "  "}), tok, DataConfig())
    assert len(examples) == 1 and stats["dropped_empty"] == 1
    with pytest.raises(UserError, match="every one of the 1 prompts is empty"):
        tokenize_prompts(rows({"prompt": ""}), tok, DataConfig())


def test_empty_assistant_turn_in_a_preference_pair_is_dropped(tok_end):
    tok, _ = tok_end
    prompt = [{"role": "user", "content": "2 + 2?"}]
    pairs = rows({"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
                  "rejected": [{"role": "assistant", "content": "5"}]},
                 {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
                  "rejected": [{"role": "assistant", "content": ""}]})
    examples, stats = tokenize_preference(pairs, tok, DataConfig())
    assert len(examples) == 1 and stats["dropped_empty"] == 1
