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


def shift_right(x_BT: torch.Tensor) -> torch.Tensor:
    """Move values computed at position t (about token t + 1) to position t + 1; position 0 becomes 0."""
    return torch.cat([x_BT.new_zeros(x_BT.shape[0], 1), x_BT[:, :-1]], dim=1)


def next_tokens(input_ids_BT: torch.Tensor) -> torch.Tensor:
    """The token each position's logits predict; the last position predicts nothing (0, dropped by shift_right)."""
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


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 1024) -> torch.Tensor:
    """log p(token t | tokens < t) at each position t, position 0 = 0 -> logprobs_BT (float32; float64 stays so).

    Computed as target logit minus logsumexp, on logits divided by `temperature`, `chunk_size` rows of the
    flattened B*T at a time, so no (B, T, V) float32 tensor is made, forward or backward. The temperature must be
    the sampling temperature when the log-probs are compared with the sampler's (GRPO importance ratios).
    """
    return shift_right(next_token_logprobs(logits_BTV, next_tokens(input_ids_BT), temperature, chunk_size))


def next_token_logprobs(logits_BTV: torch.Tensor, next_ids_BT: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int = 1024) -> torch.Tensor:
    """log p(next_ids[t] | tokens <= t) at position t, unshifted: `token_logprobs` for a slice of a row whose next
    tokens come from beyond it (sequence parallelism: a shard's last position predicts the next shard's first)."""
    _check(temperature, chunk_size)
    batch, length, vocab = logits_BTV.shape
    logprobs_N = _ChunkedTokenLogprobs.apply(logits_BTV.reshape(batch * length, vocab), next_ids_BT.reshape(-1),
                                             temperature, chunk_size)
    return logprobs_N.view(batch, length)


class _LinearTokenLogprobs(torch.autograd.Function):
    """log_softmax((hidden @ weight.T) / temperature)[target], `chunk_size` rows at a time: the (N, V) logits exist
    one chunk at a time, forward and backward (which recomputes them). Matmuls run in the autocast state of the
    forward, as the model's own lm_head would; softmax math is float32. From the same chunks, on request, two
    detached metrics: the entropy, and whether the target is the argmax (`top1`: TRL's mean_token_accuracy)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, chunk_size, with_entropy=False, with_top1=False):
        device_type = hidden_NH.device.type
        autocast = device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        n, dtype = hidden_NH.shape[0], _compute_dtype(hidden_NH)
        logprobs_N = torch.empty(n, dtype=dtype, device=hidden_NH.device)
        logsumexp_N = torch.empty(n, dtype=dtype, device=hidden_NH.device)
        entropy_N = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden_NH.device)
        top1_N = torch.empty(n if with_top1 else 0, dtype=torch.bool, device=hidden_NH.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            scaled_nV = _scaled_logits(hidden_NH[start:stop], weight_VH, dtype, temperature)
            logsumexp_N[start:stop] = torch.logsumexp(scaled_nV, dim=-1)
            logprobs_N[start:stop] = scaled_nV.gather(-1, targets_N[start:stop, None]).squeeze(-1) - logsumexp_N[start:stop]
            if with_top1:  # argmax's first index on ties, as TRL's is_top1: n ids, no (n, V) tensor
                top1_N[start:stop] = scaled_nV.argmax(-1) == targets_N[start:stop]
            if with_entropy:  # H = -sum p log p from the same chunk: the logits are not made again for the metric
                logp_nV = scaled_nV.sub_(logsumexp_N[start:stop, None])
                entropy_N[start:stop] = -(torch.exp(logp_nV) * logp_nV).sum(-1)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, logsumexp_N)
        ctx.temperature, ctx.chunk_size, ctx.autocast = temperature, chunk_size, autocast
        ctx.mark_non_differentiable(entropy_N, top1_N)
        return logprobs_N, entropy_N, top1_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_N, _grad_entropy_N, _grad_top1_N):
        hidden_NH, weight_VH, targets_N, logsumexp_N = ctx.saved_tensors
        device_type, enabled, autocast_dtype = ctx.autocast
        grad_hidden_NH = torch.empty_like(hidden_NH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_N = grad_N.to(logsumexp_N.dtype)
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=enabled):
            for start in range(0, hidden_NH.shape[0], ctx.chunk_size):
                stop = min(start + ctx.chunk_size, hidden_NH.shape[0])
                hidden_nH = hidden_NH[start:stop]
                scaled_nV = _scaled_logits(hidden_nH, weight_VH, logsumexp_N.dtype, ctx.temperature)
                g_n1 = grad_N[start:stop, None]
                # d logp[target] / d logits = (onehot(target) - softmax) / temperature; in place: one chunk buffer
                dlogits_nV = scaled_nV.sub_(logsumexp_N[start:stop, None]).exp_().mul_(-g_n1)
                dlogits_nV.scatter_add_(-1, targets_N[start:stop, None], g_n1)
                dlogits_nV.div_(ctx.temperature)
                if not enabled:  # autocast picks the matmul dtype itself; without it, the operands' dtype
                    dlogits_nV = dlogits_nV.to(weight_VH.dtype)
                if grad_hidden_NH is not None:
                    grad_hidden_NH[start:stop] = (dlogits_nV @ weight_VH).to(hidden_NH.dtype)
                if grad_weight_VH is not None:
                    grad_weight_VH += (dlogits_nV.t() @ hidden_nH).float()
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_NH, grad_weight_VH, None, None, None, None, None


def _scaled_logits(hidden_nH: torch.Tensor, weight_VH: torch.Tensor, dtype: torch.dtype, temperature: float):
    """(hidden @ weight.T) / temperature in `dtype`, divided in place: the matmul's output is a fresh buffer."""
    logits_nV = (hidden_nH @ weight_VH.t()).to(dtype)
    return logits_nV.div_(temperature) if temperature != 1.0 else logits_nV


