"""One factory for every engine: the recipe's answer to where generation runs (generation.placement) picks it.

    engine = make_engine(recipe, backend, policy, tokenizer, servers)

    placement   engine   what samples                                              the trainer syncs it
    colocated   hf       transformers generate on the policy itself, in each rank  no (it is the policy)
    colocated   vllm     a vLLM engine inside each rank (generation/vllm_engine.py)     yes, in-process
    node        vllm     one `posttrain serve` per node, started by its first rank   yes, from that rank
    servers     vllm     the listed servers (posttrain serve or a stock vLLM server) yes, from rank 0
    ray         vllm     `posttrain serve` in Ray actors the launch wing started      yes, from rank 0

With generation.lora_sync=adapter a server engine is told to sync the LoRA adapter alone (`send_adapters`).
`servers` are the URLs of the last two rows: generation.servers, or the engines the launch wing started. Every engine
answers the same interface (generation/base.GenerationEngine), with its capabilities declared.
"""

from __future__ import annotations

import secrets
from typing import Callable, Optional, Sequence

from posttrain.generation.adapter_sync import adapter_config
from posttrain.generation.base import GenerationEngine
from posttrain.models.facts import longest_sequence
from posttrain.models.vision import is_vision_model
from posttrain.generation.hf import HFEngine
from posttrain.generation.server import ServerEngine
from posttrain.generation.vllm_engine import VLLMEngine
from posttrain.generation.vllm_node import NodeEngine


def _hf(recipe, backend, policy, tokenizer, servers) -> GenerationEngine:
    """Generating on the policy itself is a collective with several ranks (ZeRO-3 / FSDP2 gather its parameters)."""
    return HFEngine(model=backend.unwrap(policy), tokenizer=tokenizer,
                    gather=lambda: backend.gathered_parameters(policy), collective=backend.world_size > 1)


def _in_process(recipe, backend, policy, tokenizer, servers) -> GenerationEngine:
    return VLLMEngine(model_dir=recipe.model.name_or_path, tokenizer=tokenizer, config=recipe.generation.vllm,
                      seed=recipe.seed + backend.rank, max_model_len=longest_sequence(recipe),
                      fp32_head=recipe.model.lm_head_fp32, vision=is_vision_model(recipe.model))


def _node(recipe, backend, policy, tokenizer, servers) -> GenerationEngine:
    return NodeEngine(recipe, backend, tokenizer)


def _servers(recipe, backend, policy, tokenizer, servers) -> GenerationEngine:
    """Rank 0 pushes weight syncs to the servers; every rank sends them prompts."""
    return ServerEngine(recipe.generation, tokenizer, sends_weights=backend.is_main, servers=servers)


ENGINES: dict[tuple[str, str], Callable[..., GenerationEngine]] = {
    ("colocated", "hf"): _hf,
    ("colocated", "vllm"): _in_process,
    ("node", "vllm"): _node,
    ("servers", "vllm"): _servers,
    ("ray", "vllm"): _servers,
}


def make_engine(recipe, backend, policy, tokenizer, servers: Optional[Sequence[str]] = None) -> GenerationEngine:
    """The engine of `recipe.generation` (placement, engine; checked by config/validate.py), sampling from `policy`
    (the backend-prepared model) or syncing from it. `servers`: the URLs the launch wing started (placement ray);
    None: generation.servers."""
    g = recipe.generation
    engine = ENGINES[g.placement, g.engine](recipe, backend, policy, tokenizer, tuple(servers or g.servers))
    if g.lora_sync == "adapter":  # validated: a LoRA policy, vLLM servers (node, servers, ray)
        engine.send_adapters(adapter_config(backend.unwrap(policy)), backend.broadcast_object(secrets.token_hex(4)))
    return engine
