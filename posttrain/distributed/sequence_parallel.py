"""Sequence parallelism (`train.sequence_parallel_size: N`): one sequence split across N ranks, with DeepSpeed's
Ulysses attention (ALST) trading sequence shards for head shards around the model's own attention kernel.

    sp = SequenceParallel.start(N, "sdpa")      # the Backend: groups of N consecutive ranks
    inputs = sp.shard_inputs(input_ids_BT)       # this rank's contiguous slice, with GLOBAL position ids
    with sp.attention():                         # attention all-to-alls across the group inside this block only
        out_BC = model(**inputs).logits
    out_BT = sp.gather(out_BC, length)           # every rank: the whole sequence; backward: its own slice

Each rank of a group holds the same rows (the data is sharded over data ranks = rank // N) and runs its contiguous
1/N of every row through the model. A row whose length does not divide by N is right-padded to the next multiple;
attention is causal, so no real token sees the padding, and the padding is outside every loss mask. Position ids
are the global ones, so rotary embeddings are those of the unsharded row. Per-token outputs (log-probs, values,
logits) are gathered so every rank of the group computes the same loss over whole rows; the gather's backward
keeps this rank's slice of the (identical) upstream gradient, and the all-to-alls inside attention carry the rest,
so summing the group's parameter gradients gives the unsharded gradient. The loop counts the normaliser once per
group (Backend.data_all_reduce_sum); DDP / ZeRO average over all N x data ranks and Backend.backward scales by the
whole world, so the update equals N = 1. Under gradient checkpointing a layer's forward is recomputed in the
backward, outside `attention()`: `checkpoint_context` (torch.utils.checkpoint's context_fn) runs it under the group
its first forward ran under, so the recomputation is the same Ulysses attention over the same slices.

From DeepSpeed 0.19.8's `runtime.sequence_parallel.ulysses_sp` we use `UlyssesSPAttentionHF` (the exchanges around
the core attention, kv heads replicated when N is a multiple of their count). We do not use:
- `register_with_transformers`: it replaces an entry of transformers' ALL_ATTENTION_FUNCTIONS for the whole process
  with one instance built for one model config and one fixed batch size, always on. Here generation is not sharded,
  micro-batches change their row count, and policy, critic and teacher may differ in heads: `attention()` switches
  Ulysses on for the training forwards only, with an instance per (rows, heads) layout.
- `UlyssesSPDataLoaderAdapter`: it reads a DataLoader of dicts with `labels` and hands every rank's different rows
  to the whole group in turn; the loop's micro-batches are Batch records and the group is given the same rows.
- `parallel_state_sp`: it may be built once per process (tests run several trainings in one); the groups are made
  here with the same layout.
- `TiledFusedLogitsLoss`: ops/logprobs.linear_token_logprobs already fuses the output layer and the log-softmax.
Nothing is missing for CPU: the exchange is torch.distributed's all_to_all_single, which gloo implements.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Core attention kernels Ulysses wraps: causal from position ids alone (eager needs a 4D mask over the whole row)."""

_running: list["SequenceParallel"] = []  # the group whose sharded forward is inside attention() now
_installed: Optional["SequenceParallel"] = None  # the run's group (None: no sequence parallelism)


def padded_length(length: int, size: int) -> int:
    """The row length padded up to a multiple of the group size."""
    return -(-length // size) * size


def shard(x_BT: torch.Tensor, size: int, rank: int, pad_value: Any = 0) -> torch.Tensor:
    """`rank`'s contiguous slice of dim 1 of a [B, T, ...] tensor right-padded to a multiple of `size`."""
    length = x_BT.shape[1]
    width = padded_length(length, size)
    if width != length:
        pad = [0, 0] * (x_BT.dim() - 2) + [0, width - length]
        x_BT = torch.nn.functional.pad(x_BT, pad, value=pad_value)
    chunk = width // size
    return x_BT[:, rank * chunk : (rank + 1) * chunk]


class _GatherSequence(torch.autograd.Function):
    """Shards [B, C, ...] of the group -> [B, N*C, ...] on every rank. Backward: this rank's slice of the gradient,
    which is the whole gradient of its shard because every rank of the group computes the same loss from the
    gathered tensor (the sum over the group would count it N times)."""

    @staticmethod
    def forward(ctx, x_BC, group, rank, size):
        parts = [torch.empty_like(x_BC) for _ in range(size)]
        dist.all_gather(parts, x_BC.contiguous(), group=group)
        ctx.rank, ctx.chunk = rank, x_BC.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad_BT):
        return grad_BT[:, ctx.rank * ctx.chunk : (ctx.rank + 1) * ctx.chunk], None, None, None


