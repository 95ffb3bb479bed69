"""Forward passes shared by algorithms: a batch through a causal LM -> per-token log-probs (and entropy).

`policy_logprobs` never makes the (B, T, V) logits when the model's output layer is a plain bias-free Linear whose
output the model returns untouched (the architectures in FUSED_HEAD_MODELS): for the duration of the forward the
output layer's `forward` is swapped for `ops.logprobs.linear_token_logprobs`, which takes the hidden states and the
layer's own weight, so the model returns log-probs where it would return logits. The swap is on the module
instance, so every engine's hooks around that module (ZeRO-3 gathering its weight, FSDP2 unsharding) still run.
Other architectures (logit soft-capping or scaling after the head, a LoRA-wrapped head) take the logits path.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.batch import Batch
from posttrain.distributed.wrappers import plain_class, unwrap_module
from posttrain.ops.logprobs import linear_token_logprobs, token_logprobs

FUSED_HEAD_MODELS = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3", "qwen2_moe", "qwen3_moe", "olmo2"})
"""Model types whose causal-LM forward returns `lm_head(hidden)` as the logits, with nothing applied after it."""


def policy_logits(model, batch: Batch) -> torch.Tensor:
    """logits_BTV of a causal LM for the batch (padded or packed layout)."""
    return model(**batch.model_inputs(), use_cache=False).logits


def policy_logprobs(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """logprobs_BT aligned with input_ids_BT (position 0 is 0): log p(token t | tokens < t)."""
    head = fusable_head(model)
    if head is None:
        return token_logprobs(policy_logits(model, batch), batch.input_ids_BT, temperature=temperature)
    with _head_returns_logprobs(head, batch.input_ids_BT, temperature):
        return model(**batch.model_inputs(), use_cache=False).logits


def fusable_head(model) -> torch.nn.Linear | None:
    """The output layer, when log-probs may be taken from the hidden states directly (see the module docstring)."""
    inner = unwrap_module(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in FUSED_HEAD_MODELS or not hasattr(inner, "get_output_embeddings"):
        return None
    head = inner.get_output_embeddings()
    return head if plain_class(head) is torch.nn.Linear and head.bias is None else None


@contextlib.contextmanager
def _head_returns_logprobs(head: torch.nn.Linear, input_ids_BT: torch.Tensor, temperature: float):
    def forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
        return linear_token_logprobs(hidden_BTH, head.weight, input_ids_BT, temperature)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
