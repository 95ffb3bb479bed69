"""The critic (value model) of PPO: a transformer backbone with a one-output linear head per token.

    critic = load_critic(source, pad_token_id)            # AutoModelForTokenClassification, num_labels=1
    values_BT = critic_values(critic, batch)              # value of the state BEFORE each token, aligned with input_ids

Initialised from a reward model written by `posttrain rm` (its backbone and its `score` head, which the token
classifier shares by name) or from the policy (a fresh head). Dropout on the head is off: values must not be noisy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError
from posttrain.models.load import _from_pretrained, check_model_source
from posttrain.models.forward import per_token


def check_critic_source(source: ModelConfig, what: str, policy_vocab_size: int) -> None:
    """Before any weights load: the directory exists, holds a config, and its vocabulary is the policy's (the critic
    reads the policy's token ids)."""
    from transformers import AutoConfig

    check_model_source(source, what)
    try:
        config = AutoConfig.from_pretrained(str(Path(source.name_or_path).expanduser()))
    except (OSError, ValueError) as e:
        raise UserError(f"{what}: cannot read the model config of '{source.name_or_path}': {e}") from None
    if getattr(config, "vocab_size", policy_vocab_size) != policy_vocab_size:
        raise UserError(f"{what} '{source.name_or_path}' has a vocabulary of {config.vocab_size} tokens but the policy "
                        f"has {policy_vocab_size}: the critic reads the policy's token ids, so it must share its "
                        f"tokenizer. Point {what} at a model with the policy's tokenizer (or leave it unset to start "
                        "from the policy)")


def load_critic(source: ModelConfig, pad_token_id: int, gradient_checkpointing: bool = False):
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(str(Path(source.name_or_path).expanduser()), num_labels=1,
                                        pad_token_id=pad_token_id, trust_remote_code=source.trust_remote_code)
    config.classifier_dropout = 0.0
    model = _from_pretrained(AutoModelForTokenClassification, source, gradient_checkpointing, config=config)
    model.config.pad_token_id = pad_token_id
    return model


def critic_values(critic, batch) -> torch.Tensor:
    """values_BT: position t holds the critic's value after reading tokens < t (the state token t is sampled from);
    position 0 is 0, matching the log-prob alignment of posttrain.batch."""
    out_BT = per_token(critic, batch, lambda out: out.logits[..., 0].float())
    return torch.nn.functional.pad(out_BT[:, :-1], (1, 0))