LINEAR_CHUNK_ELEMENTS = 2**25
"""Logits elements per chunk of `linear_token_logprobs` (128 MiB of float32): ~220 rows for a 150k vocabulary."""


def linear_token_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, input_ids_BT: torch.Tensor,
                          temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """`token_logprobs(hidden_BTH @ weight_VH.T, input_ids_BT, temperature)` without ever making the logits.

    The output layer (lm_head, no bias) and the log-softmax are fused and chunked over the flattened B*T rows, forward
    and backward, so neither the (B, T, V) logits nor their gradient exist: for a 150k vocabulary that is the largest
    tensor of a training step. `chunk_size` rows at a time (default: about LINEAR_CHUNK_ELEMENTS logits per chunk).
    """
    return shift_right(linear_next_token_logprobs(hidden_BTH, weight_VH, next_tokens(input_ids_BT), temperature,
                                                  chunk_size))


def linear_next_token_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, next_ids_BT: torch.Tensor,
                               temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """`linear_token_logprobs` unshifted, given the token each position predicts (see `next_token_logprobs`)."""
    return linear_next_token_logprobs_entropy(hidden_BTH, weight_VH, next_ids_BT, temperature, chunk_size, False)[0]


def linear_token_logprobs_entropy(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, input_ids_BT: torch.Tensor,
                                  temperature: float = 1.0, chunk_size: int | None = None, with_entropy: bool = True,
                                  mask_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear_token_logprobs` and, from the same logits chunks, `entropy_BT` of each position's next-token
    distribution (a detached metric, as entropy_BT computes it from the logits) -> (logprobs_BT, entropy_BT or None).
    `mask_BT`: only the positions it marks are scored (0 elsewhere): the output layer never runs on the rows that
    predict the others (a prompt's tokens, padding), forward or backward.
    """
    logprobs, entropy = linear_next_token_logprobs_entropy(hidden_BTH, weight_VH, next_tokens(input_ids_BT),
                                                           temperature, chunk_size, with_entropy,
                                                           None if mask_BT is None else next_tokens(mask_BT))
    return shift_right(logprobs), (shift_right(entropy) if with_entropy else None)


def linear_next_token_logprobs_entropy(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, next_ids_BT: torch.Tensor,
                                       temperature: float = 1.0, chunk_size: int | None = None,
                                       with_entropy: bool = True, next_mask_BT: torch.Tensor | None = None):
    """`linear_token_logprobs_entropy` unshifted: `next_ids_BT` and `next_mask_BT` are about the token each position
    predicts (see `next_token_logprobs`)."""
    return linear_next_token_stats(hidden_BTH, weight_VH, next_ids_BT, temperature, chunk_size, with_entropy,
                                   next_mask_BT=next_mask_BT)[:2]


def linear_next_token_stats(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, next_ids_BT: torch.Tensor,
                            temperature: float = 1.0, chunk_size: int | None = None, with_entropy: bool = False,
                            with_top1: bool = False, next_mask_BT: torch.Tensor | None = None):
    """(logprobs_BT, entropy_BT or None, top1_BT or None), unshifted, from the same logits chunks: top1 says whether
    the token each position predicts is the argmax of its distribution (bool; TRL's is_top1, the numerator of its
    mean_token_accuracy). With `next_mask_BT`, only the positions it marks are scored (0 / False elsewhere)."""
    batch, length, hidden = hidden_BTH.shape
    chunk_size = chunk_size or max(1, LINEAR_CHUNK_ELEMENTS // weight_VH.shape[0])
    _check(temperature, chunk_size)
    hidden_NH, targets_N = hidden_BTH.reshape(batch * length, hidden), next_ids_BT.reshape(-1)
    if next_mask_BT is not None:  # the rows whose logits predict a marked token
        rows_n = next_mask_BT.reshape(-1).bool().nonzero().squeeze(-1)
        hidden_NH, targets_N = hidden_NH[rows_n], targets_N[rows_n]
    outputs = _LinearTokenLogprobs.apply(hidden_NH, weight_VH, targets_N, temperature, chunk_size, with_entropy,
                                         with_top1)
    wanted = (True, with_entropy, with_top1)
    if next_mask_BT is not None:
        outputs = [x_n.new_zeros(batch * length).index_put((rows_n,), x_n) if want else x_n
                   for x_n, want in zip(outputs, wanted)]
    return tuple(x_N.view(batch, length) if want else None for x_N, want in zip(outputs, wanted))



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
    return shift_right(torch.cat(chunks).view(batch, length))


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


def segment_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor, sequence_index_BT: torch.Tensor,
                num_sequences: int) -> torch.Tensor:
    """Packed layout: sum of x over the masked tokens of each sequence -> x_S (S = num_sequences).

    `sequence_index_BT` numbers the packed sequences 0..S-1 (-1 for tokens of none); works for any B.
    """
    keep_BT = mask_BT.bool() & (sequence_index_BT >= 0)
    values_N = torch.where(keep_BT, x_BT, 0).reshape(-1)
    index_N = sequence_index_BT.clamp(min=0).reshape(-1)
    return x_BT.new_zeros(num_sequences).index_add(0, index_N, values_N)
