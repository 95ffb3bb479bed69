"""Shared-prefix layout: rows that begin with the same tokens (a prompt's G completions, a preference pair's chosen
and rejected rows) computed with that prefix once.

    group_B, length_B = prefix_groups(input_ids_BT, keep_BT)            # which rows share how many first tokens
    layout = prefix_layout(input_ids_BT, keep_BT, group_B, length_B)    # the model's packed rows and their mask
    model(input_ids=layout.input_ids_RW, position_ids=layout.position_ids_RW,
          attention_mask=layout.attention_mask_R1WW())
    pred_n, target_n, inverse_m = predictions(layout.slot_BT, input_ids_BT, want_BT)

A group's model row holds its prefix once, then each member's own tokens after it: [prefix | s1 | s2 | ...]. Each
member's tokens see the prefix and themselves (never another member), and their position ids continue from the
prefix's end, so every token has exactly the keys, values and positions it has in its own row: the hidden states are
the unshared ones (within float rounding: the matmuls have other shapes). Groups are packed first-fit-decreasing into
rows of the longest group's width, so a batch with no shared prefix is the padding-free layout. A token of the batch
is found at `slot_BT[b, t]` of the flattened [rows, width]; the tokens of the shared prefix of every member point at
the same slots.

Next-token log-probs cannot be read off the packed row by shifting: the prefix's last slot predicts the first token
of EVERY member. `predictions` lists the distinct (predicting slot, predicted token) pairs the wanted tokens need, so
the output layer runs once per pair (a shared prefix's tokens are scored once, not once per member).

Everything here is pure: tensors in, tensors out, no model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_SHARED_TOKENS = 8
"""Fewest first tokens two rows must share to be computed as one group (fewer save too little to pay for the mask)."""
PAIRS_PER_TOKEN = 4096
"""A token's projections and MLP in units of one attention (query, key) pair: about 2 x hidden + 1.5 x intermediate
size for a Llama-shaped layer (SmolLM2-135M: 3,456; 7B models: ~35,000); the lower end, so groups stay small where
attention would dominate."""


def common_prefix_lengths(input_ids_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """How many first tokens each pair of rows has in common (at most both rows' real lengths) -> [B, B]."""
    same_BBT = (input_ids_BT[:, None, :] == input_ids_BT[None, :, :]).long().cumprod(-1).sum(-1)
    return torch.minimum(same_BBT, torch.minimum(lengths_B[:, None], lengths_B[None, :]))


def layout_cost(tokens: int, pairs_per_token: int = PAIRS_PER_TOKEN) -> int:
    """What computing a row of `tokens` costs, in attention (query, key) pairs: its tokens' projections and MLP
    (`pairs_per_token` each) plus the whole row's pairs (a dense mask computes every pair, masked or not)."""
    return tokens * (pairs_per_token + tokens)


def prefix_groups(input_ids_BT: torch.Tensor, keep_BT: torch.Tensor, min_tokens: int = MIN_SHARED_TOKENS,
                  pairs_per_token: int = PAIRS_PER_TOKEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (right padded, `keep_BT` marking real tokens) -> (group_B, length_B): rows with the same group id (its
    first row's index) share their first length_B tokens (the same for all of a group; a row alone: its length).

    Groups are merged pair by pair, the two rows with the longest common prefix first (a pair's chosen and rejected
    rows before two pairs that share only a system prompt), while at least `min_tokens` are shared and the merged
    group's row costs less than the two apart (`layout_cost`): a long row sharing a short prefix would make the
    group's row, and its dense attention, longer than it saves. The tokens all members of a merged group share are
    the fewest of its two groups' and the pair's own (common prefixes nest: if a, b share k and b, c share k', a and
    c share at least min(k, k'))."""
    lengths_B = keep_BT.sum(-1)
    common_BB = common_prefix_lengths(input_ids_BT, lengths_B).tolist()
    lengths = lengths_B.tolist()
    group = list(range(len(lengths)))  # row -> its group's first row
    shared = {b: n for b, n in enumerate(lengths)}  # group -> tokens its members share
    width = dict(shared)  # group -> tokens of its packed row
    pairs = sorted(((common_BB[i][j], i, j) for i in range(len(lengths)) for j in range(i + 1, len(lengths))
                    if common_BB[i][j] >= min_tokens), key=lambda pair: -pair[0])
    for common, i, j in pairs:
        a, b = group[i], group[j]
        if a == b:
            continue
        prefix = min(shared[a], shared[b], common)
        members = [r for r, g in enumerate(group) if g in (a, b)]
        merged = prefix + sum(lengths[r] - prefix for r in members)
        if layout_cost(merged, pairs_per_token) >= (layout_cost(width[a], pairs_per_token)
                                                    + layout_cost(width[b], pairs_per_token)):
            continue
        first = min(a, b)
        for r in members:
            group[r] = first
        shared[first], width[first] = prefix, merged
    return torch.tensor(group), torch.tensor([shared[g] for g in group])


class PrefixLayout(NamedTuple):
    """A batch's rows as the model computes them (see the module docstring)."""

    input_ids_RW: torch.Tensor
    position_ids_RW: torch.Tensor
    group_RW: torch.Tensor
    """Which group each slot holds (-1: filler after a row's last group)."""
    segment_RW: torch.Tensor
    """0 at a group's prefix, k at its k-th member's own tokens, -1 at filler."""
    slot_BT: torch.Tensor
    """Flat slot (row * width + column) of each real token of the batch; -1 at padding."""

    def attention_mask_R1WW(self) -> torch.Tensor:
        """bool [rows, 1, width, width], True where query slot q may attend to key slot k: causal, inside one group,
        and k in the prefix or in q's own member (filler sees filler, so no row of the softmax is empty)."""
        width = self.group_RW.shape[1]
        causal_WW = torch.ones(width, width, dtype=torch.bool, device=self.group_RW.device).tril()
        group_q, group_k = self.group_RW[:, :, None], self.group_RW[:, None, :]
        segment_q, segment_k = self.segment_RW[:, :, None], self.segment_RW[:, None, :]
        visible = (group_q == group_k) & ((segment_k == 0) | (segment_k == segment_q))
        return (visible & causal_WW)[:, None]

    def forwarded_tokens(self) -> int:
        """Tokens the model computes (filler excluded)."""
        return int((self.group_RW >= 0).sum())


def prefix_layout(input_ids_BT: torch.Tensor, keep_BT: torch.Tensor, group_B: torch.Tensor,
                  length_B: torch.Tensor) -> PrefixLayout:
    """The packed rows of the groups `prefix_groups` found (module docstring)."""
    lengths = keep_BT.sum(-1).tolist()
    groups: dict[int, list[int]] = {}
    for b, g in enumerate(group_B.tolist()):
        groups.setdefault(g, []).append(b)
    shared = {g: int(length_B[members[0]]) for g, members in groups.items()}
    sizes = {g: shared[g] + sum(lengths[b] - shared[g] for b in members) for g, members in groups.items()}
    width = max(max(sizes.values(), default=1), 1)
    fill: list[int] = []  # slots used in each model row
    start: dict[int, int] = {}  # each group's first flat slot
    for g in sorted(groups, key=lambda g: -sizes[g]):
        row = next((r for r, used in enumerate(fill) if used + sizes[g] <= width), len(fill))
        if row == len(fill):
            fill.append(0)
        start[g] = row * width + fill[row]
        fill[row] += sizes[g]
    slot_BT = torch.full(keep_BT.shape, -1, dtype=torch.long)
    positions_BT = torch.arange(keep_BT.shape[1]).expand(keep_BT.shape)
    segment_BT = torch.zeros(keep_BT.shape, dtype=torch.long)
    for g, members in groups.items():
        first, prefix, own = start[g], shared[g], start[g] + shared[g]
        for k, b in enumerate(members, start=1):
            slot_BT[b, :prefix] = torch.arange(first, first + prefix)
            slot_BT[b, prefix : lengths[b]] = torch.arange(own, own + lengths[b] - prefix)
            segment_BT[b, prefix : lengths[b]] = k
            own += lengths[b] - prefix
    real_BT = slot_BT >= 0
    slots, size = slot_BT[real_BT], len(fill) * width

    def scatter(values_BT: torch.Tensor, fill_value: int) -> torch.Tensor:
        flat = torch.full((size,), fill_value, dtype=torch.long).index_put((slots,), values_BT.cpu()[real_BT])
        return flat.view(len(fill), width).to(input_ids_BT.device)

    group_BT = group_B.cpu()[:, None].expand(keep_BT.shape)
    return PrefixLayout(scatter(input_ids_BT, 0), scatter(positions_BT, 0), scatter(group_BT, -1),
                        scatter(segment_BT, -1), slot_BT.to(input_ids_BT.device))


def predictions(slot_BT: torch.Tensor, input_ids_BT: torch.Tensor,
                want_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (slot whose output predicts, token predicted) pairs of the wanted tokens (position t of a row is
    predicted by its token t - 1; position 0 and padding are never wanted) -> (slot_n, target_n, inverse_m): the m-th
    wanted token (row-major) is pair inverse_m."""
    want_BT = want_BT.bool().clone()
    want_BT[:, 0] = False
    predicting_BT = torch.cat([slot_BT.new_full((slot_BT.shape[0], 1), -1), slot_BT[:, :-1]], dim=1)
    pairs_m2 = torch.stack([predicting_BT[want_BT], input_ids_BT[want_BT]], dim=-1)
    unique_n2, inverse_m = torch.unique(pairs_m2, dim=0, return_inverse=True)
    return unique_n2[:, 0], unique_n2[:, 1], inverse_m
