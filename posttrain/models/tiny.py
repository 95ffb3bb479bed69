"""A tiny random causal LM with a locally trained tokenizer: for tests, the demo and benchmarks (no downloads).

    from posttrain.models.tiny import make_tiny_model
    make_tiny_model("tiny/", arch="llama", seed=0)        # ~0.1M parameters, 2 heads of 32, about a second on a CPU
    make_tiny_model("bench/", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)  # 24M
    make_tiny_model("moe/", arch="qwen3_moe")             # Qwen3-MoE: 4 experts of 32, 2 routed per token

The tokenizer is byte-level BPE (~630 tokens; any NFC-normalised text round-trips through encode/decode), puts every
digit in its own token (so arithmetic tasks are learnable by a small model), and carries a ChatML chat template.
The directory loads with `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained` like any hub model.
"""

from __future__ import annotations

import random
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)

# ChatML. The assistant turn's content and its <|im_end|> sit inside {% generation %} so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` can mark what the model should learn to say.
# With `tools=[...]` a system turn lists their JSON schemas and asks for Hermes-style <tool_call> JSON (Qwen 2.5's
# convention); an assistant message's `tool_calls` render the same way, after its content; tool results render as
# `tool` turns. Without tools and tool calls the text is exactly plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nYou may call these tools:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nCall one as <tool_call>{\"name\": <name>, \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{{- ('\n' if (message['content'] or not loop.first) else '') + '<tool_call>\n{\"name\": \"' + call['name']"
    " + '\", \"arguments\": ' + (call['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' }}"
    "{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCHS = ("llama", "qwen2", "qwen3_moe")
MOE_EXPERTS, MOE_TOP_K = 4, 2
"""The tiny Qwen3-MoE: experts per layer and experts routed per token (each expert is intermediate_size / 4 wide)."""

# Qwen2's pre-tokenizer split: `\p{N}` alone puts every digit in its own token. The whole pipeline (NFC, this
# split, byte-level) is Qwen2Tokenizer's own, because transformers 5 loads any qwen2 directory with Qwen2Tokenizer,
# which rebuilds the pipeline from its defaults; matching it makes both archs tokenize identically.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)

_SENTENCES = (
    "Hello! How can I help you today?",
    "You are a helpful assistant.",
    "Please answer the question briefly and correctly.",
    "The quick brown fox jumps over the lazy dog.",
    "Thank you, that was very helpful.",
    "Can you explain how this works?",
    "Sure, here is a short explanation of the idea.",
    "I think the answer is correct, but let me check again.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea and the sky.",
    "The weather is nice today, so we went for a walk in the park.",
    "Summarize the following text in one sentence.",
    "I'm sorry, I don't know the answer to that question.",
    "Let's think step by step before we give the final answer.",
    "The answer is: yes. The answer is: no.",
    "Good morning! Good evening! Good night!",
    "Python is a programming language; it is easy to read.",
    "Reinforcement learning rewards good answers and penalises bad ones.",
    "A language model predicts the next token given the previous ones.",
    "Which one do you prefer, the first response or the second response?",
)


def _corpus(seed: int = 1234) -> list[str]:
    """Chat-ish sentences wrapped in ChatML, plus arithmetic question/answer lines. Fixed, so training is repeatable."""
    rng = random.Random(seed)
    lines = list(_SENTENCES)
    for s in _SENTENCES:
        lines.append(f"{IM_START}user\n{s}{IM_END}\n{IM_START}assistant\n{s.lower()}{IM_END}\n")
    for _ in range(400):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        c = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? {c}")
        lines.append(f"Compute {a}{op}{b}. The answer is {c}.")
    return lines


def train_tokenizer(vocab_size: int = 768):
    """Byte-level BPE, one token per digit, ChatML special tokens; as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None,
                                   unk_token=None, additional_special_tokens=[IM_START], chat_template=CHATML_TEMPLATE,
                                   padding_side="right", clean_up_tokenization_spaces=False)


def make_tiny_model(out_dir, arch: str = "llama", seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 2, num_kv_heads: int = 1, intermediate_size: int = 128,
                    max_position_embeddings: int = 1024) -> Path:
    """Write a random-init `arch` (llama, qwen2 or qwen3_moe) causal LM (float32, tied embeddings) and its tokenizer
    to out_dir. qwen3_moe replaces every MLP by MOE_EXPERTS experts, MOE_TOP_K routed per token (models/moe.py).

    The default shape has head_dim 32 (hidden 64 / 2 heads): vLLM's CPU attention has no kernel below 32, and the
    shipped vLLM recipes run on this model as their headers say."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from posttrain.errors import UserError

    if arch not in ARCHS:
        raise UserError(f"make_tiny_model: arch must be one of {', '.join(ARCHS)}, got '{arch}'")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise UserError(f"make_tiny_model: hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) "
                        f"and num_heads by num_kv_heads ({num_kv_heads})")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    tokenizer.model_max_length = max_position_embeddings
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    moe = {"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K, "moe_intermediate_size": intermediate_size // 4,
           "decoder_sparse_step": 1, "head_dim": hidden_size // num_heads} if arch == "qwen3_moe" else {}
    config = config_cls(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, bos_token_id=None,
                        eos_token_id=eos_id, pad_token_id=pad_id, **moe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out