class SequenceParallel:
    """This rank's sequence-parallel group: `size` consecutive ranks, this one at `rank` inside it."""

    def __init__(self, size: int, group, rank: int):
        self.size, self.group, self.rank = size, group, rank
        self._attention: dict[tuple, Any] = {}  # (rows, q heads, kv heads, head size, kernel) -> Ulysses instance

    @classmethod
    def start(cls, size: int, attn_implementation: str) -> "SequenceParallel":
        """Groups of `size` consecutive ranks (every rank makes every group, as torch.distributed requires), the
        switch in transformers' attention table, and DeepSpeed's communication layer over the existing group."""
        global _installed
        import deepspeed.comm

        if not deepspeed.comm.is_initialized():  # wraps the process group the Accelerator made
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
        world, me = dist.get_world_size(), dist.get_rank()
        mine = None
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= me < first + size:
                mine = group
        _switch_attention(attn_implementation)
        _installed = cls(size, mine, me % size)
        return _installed

    def stop(self) -> None:
        global _installed
        _installed = None
        self._attention.clear()

    # --- the data ------------------------------------------------------------------------------------------------
    def shard(self, x_BT: torch.Tensor, pad_value: Any = 0) -> torch.Tensor:
        return shard(x_BT, self.size, self.rank, pad_value)

    def shard_inputs(self, input_ids_BT: torch.Tensor) -> dict:
        """Model inputs of this rank's slice: token ids and their global positions (no attention mask: right padding
        under causal attention is never attended to by a real token)."""
        rows, length = input_ids_BT.shape
        positions_BT = torch.arange(length, device=input_ids_BT.device).expand(rows, length)
        return {"input_ids": self.shard(input_ids_BT), "position_ids": self.shard(positions_BT)}

    def gather(self, x_BC: torch.Tensor, length: int) -> torch.Tensor:
        """The group's shards of a per-token output, concatenated and trimmed to the row length."""
        return _GatherSequence.apply(x_BC, self.group, self.rank, self.size)[:, :length]

    def broadcast(self, obj: Any) -> Any:
        """The group's first rank's `obj` on every rank of the group (the rows it trains on)."""
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    # --- the attention -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """Forwards inside run Ulysses attention over the group; outside, the model's attention is untouched."""
        _running.append(self)
        try:
            yield
        finally:
            _running.pop()

    def _ulysses(self, core, module, query, key, value, *args, **kwargs):
        """DeepSpeed's Ulysses around `core` for this layout. query / key / value: [rows, heads, C, head size]."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        layout = (query.shape[0], query.shape[1], key.shape[1], query.shape[3], core)
        if layout not in self._attention:
            self._attention[layout] = UlyssesSPAttentionHF(
                attn=core, batch_size=query.shape[0], attn_head_count=query.shape[1], attn_head_size=query.shape[3],
                kv_head_count=key.shape[1], num_hidden_layers=1, process_group=self.group, seq_length_is_variable=True)
        # with fewer kv heads than ranks DeepSpeed replicates them and rewrites the module's group count; the
        # unsharded forwards (generation) need it back
        groups = getattr(module, "num_key_value_groups", None)
        try:
            return self._attention[layout](module, query, key, value, None, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups


def current() -> Optional[SequenceParallel]:
    """The run's sequence-parallel group, or None (N = 1)."""
    return _installed


def checkpoint_context() -> tuple[ContextManager, ContextManager]:
    """torch.utils.checkpoint's `context_fn` (models/load.py enables gradient checkpointing with it): a layer's
    forward recomputed in the backward runs outside `attention()`, so it takes the attention that layer's first
    forward took, read when that forward runs: Ulysses over the same group (the recomputed tensors are the sharded
    ones the checkpoint compares against, and their all-to-alls pair up across the group because every rank
    recomputes the same layers in the same order), or the model's own kernel for an unsharded forward (generation).
    Returns (around the first forward, around the recomputation)."""
    running = _running[-1] if _running else None
    return contextlib.nullcontext(), (running.attention() if running is not None else contextlib.nullcontext())


def _switch_attention(name: str) -> None:
    """transformers' attention kernel `name` becomes a switch: Ulysses inside `SequenceParallel.attention()`, the
    kernel itself elsewhere. Installed once per process (a second run finds it in place)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = ALL_ATTENTION_FUNCTIONS[name]
    if getattr(core, "sequence_parallel_core", None) is not None:
        return

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not _running:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        return _running[-1]._ulysses(core, module, query, key, value, *args, **kwargs)

    attention.sequence_parallel_core = core
    ALL_ATTENTION_FUNCTIONS[name] = attention

