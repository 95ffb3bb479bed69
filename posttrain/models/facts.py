"""Facts about a model that engines, the trainer and the planner all ask: how long a sequence a run asks for, and which
tokens end a completion. They live here, beside the model's loading, so models/ never imports generation/ back.
"""

from __future__ import annotations

from typing import Optional

from posttrain.errors import UserError


def longest_sequence(recipe) -> int:
    """The longest prompt + completion a run asks an engine for: data.max_prompt_length (or data.max_length) +
    generation.max_completion_length."""
    return (recipe.data.max_prompt_length or recipe.data.max_length) + recipe.generation.max_completion_length


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokens that end a completion, in every engine and wherever a completion's end is judged (truncated, the
    agent's turn end, PPO's missing_eos_penalty): the tokenizer's eos and every eos id of the model's
    generation_config.json (Llama-3.1-Instruct ends a tool call with <|eom_id|>, Qwen2.5-Instruct lists two). Read once
    by models/load.load_tokenizer from the model directory; a tokenizer loaded otherwise reads the generation config
    beside itself (none there: its eos alone). The tokenizer's eos comes first."""
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos token; set one (tokenizer.eos_token) so generation can stop")
    recorded = getattr(tokenizer, "posttrain_stop_ids", None)
    if recorded is None:
        recorded = generation_eos_ids(getattr(tokenizer, "name_or_path", "") or "")
    return tuple(dict.fromkeys([int(tokenizer.eos_token_id), *recorded]))


def generation_eos_ids(model_source: str, revision: Optional[str] = None) -> tuple[int, ...]:
    """The eos ids of a model's generation_config.json (an int or a list there); () when it has none or cannot be
    read (offline, no such file)."""
    from transformers import GenerationConfig as HFGenerationConfig

    if not model_source:
        return ()
    try:
        eos = HFGenerationConfig.from_pretrained(model_source, revision=revision).eos_token_id
    except (OSError, ValueError):
        return ()
    return tuple(int(i) for i in ([] if eos is None else [eos] if isinstance(eos, int) else eos))
