"""Small byte-level BPE tokenizers with a ChatML and a Llama-3 chat template, trained in milliseconds (no downloads).

The other test_data_* modules import `chatml_tokenizer` / `llama3_tokenizer` (and `rows`); the tests here pin what
the templates render, so a change to them shows up here first.
"""

from __future__ import annotations

import functools

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<pad>"]
CORPUS = [
    "Hello there, how are you today?", "I am fine, thanks. What is 2 + 2?", "The answer is 4.",
    "You are a helpful assistant.", "Tell me a joke about cats.", "Why did the cat sit on the computer?",
]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _bpe(bos: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None:
        tok.post_processor = byte_level
    else:  # like Llama 3: the tokenizer itself puts BOS in front of plain text
        bos_id = tok.token_to_id(bos)
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    return tok


def rows(*items: dict) -> datasets.Dataset:
    return datasets.Dataset.from_list(list(items))


@functools.cache
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen-like: no BOS, EOS = <|im_end|> (the end-of-turn token)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(None), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


@functools.cache
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3-Instruct-like: BOS <|begin_of_text|> added to text and written by the template, EOS = <|eot_id|>."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe("<|begin_of_text|>"),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<pad>",
    )
    tok.chat_template = LLAMA3
    return tok


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How are you?"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "The answer is 4."},
]


def test_chatml_renders_turns():
    text = chatml_tokenizer().apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_renders_turns_and_adds_bos_to_text():
    tok = llama3_tokenizer()
    text = tok.apply_chat_template(CONVERSATION[1:3], tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi! How are you?<|eot_id|>"
    )
    assert tok("Hello")["input_ids"][0] == tok.bos_token_id
    assert tok("Hello", add_special_tokens=False)["input_ids"][0] != tok.bos_token_id


def test_tokenizers_round_trip_any_text():
    for tok in (chatml_tokenizer(), llama3_tokenizer()):
        text = "Ünïcode ✓ and 日本語 text"
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
