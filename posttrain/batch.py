"""The batch record every algorithm sees: a typed dataclass with named optional fields.

Token alignment: `completion_mask_BT[b, t]` is True when token `input_ids_BT[b, t]` is trained on, i.e. predicted
by the logits at position t - 1. Shifted views (`[:, 1:]`) are taken by `ops.logprobs`, nowhere else.
Layouts:
- padded: `attention_mask_BT` marks real tokens (right padding); `position_ids_BT` is None.
- packed (padding-free): B == 1, sequences concatenated, `attention_mask_BT` is None, `position_ids_BT` restarts at 0
  for every sequence (transformers keeps attention inside each sequence), `sequence_index_BT` numbers them.
- preference: the first `num_pairs` rows are the chosen sequences, the next `num_pairs` their rejected partners.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Batch:
    input_ids_BT: torch.Tensor
    """Token ids, int64."""
    completion_mask_BT: torch.Tensor
    """bool: tokens the loss is taken over (completion / assistant tokens, or all tokens for plain text)."""
    attention_mask_BT: Optional[torch.Tensor] = None
    """Padded layout: 1 for real tokens, 0 for padding."""
    position_ids_BT: Optional[torch.Tensor] = None
    """Packed layout: positions restarting at 0 per sequence."""
    sequence_index_BT: Optional[torch.Tensor] = None
    """Packed layout: which sequence (0..n-1) each token belongs to; -1 for none."""
    num_sequences: int = 0
    """Sequences in the micro-batch (rows when padded, packed sequences when packed)."""
    num_pairs: int = 0
    """Preference batches: number of (chosen, rejected) pairs; rows [0, P) chosen, [P, 2P) rejected."""
    margin_B: Optional[torch.Tensor] = None
    """Reward-model pairs: optional required margin per pair."""
    ref_logprobs_B: Optional[torch.Tensor] = None
    """Preference batches: reference log-prob sum per sequence (chosen then rejected), when precomputed."""
    example_index_B: Optional[torch.Tensor] = None
    """Dataset row index of each sequence (or pair); keys the precomputed-reference cache."""
    # --- online RL ---
    advantages_B: Optional[torch.Tensor] = None
    """Per-sequence advantage (GRPO family)."""
    advantages_BT: Optional[torch.Tensor] = None
    """Per-token advantage (PPO with GAE), aligned with input_ids_BT, 0 outside the completion."""
    rewards_B: Optional[torch.Tensor] = None
    """Total reward of each completion (reward functions / reward model), scored at its end."""
    old_values_BT: Optional[torch.Tensor] = None
    """Critic values when the rollout was made, aligned with input_ids_BT: the value of the state before token t."""
    returns_BT: Optional[torch.Tensor] = None
    """Value targets (advantages + old values), aligned with input_ids_BT."""
    old_logprobs_BT: Optional[torch.Tensor] = None
    """Log-probs of the sampling policy, aligned with input_ids_BT (position 0 unused)."""
    ref_logprobs_BT: Optional[torch.Tensor] = None
    """Log-probs of the reference policy, aligned with input_ids_BT (position 0 unused)."""
    sampler_logprobs_BT: Optional[torch.Tensor] = None
    """Log-probs the generation engine reported for the completion tokens, aligned with input_ids_BT (0 elsewhere);
    a vllm / server engine samples from a copy of the policy, so they can differ from the trainer's."""
    truncated_B: Optional[torch.Tensor] = None
    """bool: completion hit max_completion_length without end of sequence."""
    routed_experts_BTLK: Optional[torch.Tensor] = None
    """Mixture-of-experts routing replay: the K experts of each of the L MoE layers that the old policy routed token t
    to (int16), aligned with input_ids_BT; the training forward routes with them (models/moe.py)."""
    # --- distillation from a server teacher ---
    teacher_topk_logprobs_BTK: Optional[torch.Tensor] = None
    """The teacher's k largest log-probs (temperature 1) of the distribution predicting token t, at position t."""
    teacher_topk_ids_BTK: Optional[torch.Tensor] = None
    """The token ids of those k log-probs (int64)."""

    def to(self, device: torch.device) -> "Batch":
        return dataclasses.replace(self, **{name: value.to(device) for name, value in self._tensors()})

    def model_inputs(self) -> dict:
        """Keyword arguments for a transformers forward pass."""
        inputs = {"input_ids": self.input_ids_BT, "attention_mask": self.attention_mask_BT,
                  "position_ids": self.position_ids_BT}
        return {key: value for key, value in inputs.items() if value is not None}

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) of a padded batch (for chunked forwards)."""
        size = self.input_ids_BT.shape[0]
        sliced = {name: value[start:stop] for name, value in self._tensors() if value.dim() and value.shape[0] == size}
        return dataclasses.replace(self, num_sequences=stop - start, **sliced)

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(field name, tensor) of every field that holds a tensor."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return [(name, value) for name, value in values if isinstance(value, torch.Tensor)]
