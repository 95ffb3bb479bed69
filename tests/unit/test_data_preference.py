"""tokenize_preference: explicit and implicit prompts, standard and conversational; bad pairs dropped and counted."""

from __future__ import annotations

import pytest

from posttrain.config import DataConfig
from posttrain.data import tokenize_preference
from posttrain.errors import UserError
from tests.unit.test_data_tokenizers import CONVERSATION, chatml_tokenizer, llama3_tokenizer, rows

PROMPT = CONVERSATION[:4]
GOOD = [{"role": "assistant", "content": "The answer is 4."}]
BAD = [{"role": "assistant", "content": "5"}]


def decoded(tok, example) -> dict:
    return {k: tok.decode(v) for k, v in example.items() if k.endswith("_ids")}


def test_explicit_standard_pair():
    tok = llama3_tokenizer()
    data = rows({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"})
    (example,), stats = tokenize_preference(data, tok, DataConfig())
    assert decoded(tok, example) == {
        "prompt_ids": "<|begin_of_text|>2 + 2 =", "chosen_ids": " 4<|eot_id|>", "rejected_ids": " 5<|eot_id|>"
    }
    assert "margin" not in example
    tokens = 2 * len(example["prompt_ids"]) + len(example["chosen_ids"]) + len(example["rejected_ids"])
    assert stats == dict(rows=1, pairs=1, tokens=tokens, truncated=0,
                         dropped_prompt_mismatch=0, dropped_identical=0, dropped_empty=0)


@pytest.mark.parametrize("make, end", [(chatml_tokenizer, "<|im_end|>"), (llama3_tokenizer, "<|eot_id|>")])
@pytest.mark.parametrize("implicit", [False, True])
def test_conversational_pair_explicit_and_implicit(make, end, implicit):
    tok = make()
    if implicit:
        row = {"chosen": PROMPT + GOOD, "rejected": PROMPT + BAD}
    else:
        row = {"prompt": PROMPT, "chosen": GOOD, "rejected": BAD}
    (example,), _ = tokenize_preference(rows(row), tok, DataConfig())
    assert decoded(tok, example) == {
        "prompt_ids": tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True),
        "chosen_ids": "The answer is 4." + end,
        "rejected_ids": "5" + end,
    }


def test_implicit_standard_prompt_is_the_shared_prefix_without_its_trailing_space():
    tok = chatml_tokenizer()
    (example,), _ = tokenize_preference(rows({"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}), tok, DataConfig())
    expected = {"prompt_ids": "2 + 2 =", "chosen_ids": " 4<|im_end|>", "rejected_ids": " 5<|im_end|>"}
    assert decoded(tok, example) == expected


def test_bad_pairs_are_dropped_and_counted():
    other_prompt = [{"role": "user", "content": "What is 3 + 3?"}]
    data = rows(
        {"chosen": PROMPT + GOOD, "rejected": PROMPT + BAD},  # kept
        {"chosen": PROMPT + GOOD, "rejected": other_prompt + BAD},  # prompts differ
        {"chosen": GOOD, "rejected": BAD},  # nothing before the answer: no prompt
        {"chosen": PROMPT + GOOD, "rejected": PROMPT + GOOD},  # identical
        {"chosen": PROMPT + GOOD, "rejected": PROMPT + [{"role": "assistant", "content": " "}]},  # empty
        {"chosen": PROMPT + GOOD, "rejected": PROMPT},  # rejected's last answer has another prompt
    )
    examples, stats = tokenize_preference(data, chatml_tokenizer(), DataConfig())
    assert len(examples) == 1
    assert {k: v for k, v in stats.items() if k.startswith("dropped")} == dict(
        dropped_prompt_mismatch=3, dropped_identical=1, dropped_empty=1
    )


def test_standard_drops():
    data = rows(
        {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
        {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 4"},
        {"prompt": "2 + 2 =", "chosen": "", "rejected": " 5"},
    )
    examples, stats = tokenize_preference(data, chatml_tokenizer(), DataConfig())
    assert len(examples) == stats["pairs"] == 1
    assert stats["dropped_identical"] == 1 and stats["dropped_empty"] == 1


def test_nothing_left_is_a_user_error_with_the_counts():
    data = rows({"chosen": "4", "rejected": "5"}, {"chosen": "a 4", "rejected": "a 4"},
                {"chosen": "a 4", "rejected": "a 4 "})
    message = (r"data.train: no usable preference pair in 3 rows: 1 had no prompt shared .* "
               r"1 had chosen == rejected, 1 had an empty")
    with pytest.raises(UserError, match=message):
        tokenize_preference(data, chatml_tokenizer(), DataConfig())


def test_margin_column():
    data = rows({"prompt": "p", "chosen": " 4", "rejected": " 5", "margin": 2},
                {"prompt": "p", "chosen": " 4", "rejected": " 6", "margin": 0.5})
    examples, _ = tokenize_preference(data, chatml_tokenizer(), DataConfig())
    assert [e["margin"] for e in examples] == [2.0, 0.5]
    data = rows({"prompt": "p", "chosen": " 4", "rejected": " 5", "margin": "big"})
    with pytest.raises(UserError, match=r"data.train row 0: column 'margin' must be a number, got 'big'"):
        tokenize_preference(data, chatml_tokenizer(), DataConfig())


def test_truncation_keeps_the_prompt_end_and_the_completion_start():
    tok = chatml_tokenizer()
    prompt = "Tell me a joke about cats. " * 4
    chosen, rejected = " Why did the cat sit on the computer?", " No"
    full_prompt, full_chosen = tok(prompt)["input_ids"], tok(chosen)["input_ids"] + [tok.eos_token_id]
    data = rows({"prompt": prompt, "chosen": chosen, "rejected": rejected},
                {"prompt": "Hi", "chosen": " 4", "rejected": " 5"})
    examples, stats = tokenize_preference(data, tok, DataConfig(max_length=12))
    cut = examples[0]
    assert stats["truncated"] == 1 and len(examples) == 2
    assert cut["prompt_ids"] == full_prompt[-6:]  # the prompt keeps half the budget; the completions get the rest
    assert cut["chosen_ids"] == full_chosen[:6]
    assert cut["rejected_ids"] == tok(rejected)["input_ids"] + [tok.eos_token_id]
    # A short completion leaves the prompt more room:
    data = rows({"prompt": prompt, "chosen": " 4", "rejected": " 5"})
    (short,), _ = tokenize_preference(data, tok, DataConfig(max_length=12))
    full_rejected = tok(" 5")["input_ids"] + [tok.eos_token_id]
    assert len(full_rejected) == 3 and short["rejected_ids"] == full_rejected
    assert short["prompt_ids"] == full_prompt[-(12 - 3):]


def test_preference_refuses_sft_rows():
    message = r"preference training needs prompt \+ chosen \+ rejected .*this dataset is language_modeling"
    with pytest.raises(UserError, match=message):
        tokenize_preference(rows({"text": "hi"}), chatml_tokenizer(), DataConfig())
