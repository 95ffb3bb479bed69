"""What the model can hold, read from its config.json without loading weights: the longest sequence, and the
attention heads sequence parallelism splits.

    check_position_limit(recipe, algorithm.data_kind)      # UserError naming the key, before anything heavy loads
    check_sequence_parallel(recipe, algorithm)             # train.sequence_parallel_size against launch and heads

A sequence longer than the model's position table either fails deep inside the forward pass (learned positions)
or trains on positions the model never saw (rotary), after the data, the memory estimate and the model were all
sized for it. The limit is read from a local directory, or from the hub cache for a hub id (nothing is downloaded
here; a hub id not in the cache is checked when it loads).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from posttrain.distributed.launch_config import launcher_engine
from posttrain.distributed.sequence_parallel import SUPPORTED_ATTENTION
from posttrain.errors import UserError

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_config_file(name_or_path: str, revision: Optional[str] = None) -> Optional[Path]:
    """config.json of a local model directory, or of a hub id already in the local cache; None otherwise."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - not a valid repo id for the cache: from_pretrained will say so
        return None
    return Path(cached) if isinstance(cached, str) else None


SIZE_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "head_dim", *POSITION_KEYS)


def config_problem(config_file: Path) -> Optional[str]:
    """What makes a model's config.json unusable before anything reads it (not UTF-8 JSON, not an object, a size
    that is not a whole number > 0, at the top or in text_config), or None. transformers and vLLM fail on these
    deep inside, as did our own checks."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        return f"it is not readable JSON ({type(e).__name__}: {e})"
    if not isinstance(config, dict):
        return f"it holds a JSON {type(config).__name__}, not an object"
    text = config.get("text_config")
    for where, section in (("", config), ("text_config.", text if isinstance(text, dict) else {})):
        for key in SIZE_KEYS:
            value = section.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                return f"{where}{key} is {value!r:.60}; it must be a whole number > 0"
    return None


def position_limit(config_file: Path) -> Optional[tuple[int, str]]:
    """(positions, the key that says so) from a model's config.json (or its text_config); None if it names none."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # unreadable: check_model_source and from_pretrained report it
    if not isinstance(config, dict):
        return None  # check_model_source reports it
    for section in (config, config.get("text_config") or {}):
        for key in POSITION_KEYS:
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
    return None


def check_position_limit(recipe, data_kind: str) -> None:
    """The run's longest sequence must fit the model's positions: data.max_length (SFT, RM, DPO), or the prompt
    plus the completion for generated data (GRPO, PPO)."""
    config_file = model_config_file(recipe.model.name_or_path, recipe.model.revision)
    limit = position_limit(config_file) if config_file is not None else None
    if limit is None:
        return
    positions, key = limit
    if data_kind == "prompt":
        from posttrain.models.facts import longest_sequence

        longest = longest_sequence(recipe)
        prompt_key = "data.max_prompt_length" if recipe.data.max_prompt_length else "data.max_length"
        what = f"{prompt_key} + generation.max_completion_length = {longest:,}"
        fix = f"lower {prompt_key} or generation.max_completion_length"
    else:
        longest = recipe.data.max_length
        what, fix = f"data.max_length = {longest:,}", "lower data.max_length"
    if longest > positions:
        raise UserError(f"{what}, but the model holds {positions:,} positions ({key} in {config_file}); {fix} to at "
                        f"most {positions:,}")


SEQUENCE_PARALLEL_ALGORITHMS = ("sft", "grpo", "ppo", "distill")
"""Algorithms whose forwards and data-level counts are sequence-parallel (their model calls go through
models/forward.py's per-token forwards)."""


