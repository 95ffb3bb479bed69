"""Knowledge-distillation objectives: a per-token divergence between the student's and the teacher's next-token
distributions, both at `temperature` (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language Models").

    out = distill_loss(student_logits_BTV, teacher_logits_BTV, input_ids_BT, completion_mask_BT, beta, temperature)
    loss = masked_sum(out.loss_BT, completion_mask_BT) / normaliser          # normaliser: the step's completion tokens

`beta` picks the divergence exactly as TRL's GKD / DistillationTrainer do (its generalized_jsd_loss docstring):
0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher), anything between the generalised JSD
    JSD_beta = beta * KL(teacher || m) + (1 - beta) * KL(student || m),   m = beta * teacher + (1 - beta) * student
(the endpoints are defined as those KLs, not as the limits of JSD_beta, which go to 0).

Full vocabulary, chunked: the log-softmax of both models is taken `chunk_size` completion positions at a time, in a
custom autograd function whose backward recomputes each chunk from the logits, so no (B, T, V) float32 log-softmax
exists, forward or backward, beyond one chunk; the gradient is exact (d divergence / d student logits, in closed
form per variant, checked against autograd in tests/unit/test_losses_distill.py). Positions outside the completion
mask are never computed.

Top-k (`topk_distill_loss`, a teacher behind a server that returns its k most likely tokens per position): both
distributions are restricted to the teacher's top-k tokens and renormalised there. That is an APPROXIMATION of the
full-vocabulary divergence (the mass outside the teacher's top k is ignored); it is exact when the teacher puts all
its mass on k tokens. TRL's server distillation does the same without its tail bucket.

Alignment is posttrain.batch's: `*_BT` line up with input_ids_BT; position t is about the distribution that
predicts token t (the logits at t - 1), and position 0 is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from posttrain.ops.logprobs import LINEAR_CHUNK_ELEMENTS, _compute_dtype, next_tokens, shift_right, token_logprobs


def _kl(logp_a_nV: torch.Tensor, logp_b_nV: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row; a token with a = 0 contributes 0 (even where b = 0 too, as in a top-k support)."""
    terms = torch.exp(logp_a_nV) * (logp_a_nV - logp_b_nV)
    return torch.where(torch.isneginf(logp_a_nV), 0.0, terms).sum(-1)


def _mixture(student_nV: torch.Tensor, teacher_nV: torch.Tensor, beta: float) -> torch.Tensor:
    """log m with m = beta * teacher + (1 - beta) * student (GKD's mixture, TRL's convention)."""
    return torch.logaddexp(student_nV + math.log1p(-beta), teacher_nV + math.log(beta))


def forward_kl(student_nV, teacher_nV, beta) -> torch.Tensor:
    """KL(teacher || student): mass-covering; supervised KD (Hinton et al. 2015) when the data is not sampled."""
    return _kl(teacher_nV, student_nV)


def reverse_kl(student_nV, teacher_nV, beta) -> torch.Tensor:
    """KL(student || teacher): mode-seeking; on-policy distillation's usual objective."""
    return _kl(student_nV, teacher_nV)


def generalized_jsd(student_nV, teacher_nV, beta) -> torch.Tensor:
    """beta * KL(teacher || m) + (1 - beta) * KL(student || m), m = beta * teacher + (1 - beta) * student."""
    mixture_nV = _mixture(student_nV, teacher_nV, beta)
    return beta * _kl(teacher_nV, mixture_nV) + (1 - beta) * _kl(student_nV, mixture_nV)


def _forward_kl_grad(student_nV, teacher_nV, value_n, beta) -> torch.Tensor:
    return torch.exp(student_nV) - torch.exp(teacher_nV)


def _reverse_kl_grad(student_nV, teacher_nV, value_n, beta) -> torch.Tensor:
    return torch.exp(student_nV) * (student_nV - teacher_nV - value_n[:, None])


def _jsd_grad(student_nV, teacher_nV, value_n, beta) -> torch.Tensor:
    # d/dp_s of the JSD is (1 - beta) * (log p_s - log m); through the softmax: p_s * (g - E_{p_s}[g])
    mixture_nV = _mixture(student_nV, teacher_nV, beta)
    kl_student_n = _kl(student_nV, mixture_nV)
    return (1 - beta) * torch.exp(student_nV) * (student_nV - mixture_nV - kl_student_n[:, None])


@dataclass(frozen=True)
class Divergence:
    """One divergence between next-token distributions given as log-probs over the last dimension."""

    value: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(student_logp_nV, teacher_logp_nV, beta) -> divergence_n; differentiable (the top-k path uses autograd)."""
    student_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(student_logp_nV, teacher_logp_nV, divergence_n, beta) -> d divergence_n / d (student logits / temperature)."""


