"""The batch record every algorithm sees: a typed dataclass with named optional fields.

Token alignment: `completion_mask_BT[b, t]` is True when token `input_ids_BT[b, t]` is trained on, i.e. predicted
by the logits at position t - 1. Shifted views (`[:, 1:]`) are taken by `ops.logprobs`, nowhere else.
Layouts:
- padded: `attention_mask_BT` marks real tokens (right padding); `position_ids_BT` is None.
- packed (padding-free): B == 1, sequences concatenated, `attention_mask_BT` is None, `position_ids_BT` restarts at 0
  for every sequence (transformers keeps attention inside each sequence), `sequence_index_BT` numbers them.
- preference: the first `num_pairs` rows are the chosen sequences, the next `num_pairs` their rejected partners.
- padding-free forward (`padding_free`, data.packing for every algorithm but SFT's own packing): the batch keeps the
  padded layout for the losses, but `model_inputs()` packs its rows first-fit-decreasing into as few rows of the
  longest row's length as hold them (position ids restarting per sequence, so transformers keeps attention inside
  each) and `unpack` scatters the model's outputs back to [B, T]: little compute or activation memory is spent on
  padding, and no loss needs to know. Rows no longer than the longest keep attention at most what the padded batch
  costs where the attention kernel is not varlen (sdpa / eager build a mask over a packed row's whole length).
- shared prefix (`prefix_group_B` set, train.shared_prefix): the batch keeps the padded layout for the losses, but
  rows that begin with the same tokens (a prompt's G completions, a pair's chosen and rejected rows) are computed with
  those tokens once: `model_inputs()` gives one packed row per group, [prefix | own tokens of each member], with a
  4-D attention mask that lets each member see the prefix and itself (ops/shared_prefix.py); `unpack` reads every
  token back from its slot, so no loss needs to know. Next-token log-probs need the pairs of
  `ops.shared_prefix.predictions` (models/forward.py), since the prefix's last slot predicts every member's first
  token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from posttrain.ops.shared_prefix import PrefixLayout, prefix_groups, prefix_layout


@dataclass(frozen=True)
class VisionInputs:
    """A micro-batch's images as the model's image processor gives them (data/images.py builds it), and which batch
    row each belongs to. Rows carry their images in order; `pixel_values` holds every image's leading rows in turn
    (Qwen-VL: one row per vision patch, `image_grid_thw` the (t, h, w) patch grid of each image)."""

    pixel_values: torch.Tensor
    """The image processor's pixel tensor, images concatenated along dim 0."""
    patches_I: torch.Tensor
    """How many leading rows of pixel_values each image holds (int64, one per image)."""
    images_B: torch.Tensor
    """How many images each batch row has (int64)."""
    image_grid_thw: Optional[torch.Tensor] = None
    """Qwen-VL: each image's patch grid (t, h, w), [I, 3]."""
    image_token_id: int = -1
    """The token that stands for one image token in input_ids (the processor's image token)."""
    marks_image_tokens: bool = False
    """The model takes `mm_token_type_ids` (1 at image tokens) beside input_ids, as its processor returns them: how
    transformers' Qwen-VL finds where to place each image on the 3-D rotary grid."""

    def model_inputs(self, input_ids_BT: torch.Tensor) -> dict:
        """The forward's image arguments."""
        marks = (input_ids_BT == self.image_token_id).long() if self.marks_image_tokens else None
        inputs = {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw, "mm_token_type_ids": marks}
        return {key: value for key, value in inputs.items() if value is not None}

    def to(self, device: torch.device) -> "VisionInputs":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def rows(self, start: int, stop: int) -> Optional["VisionInputs"]:
        """The images of batch rows [start, stop) (None when they have none)."""
        first, last = int(self.images_B[:start].sum()), int(self.images_B[:stop].sum())
        if first == last:
            return None
        rows_from, rows_to = int(self.patches_I[:first].sum()), int(self.patches_I[:last].sum())
        grid = self.image_grid_thw[first:last] if self.image_grid_thw is not None else None
        return VisionInputs(pixel_values=self.pixel_values[rows_from:rows_to], patches_I=self.patches_I[first:last],
                            images_B=self.images_B[start:stop], image_grid_thw=grid, image_token_id=self.image_token_id,
                            marks_image_tokens=self.marks_image_tokens)


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
    sampled_by_BT: Optional[torch.Tensor] = None
    """The policy version (optimiser step) that sampled each completion token, aligned with input_ids_BT (int64, -1
    elsewhere and for the policy itself); partial rollouts (generation.partial_rollouts) give one row several."""
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
    # --- vision-language models ---
    vision: Optional[VisionInputs] = None
    """The rows' images, for the model's forward (pixel tensors beside the widened image placeholder tokens)."""
    # --- how the micro-batch runs ---
    prefix_group_B: Optional[torch.Tensor] = None
    """Shared prefix: rows with the same value (int64) share their first prefix_length_B tokens, which the forwards
    compute once (see the module docstring); None: every row computed on its own."""
    prefix_length_B: Optional[torch.Tensor] = None
    """Shared prefix: how many first tokens each row shares with the rest of its group (its own length alone)."""
    padding_free: bool = False
    """Padded layout whose forwards drop the padding (see the module docstring)."""
    filler: bool = False
    """A stand-in micro-batch that keeps collective-bound ranks (ZeRO-3, FSDP) in step when this rank has fewer
    token-budget micro-batches than another: its forward and backward run, its loss and counts weigh 0."""

    def to(self, device: torch.device) -> "Batch":
        vision = self.vision.to(device) if self.vision is not None else None
        return dataclasses.replace(self, vision=vision, **{name: value.to(device) for name, value in self._tensors()})

    def model_inputs(self) -> dict:
        """Keyword arguments for a transformers forward pass (padding-free: the real tokens as one packed row; the
        outputs go through `unpack`)."""
        if self.shares_prefix:
            layout = self.prefix_layout()
            return {"input_ids": layout.input_ids_RW, "position_ids": layout.position_ids_RW,
                    "attention_mask": layout.attention_mask_R1WW()}
        if self.padding_free:
            if self.vision is not None:  # refused at start-up (models/vision.check_vision_recipe): 3-D rope
                raise ValueError("a padding-free forward cannot carry images")
            keep_BT = self.attention_mask_BT.bool()
            slots_N, fill_R, width = _packed_slots(keep_BT)
            rows = fill_R.shape[0]
            # the filler after a packed row's last sequence is a sequence of its own (positions from 0), then dropped
            positions_N = (torch.arange(width, device=keep_BT.device)[None] - fill_R[:, None]).reshape(-1)
            positions_N[slots_N] = (keep_BT.long().cumsum(-1) - 1)[keep_BT]
            ids_N = self.input_ids_BT.new_zeros(rows * width).index_put((slots_N,), self.input_ids_BT[keep_BT])
            return {"input_ids": ids_N.view(rows, width), "position_ids": positions_N.view(rows, width)}
        images = self.vision.model_inputs(self.input_ids_BT) if self.vision is not None else {}
        inputs = {"input_ids": self.input_ids_BT, "attention_mask": self.attention_mask_BT,
                  "position_ids": self.position_ids_BT, **images}
        return {key: value for key, value in inputs.items() if value is not None}

    def unpack(self, x_RW: torch.Tensor) -> torch.Tensor:
        """A forward output over `model_inputs()` ([rows, width, ...]) in this batch's [B, T, ...] layout, 0 at
        padding; as it is when the batch is not padding-free."""
        if self.shares_prefix:  # every token read from its slot: a shared prefix's slots are read by every member
            slot_BT = self.prefix_layout().slot_BT
            x_NX = x_RW.reshape(-1, *x_RW.shape[2:])[slot_BT.clamp(min=0)]
            real = (slot_BT >= 0).view(*slot_BT.shape, *([1] * (x_NX.dim() - 2)))
            return torch.where(real, x_NX, torch.zeros((), dtype=x_NX.dtype, device=x_NX.device))
        if not self.padding_free:
            return x_RW
        keep_BT = self.attention_mask_BT.bool()
        slots_N, _, _ = _packed_slots(keep_BT)
        packed_N = x_RW.reshape(-1, *x_RW.shape[2:])[slots_N]
        return x_RW.new_zeros(*keep_BT.shape, *x_RW.shape[2:]).index_put((keep_BT,), packed_N)

    def pack(self, x_BT: torch.Tensor) -> torch.Tensor:
        """A [B, T, ...] tensor in the layout of `model_inputs()` ([rows, width, ...], 0 at the filler): the inverse
        of `unpack` (per-token inputs a model's hooks need, e.g. models/moe.py's replayed experts)."""
        if self.shares_prefix:  # a shared slot takes its value from one of the rows that read it (all hold the same)
            layout = self.prefix_layout()
            real_BT, (rows, width) = layout.slot_BT >= 0, layout.input_ids_RW.shape
            packed_N = x_BT.new_zeros(rows * width, *x_BT.shape[2:])
            return packed_N.index_put((layout.slot_BT[real_BT],), x_BT[real_BT]).view(rows, width, *x_BT.shape[2:])
        if not self.padding_free:
            return x_BT
        keep_BT = self.attention_mask_BT.bool()
        slots_N, fill_R, width = _packed_slots(keep_BT)
        packed_N = x_BT.new_zeros(fill_R.shape[0] * width, *x_BT.shape[2:]).index_put((slots_N,), x_BT[keep_BT])
        return packed_N.view(fill_R.shape[0], width, *x_BT.shape[2:])

    def model_rows(self, rows_n: torch.Tensor) -> torch.Tensor:
        """Flat rows (b * T + t) of this batch's [B, T] layout -> the same tokens' flat rows in `model_inputs()`'s
        [rows, width] layout (as they are when the batch is not padding-free). Every row must be a real token."""
        if self.shares_prefix:
            return self.prefix_layout().slot_BT.reshape(-1)[rows_n]
        if not self.padding_free:
            return rows_n
        keep_BT = self.attention_mask_BT.bool()
        slots_N, _, _ = _packed_slots(keep_BT)
        return torch.full_like(keep_BT, -1, dtype=torch.long).index_put((keep_BT,), slots_N).reshape(-1)[rows_n]

    @property
    def shares_prefix(self) -> bool:
        """Its forwards compute each group's shared prefix once (the module docstring)."""
        return self.prefix_group_B is not None

    def prefix_layout(self) -> PrefixLayout:
        """The packed rows a shared-prefix batch's forwards run on (ops/shared_prefix.py)."""
        return prefix_layout(self.input_ids_BT, self.attention_mask_BT.bool(), self.prefix_group_B,
                             self.prefix_length_B)

    def forwarded_tokens(self, shared: bool = True) -> int:
        """Tokens one forward of this batch computes: a shared prefix once per group, padding never where the layout
        drops it (padding-free, shared prefix), every position of a padded row otherwise. shared=False: what it
        would compute without its shared prefixes (`shared_prefix/saved_fraction`)."""
        if self.filler:
            return 0
        if self.shares_prefix and shared:
            return self.prefix_layout().forwarded_tokens()
        if self.attention_mask_BT is None:  # packed rows: their filler is computed too
            return self.input_ids_BT.numel()
        if self.padding_free or self.shares_prefix:  # a shared-prefix batch drops its padding as padding-free does
            return int(self.attention_mask_BT.sum())
        return self.input_ids_BT.numel()

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) of a padded batch (for chunked forwards)."""
        size = self.input_ids_BT.shape[0]
        sliced = {name: value[start:stop] for name, value in self._tensors() if value.dim() and value.shape[0] == size}
        vision = self.vision.rows(start, stop) if self.vision is not None else None
        return dataclasses.replace(self, num_sequences=stop - start, vision=vision, **sliced)

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(field name, tensor) of every field that holds a tensor."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return [(name, value) for name, value in values if isinstance(value, torch.Tensor)]


def share_prefixes(batch: Batch) -> Batch:
    """The batch with its shared prefixes found (ops.shared_prefix.prefix_groups), when any row shares enough first
    tokens with another; else as it is (a padded batch only: packed rows have no row structure to share)."""
    if batch.attention_mask_BT is None or batch.filler or batch.vision is not None:  # images are per row
        return batch
    group_B, length_B = prefix_groups(batch.input_ids_BT, batch.attention_mask_BT.bool())
    if len(set(group_B.tolist())) == group_B.shape[0]:  # nothing shared: the plain layout, no mask to build
        return dataclasses.replace(batch, prefix_group_B=None, prefix_length_B=None)
    return dataclasses.replace(batch, prefix_group_B=group_B.to(batch.input_ids_BT.device),
                               prefix_length_B=length_B.to(batch.input_ids_BT.device))


def _packed_slots(keep_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where a padding-free forward puts each real token: rows placed first-fit-decreasing into packed rows of the
    longest row's length. Returns (flat slot in the packed [rows, width] of each real token, in keep_BT's row-major
    order; tokens placed in each packed row; width)."""
    lengths = keep_BT.sum(-1).tolist()
    width = max(max(lengths), 1)
    fill: list[int] = []  # tokens placed in each packed row
    start = [0] * len(lengths)  # each row's first slot
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        row = next((r for r, used in enumerate(fill) if used + lengths[b] <= width), len(fill))
        if row == len(fill):
            fill.append(0)
        start[b] = row * width + fill[row]
        fill[row] += lengths[b]
    slots = [s + t for s, n in zip(start, lengths) for t in range(n)]
    device = keep_BT.device
    return torch.tensor(slots, dtype=torch.long, device=device), torch.tensor(fill, device=device), width
