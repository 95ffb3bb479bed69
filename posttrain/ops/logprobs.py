"""Per-token log-probs and entropies from logits, and masked reductions over tokens.

Alignment (see `posttrain.batch`): every `*_BT` tensor lines up with `input_ids_BT`. The logits at position
t - 1 predict token t, so `token_logprobs(...)[:, t]` is log p(input_ids[:, t] | input_ids[:, :t]) and position 0,
which nothing predicts, is 0. Masks are applied as they are; `completion_mask_BT[:, 0]` is always False.

Memory: a float32 log-softmax over the vocabulary for a whole batch (B*T*V*4 bytes) is often larger than the model.
`token_logprobs` works through the flattened B*T rows `chunk_size` at a time, in float32 whatever the logits dtype,
and keeps only one logsumexp per row for the backward pass, which recomputes each chunk's softmax (a custom
autograd function: plain autograd would keep every chunk's float32 copy alive until backward).

    logits_BTV = model(**batch.model_inputs()).logits
    logprobs_BT = token_logprobs(logits_BTV, batch.input_ids_BT, temperature=1.0)
    nll = -masked_sum(logprobs_BT, batch.completion_mask_BT)
"""

from __future__ import annotations

import torch


def _shift_right(x_BT: torch.Tensor) -> torch.Tensor:
    """Move values computed at position t (about token t + 1) to position t + 1; position 0 becomes 0."""
    return torch.cat([x_BT.new_zeros(x_BT.shape[0], 1), x_BT[:, :-1]], dim=1)


def _next_tokens(input_ids_BT: torch.Tensor) -> torch.Tensor:
    """The token each position's logits predict; the last position predicts nothing (0, dropped by _shift_right)."""
    return torch.cat([input_ids_BT[:, 1:], input_ids_BT.new_zeros(input_ids_BT.shape[0], 1)], dim=1)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits; float64 stays float64 (gradcheck)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _check(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature} (greedy sampling: score at 1.0)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / temperature)[target] row by row in chunks; backward recomputes each chunk's softmax."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, temperature, chunk_size):
        n, dtype = logits_NV.shape[0], _compute_dtype(logits_NV)
        logprobs_N = torch.empty(n, dtype=dtype, device=logits_NV.device)
        logsumexp_N = torch.empty(n, dtype=dtype, device=logits_NV.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            scaled_nV = logits_NV[start:stop].to(dtype) / temperature
            logsumexp_N[start:stop] = torch.logsumexp(scaled_nV, dim=-1)
            target_n = scaled_nV.gather(-1, targets_N[start:stop, None]).squeeze(-1)
            logprobs_N[start:stop] = target_n - logsumexp_N[start:stop]
        ctx.save_for_backward(logits_NV, targets_N, logsumexp_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logprobs_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_N):
        # d logp[target] / d logits = (onehot(target) - softmax) / temperature
        logits_NV, targets_N, logsumexp_N = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        grad_N = grad_N.to(logsumexp_N.dtype)
        for start in range(0, logits_NV.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, logits_NV.shape[0])
            scaled_nV = logits_NV[start:stop].to(logsumexp_N.dtype) / ctx.temperature
            g_n1 = grad_N[start:stop, None]
            chunk_nV = torch.exp(scaled_nV - logsumexp_N[start:stop, None]).mul_(-g_n1)
            chunk_nV.scatter_add_(-1, targets_N[start:stop, None], g_n1)
            grad_NV[start:stop] = chunk_nV.div_(ctx.temperature)
        return grad_NV, None, None, None


def token_logprobs(
    logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """log p(token t | tokens < t) at each position t, position 0 = 0 -> logprobs_BT (float32; float64 stays so).

    Computed as target logit minus logsumexp, on logits divided by `temperature`, `chunk_size` rows of the
    flattened B*T at a time, so no (B, T, V) float32 tensor is made, forward or backward. The temperature must be
    the sampling temperature when the log-probs are compared with the sampler's (GRPO importance ratios).
    """
    _check(temperature, chunk_size)
    batch, length, vocab = logits_BTV.shape
    logprobs_N = _ChunkedTokenLogprobs.apply(
        logits_BTV.reshape(batch * length, vocab), _next_tokens(input_ids_BT).reshape(-1), temperature, chunk_size
    )
    return _shift_right(logprobs_N.view(batch, length))


def entropy_BT(logits_BTV: torch.Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution that predicts token t, at position t (position 0 = 0) -> entropy_BT.

    H = logsumexp(x) - sum(softmax(x) * x) with x = logits / temperature, chunked over the flattened rows. Meant as a
    metric (call under torch.no_grad()); with gradients, autograd keeps each chunk's float32 intermediates. float32
    math whatever the logits dtype, like token_logprobs.
    """
    _check(temperature, chunk_size)
    batch, length, vocab = logits_BTV.shape
    logits_NV = logits_BTV.reshape(batch * length, vocab)
    chunks = []
    for start in range(0, logits_NV.shape[0], chunk_size):
        scaled_nV = logits_NV[start : start + chunk_size].to(_compute_dtype(logits_NV)) / temperature
        logsumexp_n = torch.logsumexp(scaled_nV, dim=-1)
        probs_nV = torch.exp(scaled_nV - logsumexp_n[:, None])
        chunks.append(logsumexp_n - (probs_nV * scaled_nV).sum(-1))
    return _shift_right(torch.cat(chunks).view(batch, length))


def masked_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Sum of x where mask is true -> scalar. Uses where, not multiply, so inf/nan under the mask cannot leak."""
    return torch.where(mask_BT.bool(), x_BT, 0).sum()


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of x over the masked positions -> scalar; 0 when the mask is empty."""
    return masked_sum(x_BT, mask_BT) / mask_BT.sum().clamp(min=1)


def sequence_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-row sum of x over the masked positions -> x_B (padded layout: one sequence per row)."""
    return torch.where(mask_BT.bool(), x_BT, 0).sum(-1)


def sequence_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x over the masked positions -> x_B; 0 for a row with an empty mask."""
    return sequence_sum(x_BT, mask_BT) / mask_BT.sum(-1).clamp(min=1)


def segment_sum(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, sequence_index_BT: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """Packed layout: sum of x over the masked tokens of each sequence -> x_S (S = num_sequences).

    `sequence_index_BT` numbers the packed sequences 0..S-1 (-1 for tokens of none); works for any B.
    """
    keep_BT = mask_BT.bool() & (sequence_index_BT >= 0)
    values_N = torch.where(keep_BT, x_BT, 0).reshape(-1)
    index_N = sequence_index_BT.clamp(min=0).reshape(-1)
    return x_BT.new_zeros(num_sequences).index_add(0, index_N, values_N)