DIVERGENCES: dict[str, Divergence] = {
    "forward_kl": Divergence(forward_kl, _forward_kl_grad),
    "reverse_kl": Divergence(reverse_kl, _reverse_kl_grad),
    "jsd": Divergence(generalized_jsd, _jsd_grad),
}


def divergence_name(beta: float) -> str:
    """TRL's convention: beta 0 -> forward_kl, 1 -> reverse_kl, in between -> jsd."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return {0.0: "forward_kl", 1.0: "reverse_kl"}.get(float(beta), "jsd")


class DistillOutput(NamedTuple):
    """Per-token loss and detached per-token metrics, all aligned with input_ids_BT (0 outside the mask)."""

    loss_BT: torch.Tensor
    metrics_BT: dict[str, torch.Tensor]
    """forward_kl, reverse_kl, top1_agreement (1.0 when both argmaxes agree), teacher_logprob and student_logprob
    of the token in the sequence (sampled on-policy, or the data's)."""


METRICS = ("forward_kl", "reverse_kl", "top1_agreement", "teacher_logprob", "student_logprob")


def _chunk_logprobs(logits_nV: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits_nV.to(_compute_dtype(logits_nV)) / temperature, -1)


class _ChunkedDivergence(torch.autograd.Function):
    """divergence_n and metrics_n5 of the student's logits rows `rows_n` against the teacher's logits of those rows
    (teacher_nV), `chunk_size` rows at a time; backward recomputes each chunk's log-softmax and applies the variant's
    closed-form gradient."""

    @staticmethod
    def forward(ctx, student_NV, teacher_nV, rows_n, targets_n, divergence, beta, temperature, chunk_size):
        dtype = _compute_dtype(student_NV)
        value_n = torch.empty(rows_n.shape[0], dtype=dtype, device=student_NV.device)
        metrics_n5 = torch.empty(rows_n.shape[0], len(METRICS), dtype=dtype, device=student_NV.device)
        for start in range(0, rows_n.shape[0], chunk_size):
            stop = min(start + chunk_size, rows_n.shape[0])
            student_nV = _chunk_logprobs(student_NV[rows_n[start:stop]], temperature)
            teacher_cV = _chunk_logprobs(teacher_nV[start:stop], temperature).to(dtype)
            value_n[start:stop] = divergence.value(student_nV, teacher_cV, beta)
            target_n1 = targets_n[start:stop, None]
            metrics_n5[start:stop] = torch.stack([
                _kl(teacher_cV, student_nV), _kl(student_nV, teacher_cV),
                (student_nV.argmax(-1) == teacher_cV.argmax(-1)).to(dtype),
                teacher_cV.gather(-1, target_n1).squeeze(-1), student_nV.gather(-1, target_n1).squeeze(-1),
            ], dim=-1)
        ctx.save_for_backward(student_NV, teacher_nV, rows_n, value_n)
        ctx.divergence, ctx.beta, ctx.temperature, ctx.chunk_size = divergence, beta, temperature, chunk_size
        ctx.mark_non_differentiable(metrics_n5)
        return value_n, metrics_n5

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_value_n, grad_metrics):
        student_NV, teacher_nV, rows_n, value_n = ctx.saved_tensors
        grad_NV = torch.zeros_like(student_NV)
        for start in range(0, rows_n.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, rows_n.shape[0])
            student_nV = _chunk_logprobs(student_NV[rows_n[start:stop]], ctx.temperature)
            teacher_cV = _chunk_logprobs(teacher_nV[start:stop], ctx.temperature).to(student_nV.dtype)
            grad_nV = ctx.divergence.student_grad(student_nV, teacher_cV, value_n[start:stop], ctx.beta)
            scale_n1 = grad_value_n[start:stop, None].to(grad_nV.dtype) / ctx.temperature
            grad_NV[rows_n[start:stop]] = (grad_nV * scale_n1).to(grad_NV.dtype)
        return grad_NV, None, None, None, None, None, None, None


def _predicting_rows(completion_mask_BT: torch.Tensor) -> torch.Tensor:
    """Flat row indices (b * T + t - 1) of the logits that predict each completion token (b, t), in row order."""
    return next_tokens(completion_mask_BT).reshape(-1).bool().nonzero().squeeze(-1)


def _scatter_BT(values_n: torch.Tensor, rows_n: torch.Tensor, shape) -> torch.Tensor:
    """Values of the predicting rows -> a (B, T) tensor aligned with input_ids (shifted right, 0 elsewhere)."""
    flat = values_n.new_zeros(shape[0] * shape[1]).index_put((rows_n,), values_n)
    return shift_right(flat.view(shape))


