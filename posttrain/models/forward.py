"""Forward passes shared by algorithms: a batch through a causal LM -> per-token log-probs (and entropy).

`policy_logprobs` never makes the (B, T, V) logits when the model's output layer is a plain bias-free Linear whose
output the model returns untouched (the architectures in FUSED_HEAD_MODELS): for the duration of the forward the
output layer's `forward` is swapped for `ops.logprobs.linear_token_logprobs`, which takes the hidden states and the
layer's own weight, so the model returns log-probs where it would return logits. The swap is on the module
instance, so every engine's hooks around that module (ZeRO-3 gathering its weight, FSDP2 unsharding) still run.
Other architectures (logit soft-capping or scaling after the head, a LoRA-wrapped head) take the logits path.
With gradients, the gated MLPs and RMSNorms keep fewer activations for the backward (models/lean_activations.py:
the same gradients, bit for bit).

Under sequence parallelism (distributed/sequence_parallel.py) every forward here runs this rank's slice of each row
and gathers the per-token result over the group, so callers see [B, T] as without it. Log-probs are taken per
slice against the next tokens of the whole row (a slice's last position predicts the next slice's first token),
so only [B, T] floats are gathered, never logits, on the fused path.

A shared-prefix batch (`Batch.shares_prefix`, train.shared_prefix) runs its groups' packed rows once; its next-token
log-probs are taken at the distinct (predicting slot, token) pairs of ops.shared_prefix.predictions, so a prefix's
tokens reach the output layer once per group, not once per row (`_shared_logprobs`).
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.batch import Batch
from posttrain.distributed import sequence_parallel
from posttrain.distributed.wrappers import plain_class, unwrap_module
from posttrain.models.lean_activations import lean_activations
from posttrain.models.load import FP32_HEAD
from posttrain.ops.logprobs import (entropy_BT, linear_next_token_logprobs_entropy, linear_next_token_stats,
                                   next_token_logprobs, next_tokens, shift_right, token_logprobs)
from posttrain.ops.shared_prefix import predictions

FUSED_HEAD_MODELS = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3", "qwen2_moe", "qwen3_moe", "olmo2"})
"""Model types whose causal-LM forward returns `lm_head(hidden)` as the logits, with nothing applied after it."""


def policy_logits(model, batch: Batch) -> torch.Tensor:
    """logits_BTV of a causal LM for the batch (padded, packed or padding-free layout)."""
    return per_token(model, batch, lambda out: out.logits)


def per_token(model, batch: Batch, read) -> torch.Tensor:
    """`read(model output)` over the batch's tokens as [B, T, ...]: the padding-free forward unpacked, or under
    sequence parallelism this rank's slices gathered over the group. Every forward here keeps lean activations (the
    policy's logits path and the critic's values alike)."""
    sp = sequence_parallel.current()
    if sp is None:
        with lean_activations(model):
            return batch.unpack(read(model(**batch.model_inputs(), use_cache=False)))
    with sp.attention(), lean_activations(model):
        out_BC = read(model(**sp.shard_inputs(batch.input_ids_BT), use_cache=False))
    return sp.gather(out_BC, batch.input_ids_BT.shape[1])


def policy_logits_at(model, batch: Batch, rows_n: torch.Tensor) -> torch.Tensor:
    """logits_nV of the flat rows `rows_n` (b * T + t of the batch's padded layout; real tokens) only: with a
    fusable head the output layer projects just those rows' hidden states (its own forward, so autocast and engine
    hooks apply as usual; a padding-free batch's rows found in its packed layout), so the other rows' logits and
    their gradient never exist; else (sequence parallel, other heads) the full logits, indexed."""
    head = fusable_head(model)
    if head is None or sequence_parallel.current() is not None:
        logits_BTV = policy_logits(model, batch)
        return logits_BTV.reshape(-1, logits_BTV.shape[-1])[rows_n]
    model_rows_n = batch.model_rows(rows_n)

    def forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
        return torch.nn.Linear.forward(head, hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[model_rows_n])

    with _head_forward(head, forward), lean_activations(model):
        return model(**batch.model_inputs(), use_cache=False).logits


def policy_logprobs_entropy(model, batch: Batch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """policy_logprobs and the entropy_BT of each position's next-token distribution (detached: a metric), from one
    forward, right at the completion positions: with a fusable head (no sequence parallelism) both come from the same
    logits chunks, only of the rows that predict a completion token (0 elsewhere), so the (B, T, V) logits never
    exist and the output layer skips the prompts and the padding; otherwise from the logits, at every position."""
    if batch.shares_prefix:
        return _shared_logprobs(model, batch, temperature, batch.completion_mask_BT, with_entropy=True)[:2]
    head = fusable_head(model)
    if head is None or sequence_parallel.current() is not None:
        logits_BTV = policy_logits(model, batch)
        with torch.no_grad():
            entropy = entropy_BT(logits_BTV.detach(), temperature=temperature)
        return token_logprobs(logits_BTV, batch.input_ids_BT, temperature=temperature), entropy
    inputs = batch.model_inputs()
    mask = next_tokens(batch.pack(batch.completion_mask_BT))
    entropies = []

    def forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
        next_ids = next_tokens(inputs["input_ids"])
        logprobs, entropy = linear_next_token_logprobs_entropy(hidden_BTH, head.weight, next_ids, temperature,
                                                               next_mask_BT=mask)
        entropies.append(entropy)
        return logprobs

    with _head_forward(head, forward), lean_activations(model):
        logprobs = shift_right(model(**inputs, use_cache=False).logits)
    entropy = shift_right(entropies[0])
    if not batch.padding_free:
        return logprobs, entropy
    return _unpacked(batch, logprobs), _unpacked(batch, entropy)


def _unpacked(batch: Batch, values) -> torch.Tensor:
    """Packed per-token values -> (B, T), each row's position 0 (a prediction from the previous row) set to 0."""
    values_BT = batch.unpack(values)
    return torch.cat([values_BT.new_zeros(values_BT.shape[0], 1), values_BT[:, 1:]], dim=1)


def policy_logprobs(model, batch: Batch, temperature: float = 1.0,
                    mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """logprobs_BT aligned with input_ids_BT (position 0 is 0): log p(token t | tokens < t). A padding-free batch
    is scored packed (the logits never exist for padding) and unpacked: each row's position 0, which in the packed
    row holds a prediction from the previous row's last token, is set back to 0. `mask_BT`: the loss reads only
    these tokens (SFT's and DPO's completion tokens), so a fusable head projects only the rows that predict them,
    forward and backward, and the others are 0 (the prompt's rows skip the output layer, as GRPO's do)."""
    if batch.shares_prefix:
        want_BT = batch.attention_mask_BT if mask_BT is None else mask_BT
        return _shared_logprobs(model, batch, temperature, want_BT, with_entropy=False)[0]
    return _logprobs_top1(model, batch, temperature, with_top1=False, mask_BT=mask_BT)[0]


def policy_logprobs_top1(model, batch: Batch, mask_BT: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """policy_logprobs (temperature 1) and top1_BT: whether token t is the argmax of the distribution that predicts
    it (bool; position 0 False), TRL's is_top1, whose mean over the loss tokens is SFT's mean_token_accuracy. One
    forward; with a fusable head the argmax comes from the same logits chunks as the log-probs, so no (B, T, V) tensor
    exists, as for policy_logprobs (and with `mask_BT` only the rows that predict its tokens are projected; a
    shared-prefix batch, SFT rows that start alike, scores the tokens `mask_BT` marks, all of them without one)."""
    if batch.shares_prefix:
        want_BT = batch.attention_mask_BT if mask_BT is None else mask_BT
        logprobs_BT, _, top1_BT = _shared_logprobs(model, batch, 1.0, want_BT, with_entropy=False, with_top1=True)
        return logprobs_BT, top1_BT
    return _logprobs_top1(model, batch, 1.0, with_top1=True, mask_BT=mask_BT)


def _logprobs_top1(model, batch: Batch, temperature: float, with_top1: bool, mask_BT: torch.Tensor | None = None):
    """(logprobs_BT, top1_BT or None) of a batch without shared prefixes (see policy_logprobs)."""
    sp = sequence_parallel.current()
    if sp is not None:
        next_BC = sp.shard(next_tokens(batch.input_ids_BT))
        with sp.attention():
            logprobs_BC, top1_BC = _next_token_logprobs(model, sp.shard_inputs(batch.input_ids_BT), next_BC,
                                                        temperature, with_top1)
        length = batch.input_ids_BT.shape[1]
        logprobs = shift_right(sp.gather(logprobs_BC, length))
        return logprobs, (shift_right(sp.gather(top1_BC.float(), length)).bool() if with_top1 else None)
    inputs = batch.model_inputs()
    next_mask = None if mask_BT is None else next_tokens(batch.pack(mask_BT))
    logprobs, top1 = _next_token_logprobs(model, inputs, next_tokens(inputs["input_ids"]), temperature, with_top1,
                                          next_mask)
    if not batch.padding_free:
        return shift_right(logprobs), (shift_right(top1) if with_top1 else None)
    return (_unpacked(batch, shift_right(logprobs)),
            _unpacked(batch, shift_right(top1.float())).bool() if with_top1 else None)


def _shared_logprobs(model, batch: Batch, temperature: float, want_BT: torch.Tensor, with_entropy: bool,
                     with_top1: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(logprobs_BT, entropy_BT or None, top1_BT or None) of a shared-prefix batch at the tokens `want_BT` marks (0 /
    False elsewhere): one forward over its packed rows, the output layer on each distinct (predicting slot, token)
    pair once."""
    inputs, slot_BT = batch.model_inputs(), batch.prefix_layout().slot_BT
    want_BT = want_BT.bool() & (slot_BT >= 0)
    want_BT[:, 0] = False  # nothing predicts a row's first token
    slot_n, target_n, inverse_m = predictions(slot_BT, batch.input_ids_BT, want_BT)
    head = fusable_head(model)
    with lean_activations(model):
        if head is None:
            logits_NV = model(**inputs, use_cache=False).logits
            logits_1nV = logits_NV.reshape(-1, logits_NV.shape[-1])[slot_n][None]
            logprobs_1n = next_token_logprobs(logits_1nV, target_n[None], temperature=temperature)
            top1_1n = logits_1nV.detach().argmax(-1) == target_n[None] if with_top1 else None
            entropy_1n = None
            if with_entropy:  # entropy_BT scores the row before each position: one dummy row in front
                with torch.no_grad():
                    padded = torch.cat([logits_1nV[:, :1], logits_1nV], dim=1).detach()
                    entropy_1n = entropy_BT(padded, temperature=temperature)[:, 1:]
        else:
            stats = []

            def forward(hidden_RWH: torch.Tensor) -> torch.Tensor:
                hidden_1nH = hidden_RWH.reshape(-1, hidden_RWH.shape[-1])[slot_n][None]
                logprobs, entropy, top1 = linear_next_token_stats(hidden_1nH, head.weight, target_n[None], temperature,
                                                                  with_entropy=with_entropy, with_top1=with_top1)
                stats.append((entropy, top1))
                return logprobs

            with _head_forward(head, forward):
                logprobs_1n = model(**inputs, use_cache=False).logits
            entropy_1n, top1_1n = stats[0]

    def scatter(values_1n: torch.Tensor) -> torch.Tensor:
        return values_1n.new_zeros(want_BT.shape).index_put((want_BT,), values_1n[0][inverse_m])

    return (scatter(logprobs_1n), scatter(entropy_1n.detach()) if with_entropy else None,
            scatter(top1_1n) if with_top1 else None)


def _next_token_logprobs(model, inputs: dict, next_ids_BT: torch.Tensor, temperature: float,
                         with_top1: bool = False, next_mask_BT: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next_ids[t] | the tokens up to t) at each position of `inputs` (unshifted), and with `with_top1` whether
    next_ids[t] is the argmax there (else None); with a fusable head and `next_mask_BT`, only at the positions it marks
    (0 / False elsewhere: their rows skip the output layer)."""
    head = fusable_head(model)
    with lean_activations(model):
        if head is None:
            logits = model(**inputs, use_cache=False).logits
            top1 = logits.detach().argmax(-1) == next_ids_BT if with_top1 else None  # (B, T) ids: no (B, T, V) copy
            return next_token_logprobs(logits, next_ids_BT, temperature=temperature), top1
        top1s = []

        def forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
            logprobs, _, top1 = linear_next_token_stats(hidden_BTH, head.weight, next_ids_BT, temperature,
                                                        with_top1=with_top1, next_mask_BT=next_mask_BT)
            top1s.append(top1)
            return logprobs

        with _head_forward(head, forward):
            return model(**inputs, use_cache=False).logits, top1s[0]


def sequence_scores(model, batch: Batch) -> torch.Tensor:
    """A sequence-classification model's score of each row -> scores_B (float32), read where transformers pools:
    the last token that is not the pad token. Padding-free or shared-prefix: the score head's per-token output is
    taken from the packed forward (a hook on `model.score`, which every transformers *ForSequenceClassification
    has) at the same tokens, because the model's own pooling would see one row."""
    if not (batch.padding_free or batch.shares_prefix):
        return model(**batch.model_inputs()).logits[:, 0].float()
    inner = unwrap_module(model)
    head = getattr(inner, "score", None)
    if head is None:
        raise RuntimeError("padding-free or shared-prefix scoring needs the score head of a "
                           f"*ForSequenceClassification model; {type(inner).__name__} has no `score` module (set "
                           "data.packing=false and train.shared_prefix=false)")
    captured = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(**batch.model_inputs(), use_cache=False)  # with a cache, transformers does not look for packed rows
    finally:
        handle.remove()
    scores_BT = batch.unpack(captured[0][..., 0])
    pad_id = inner.config.pad_token_id
    pooled_BT = batch.attention_mask_BT.bool() & (batch.input_ids_BT != (-1 if pad_id is None else pad_id))
    positions_BT = torch.arange(pooled_BT.shape[1], device=pooled_BT.device).expand_as(pooled_BT)
    last_B = (positions_BT * pooled_BT).argmax(-1)
    return scores_BT.gather(1, last_B[:, None])[:, 0].float()


def fusable_head(model) -> torch.nn.Linear | None:
    """The output layer, when log-probs may be taken from the hidden states directly (see the module docstring)."""
    inner = unwrap_module(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in FUSED_HEAD_MODELS or not hasattr(inner, "get_output_embeddings"):
        return None
    head = inner.get_output_embeddings()
    return head if plain_class(head) is torch.nn.Linear and head.bias is None else None


@contextlib.contextmanager
def _head_forward(head: torch.nn.Linear, forward):
    """The output layer runs `forward(hidden_BTH)` instead of its own inside the block (on the instance, so engine
    hooks around the module still run), and is itself again after it (model.lm_head_fp32's forward included). A
    float32 head (models/load.fp32_output_layer) gets float32 hidden states outside autocast, as its own forward."""
    previous = head.__dict__.get("forward")
    if getattr(head, FP32_HEAD, False):
        def fp32_forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hidden_BTH.device.type, enabled=False):
                return forward(hidden_BTH.float())
        head.forward = fp32_forward
    else:
        head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
