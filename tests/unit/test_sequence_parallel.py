"""Sequence parallelism's pure parts: sharding and padding rows, per-shard log-probs against the row's next tokens,
the data ranks that count rows once per group, the recomputation of a checkpointed forward, and the start-up checks of train.sequence_parallel_size. The
2-process runs are in tests/distributed/test_sequence_parallel.py."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from posttrain.algorithms import ALGORITHMS
from posttrain.cli import main
from posttrain.config.load import load_recipe
from posttrain.distributed.backend import Backend
from posttrain.distributed import sequence_parallel
from posttrain.distributed.sequence_parallel import SequenceParallel, checkpoint_context, padded_length, shard
from posttrain.errors import UserError
from posttrain.models.limits import check_sequence_parallel
from posttrain.ops.logprobs import (linear_next_token_logprobs, linear_token_logprobs, next_token_logprobs,
                                    next_tokens, shift_right, token_logprobs)


def test_shards_are_contiguous_and_padded_on_the_right():
    row_BT = torch.arange(1, 8)[None]  # length 7 over 2 ranks: 8 with one pad
    assert padded_length(7, 2) == 8 and padded_length(8, 2) == 8 and padded_length(1, 4) == 4
    halves = [shard(row_BT, 2, r, pad_value=-1) for r in range(2)]
    assert halves[0].tolist() == [[1, 2, 3, 4]] and halves[1].tolist() == [[5, 6, 7, -1]]
    thirds = [shard(row_BT, 3, r) for r in range(3)]
    assert torch.cat(thirds, dim=1).tolist() == [[1, 2, 3, 4, 5, 6, 7, 0, 0]]
    values_BTK = torch.randn(2, 5, 3)  # trailing dims stay whole
    assert torch.equal(shard(values_BTK, 2, 1)[:, :2], values_BTK[:, 3:])


@pytest.mark.parametrize("size", [2, 3])
def test_log_probs_per_shard_equal_the_whole_row(size):
    """Each shard scores the row's next tokens (its last position predicts the next shard's first token); the shards
    concatenated, shifted and trimmed are the unsharded log-probs, on the logits path and the fused head path."""
    torch.manual_seed(0)
    rows, length, hidden, vocab = 2, 7, 8, 11
    ids_BT = torch.randint(vocab, (rows, length))
    hidden_BTH = torch.randn(rows, length, hidden, dtype=torch.float64)
    weight_VH = torch.randn(vocab, hidden, dtype=torch.float64)
    logits_BTV = hidden_BTH @ weight_VH.t()
    next_BT = next_tokens(ids_BT)
    by_logits = [next_token_logprobs(shard(logits_BTV, size, r), shard(next_BT, size, r)) for r in range(size)]
    by_head = [linear_next_token_logprobs(shard(hidden_BTH, size, r), weight_VH, shard(next_BT, size, r))
               for r in range(size)]
    expected_BT = token_logprobs(logits_BTV, ids_BT)
    torch.testing.assert_close(shift_right(torch.cat(by_logits, dim=1)[:, :length]), expected_BT)
    torch.testing.assert_close(shift_right(torch.cat(by_head, dim=1)[:, :length]),
                               linear_token_logprobs(hidden_BTH, weight_VH, ids_BT))


def test_rows_are_counted_once_per_group():
    """World 4 with SP 2: ranks (0, 1) and (2, 3) hold the same rows; the first of each counts, data-rank order."""
    ranks = [types.SimpleNamespace(rank=r, sequence_parallel_size=2) for r in range(4)]
    assert [Backend.data_weight.fget(b) for b in ranks] == [1.0, 0.0, 1.0, 0.0]
    gathered = types.SimpleNamespace(sequence_parallel_size=2, all_gather_object=lambda obj: ["a", "a", "b", "b"])
    assert Backend.data_all_gather_object(gathered, None) == ["a", "b"]
    summed = types.SimpleNamespace(data_weight=0.0, all_reduce_sum=lambda x: x)
    assert float(Backend.data_all_reduce_sum(summed, torch.tensor(7.0))) == 0.0


@pytest.mark.parametrize("sharded", [True, False])
def test_a_recomputed_forward_attends_as_its_first_forward(sharded):
    """Gradient checkpointing recomputes in the backward, outside attention(): with checkpoint_context the
    recomputation runs under the group the first forward ran under (Ulysses), and an unsharded forward's under
    none (generation stays whole)."""
    group = SequenceParallel(2, None, 0)  # no exchange happens here: only which group is running is read
    seen = []

    def layer(x):
        seen.append(list(sequence_parallel._running))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with group.attention() if sharded else contextlib.nullcontext():
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=checkpoint_context)
    y.sum().backward()
    assert seen == [[group], [group]] if sharded else seen == [[], []]
    assert sequence_parallel._running == []
    torch.testing.assert_close(x.grad, x.detach().cos())


def sp_recipe(tiny_model_dir, command, *extra):
    return load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "data.train=x.jsonl", *extra],
                       ALGORITHMS[command][0])


@pytest.mark.parametrize("command, world, extra, says", [
    ("sft", 2, ["train.sequence_parallel_size=3"], "does not divide the 2 processes"),
    ("sft", 1, ["train.sequence_parallel_size=2"], "does not divide the 1 processes"),
    ("dpo", 2, ["train.sequence_parallel_size=2"], "dpo does not run sequence-parallel"),
    ("sft", 2, ["train.sequence_parallel_size=2", "data.packing=true"], "data.packing=true"),
    ("sft", 2, ["train.sequence_parallel_size=2", "model.attn_implementation=eager"], "model.attn_implementation"),
    ("grpo", 3, ["train.sequence_parallel_size=3", "rewards=[{name: exact_match}]"],
     "must divide the model's 4 attention heads"),
    ("sft", 8, ["train.sequence_parallel_size=8"], "must divide the model's 4 attention heads"),
])
def test_bad_sizes_are_refused_with_the_key(tiny_model_dir, monkeypatch, command, world, extra, says):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    recipe = sp_recipe(tiny_model_dir, command, *extra)
    with pytest.raises(UserError, match="train.sequence_parallel_size") as e:
        check_sequence_parallel(recipe, ALGORITHMS[command][1](recipe))
    assert says in str(e.value)


def test_a_ray_launch_is_refused_when_the_recipe_loads(tiny_model_dir):
    with pytest.raises(UserError, match="train.sequence_parallel_size=2 with launcher: ray"):
        sp_recipe(tiny_model_dir, "sft", "train.sequence_parallel_size=2", "launcher=ray")


def test_kv_heads_fewer_than_ranks_are_replicated(tiny_model_dir, monkeypatch):
    """4 heads, 2 kv heads over 4 ranks: each kv head is replicated on 2 ranks (DeepSpeed's Ulysses does it)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    recipe = sp_recipe(tiny_model_dir, "sft", "train.sequence_parallel_size=4")
    check_sequence_parallel(recipe, ALGORITHMS["sft"][1](recipe))


def test_the_command_line_exits_2_before_any_model_loads(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n')
    argv = ["sft", f"model.name_or_path={tmp_path / 'no-model'}", f"data.train={data}", f"output_dir={tmp_path / 'out'}",
            "train.sequence_parallel_size=2"]
    assert main(argv) == 2
    assert not (tmp_path / "out").exists()