def distill_loss(student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor,
                 completion_mask_BT: torch.Tensor, beta: float, temperature: float = 1.0,
                 chunk_size: int | None = None) -> DistillOutput:
    """GKD's per-token divergence over the full vocabulary (Agarwal et al. 2024; variant by `beta`, see the module
    docstring) -> DistillOutput. The teacher's logits get no gradient. `chunk_size` completion positions at a time
    (default: about LINEAR_CHUNK_ELEMENTS logits per chunk)."""
    if student_logits_BTV.shape != teacher_logits_BTV.shape:
        raise ValueError(f"student logits {tuple(student_logits_BTV.shape)} and teacher logits "
                         f"{tuple(teacher_logits_BTV.shape)} differ: the models must share a vocabulary")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch, length, vocab = student_logits_BTV.shape
    chunk_size = chunk_size or max(1, LINEAR_CHUNK_ELEMENTS // vocab)
    rows_n = _predicting_rows(completion_mask_BT)
    targets_n = next_tokens(input_ids_BT).reshape(-1)[rows_n]
    # only the teacher's completion rows outlive this call (kept for the backward pass): not its whole (B, T, V)
    teacher_nV = teacher_logits_BTV.detach().reshape(batch * length, vocab)[rows_n]
    divergence = DIVERGENCES[divergence_name(beta)]
    value_n, metrics_n5 = _ChunkedDivergence.apply(student_logits_BTV.reshape(batch * length, vocab), teacher_nV,
                                                   rows_n, targets_n, divergence, float(beta), temperature, chunk_size)
    metrics = {name: _scatter_BT(metrics_n5[:, i], rows_n, (batch, length)) for i, name in enumerate(METRICS)}
    return DistillOutput(_scatter_BT(value_n, rows_n, (batch, length)), metrics)


def topk_distill_loss(student_logits_BTV: torch.Tensor, teacher_topk_logprobs_BTK: torch.Tensor,
                      teacher_topk_ids_BTK: torch.Tensor, input_ids_BT: torch.Tensor, completion_mask_BT: torch.Tensor,
                      beta: float, temperature: float = 1.0) -> DistillOutput:
    """The divergence over the teacher's top-k tokens, both distributions renormalised there: an approximation (see
    the module docstring). `teacher_topk_*_BTK` are aligned with input_ids_BT (position t: the teacher's k most
    likely tokens for token t and their log-probs at temperature 1, as vLLM returns them; `temperature` is applied
    here, exactly: over a fixed support the normaliser cancels). Autograd through (B, T, K) tensors only. Metrics:
    forward_kl, reverse_kl (over the support), top1_agreement (the student's full-vocabulary argmax is the teacher's
    top token) and student_logprob (full vocabulary)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    mask_BT = completion_mask_BT.bool()
    # the logits at t - 1 predict token t: gather the teacher's support from them, never shifting the (B, T, V) logits
    ids_BTK = teacher_topk_ids_BTK[:, 1:]
    gathered_BTK = student_logits_BTV[:, :-1].gather(-1, ids_BTK)
    gathered_BTK = torch.cat([gathered_BTK[:, :1], gathered_BTK], dim=1)  # position 0 predicts nothing (masked)
    student_BTK = _chunk_logprobs(gathered_BTK, temperature)
    teacher_BTK = torch.log_softmax(teacher_topk_logprobs_BTK.to(student_BTK.dtype) / temperature, -1)
    value = DIVERGENCES[divergence_name(beta)].value
    loss_BT = value(student_BTK.flatten(0, 1), teacher_BTK.flatten(0, 1), float(beta)).view(mask_BT.shape)
    loss_BT = torch.where(mask_BT, loss_BT, 0.0)
    with torch.no_grad():
        top_teacher_BT = teacher_topk_ids_BTK.gather(-1, teacher_BTK.argmax(-1, keepdim=True)).squeeze(-1)
        metrics = {
            "forward_kl": _kl(teacher_BTK, student_BTK.detach()),
            "reverse_kl": _kl(student_BTK.detach(), teacher_BTK),
            "top1_agreement": (shift_right(student_logits_BTV.argmax(-1)) == top_teacher_BT).float(),
            "student_logprob": token_logprobs(student_logits_BTV.detach(), input_ids_BT, temperature),
        }
        metrics = {k: torch.where(mask_BT, v, 0.0) for k, v in metrics.items()}
    return DistillOutput(loss_BT, metrics)
