"""Forward passes shared by algorithms: a batch through a causal LM -> per-token log-probs (and entropy)."""

from __future__ import annotations

import torch

from posttrain.ops.logprobs import token_logprobs
from posttrain.batch import Batch


def policy_logits(model, batch: Batch) -> torch.Tensor:
    """logits_BTV of a causal LM for the batch (padded or packed layout)."""
    return model(**batch.model_inputs(), use_cache=False).logits


def policy_logprobs(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """logprobs_BT aligned with input_ids_BT (position 0 is 0): log p(token t | tokens < t)."""
    return token_logprobs(policy_logits(model, batch), batch.input_ids_BT, temperature=temperature)
