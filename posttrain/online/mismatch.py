"""Trainer-engine mismatch of a generation batch, measured where an engine samples apart from the trainer (vllm,
server): the trainer's log-probs of the sampled tokens (pi_old, taken when the batch is first trained) against the
engine's own, over the step's completion tokens on every rank.

    metrics.update(engine_mismatch(batches, algorithm.clip_range(), backend.data_all_gather_object))

Besides ops.mismatch's figures: mismatch/phantom_clip_fraction, the share of completion tokens the clipped surrogate
would clip at the batch's first optimiser step if the engine's log-probs stood in for pi_old (as a trainer that does
not recompute them does): clipping that no update caused (TRL's note on it measured ~18% with a bf16 engine against
an fp32 trainer). Here pi_old is the trainer's own, so this is what the importance correction
(algo.vllm_is_correction) is there to absorb, not a clip this run applies.
"""

from __future__ import annotations

from typing import Callable

import torch

from posttrain.batch import Batch
from posttrain.losses.policy import clipped_surrogate
from posttrain.ops.mismatch import mismatch_figures


def _local(batches: list[Batch], clip_range: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """This rank's completion tokens: (trainer_N, sampler_N, phantom-clipped tokens, tokens)."""
    trainer, sampler, clipped, tokens = [], [], 0.0, 0
    for b in batches:
        if b.filler or b.old_logprobs_BT is None or b.sampler_logprobs_BT is None:
            continue
        mask_BT = b.completion_mask_BT.bool()
        count = int(mask_BT.sum())
        if count == 0:
            continue
        old_BT, sampler_BT = b.old_logprobs_BT.float(), b.sampler_logprobs_BT.float().to(b.old_logprobs_BT.device)
        trainer.append(old_BT[mask_BT].cpu())
        sampler.append(sampler_BT[mask_BT].cpu())
        advantages = b.advantages_B if b.advantages_B is not None else b.advantages_BT
        if advantages is not None:
            _, fraction = clipped_surrogate(old_BT, sampler_BT, advantages.float(), mask_BT, *clip_range)
            clipped += float(fraction) * count
        tokens += count
    empty = torch.zeros(0)
    return (torch.cat(trainer) if trainer else empty, torch.cat(sampler) if sampler else empty, clipped, tokens)


def engine_mismatch(batches: list[Batch], clip_range: tuple[float, float],
                    gather: Callable[[object], list]) -> dict[str, float]:
    """The step's mismatch figures over every rank's completion tokens (`gather`: the backend's all_gather_object
    over data ranks; every rank calls this). {} where no batch carries both log-probs."""
    everyone = gather(_local(batches, clip_range))
    trainer_N = torch.cat([part[0] for part in everyone])
    sampler_N = torch.cat([part[1] for part in everyone])
    figures = {k: float(v) for k, v in mismatch_figures(trainer_N, sampler_N).items()}
    tokens = sum(part[3] for part in everyone)
    if figures and tokens:
        figures["mismatch/phantom_clip_fraction"] = sum(part[2] for part in everyone) / tokens
    return figures