def check_sequence_parallel(recipe, algorithm, world: Optional[int] = None) -> None:
    """train.sequence_parallel_size against the launch, the algorithm, the attention kernel and the model's heads:
    UserError naming the key, before any model loads. `world`: the processes (None: this launch's WORLD_SIZE;
    `posttrain plan` passes --gpus and checks that it divides itself)."""
    size = recipe.train.sequence_parallel_size
    if size == 1:
        return
    key = f"train.sequence_parallel_size={size}"
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    if world % size:
        raise UserError(f"{key} does not divide the {world} processes launched: launch a multiple of {size} "
                        f"(torchrun --nproc_per_node {size} ...), or lower it")
    if algorithm.name not in SEQUENCE_PARALLEL_ALGORITHMS:
        raise UserError(f"{key}: {algorithm.name} does not run sequence-parallel (only "
                        f"{', '.join(SEQUENCE_PARALLEL_ALGORITHMS)}); set it to 1")
    if launcher_engine() == "fsdp":
        raise UserError(f"{key} runs under DDP or DeepSpeed (ZeRO 0-3); FSDP with sequence parallelism is not "
                        "supported: use a DeepSpeed config (recipes/accelerate/zero3.yaml)")
    if recipe.data.packing:
        raise UserError(f"{key} with data.packing=true: packed rows hold several sequences whose attention must stay "
                        "apart, and Ulysses keeps only causal attention over a whole row; set data.packing=false "
                        "(sequence parallelism already spends little on padding: each row is split, not padded)")
    if recipe.model.attn_implementation not in SUPPORTED_ATTENTION:
        raise UserError(f"{key} needs model.attn_implementation in {', '.join(SUPPORTED_ATTENTION)} (got "
                        f"{recipe.model.attn_implementation!r}): Ulysses runs the kernel causally over the whole row, "
                        "and eager attention needs a mask over it")
    for whose, name_or_path, revision in sequence_parallel_models(recipe, algorithm):
        check_heads(key, size, whose, model_config_file(name_or_path, revision))


def sequence_parallel_models(recipe, algorithm) -> list[tuple[str, str, Optional[str]]]:
    """(how a message names it, model, revision) of every model whose forwards run sequence-parallel: the policy,
    and a distillation teacher or a PPO critic loaded from another model (the reference is the policy's)."""
    models = [("the model's", recipe.model.name_or_path, recipe.model.revision)]
    teacher = getattr(recipe.algo, "teacher_model_name_or_path", None)
    if teacher:
        models.append((f"algo.teacher_model_name_or_path {teacher}'s", teacher,
                       getattr(recipe.algo, "teacher_model_revision", None)))
    critic_source = getattr(algorithm, "critic_source", None)
    critic = critic_source() if critic_source is not None else None
    if critic is not None and critic.name_or_path != recipe.model.name_or_path:
        models.append((f"the critic {critic.name_or_path}'s", critic.name_or_path, critic.revision))
    return models


def check_heads(key: str, size: int, whose: str, config_file: Optional[Path]) -> None:
    """Ulysses gives each rank heads / size attention heads: size must divide them, and the key/value heads and size
    must divide one another. A teacher or critic of another shape failed deep inside its first forward."""
    if config_file is None:
        return  # not on disk yet: DeepSpeed checks the heads at the first forward
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # unreadable: loading the model says why
    config = (config.get("text_config") or config) if isinstance(config, dict) else {}
    heads, kv_heads = (config.get(name) if isinstance(config, dict) else None
                       for name in ("num_attention_heads", "num_key_value_heads"))
    heads = heads if type(heads) is int and heads > 0 else None  # else loading the model says what is wrong
    kv_heads = kv_heads if type(kv_heads) is int and kv_heads > 0 else heads
    if heads is not None and heads % size:
        raise UserError(f"{key} must divide {whose} {heads} attention heads (Ulysses gives each rank "
                        f"heads / {size} of them); choose a divisor of {heads}")
    if kv_heads is not None and kv_heads % size and size % kv_heads:
        raise UserError(f"{key} and {whose} {kv_heads} key/value heads must divide one another (more ranks than "
                        f"kv heads: each is replicated over {size} / {kv_heads} ranks); choose a divisor or multiple")
