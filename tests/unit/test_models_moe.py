"""Mixture-of-experts routing in the trainer (models/moe.py, losses/router.py) on a tiny random Qwen3-MoE:
the load-balancing loss equals transformers', replay routes through the recorded experts, and replaying an unchanged
model's own routing changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, load_balancing_loss_func

from posttrain.batch import Batch
from posttrain.errors import UserError
from posttrain.losses.router import load_balancing_loss, routing_agreement
from posttrain.models.forward import policy_logprobs
from posttrain.distributed.sequence_parallel import shard
from posttrain.models.moe import layers_first, moe_routing, routers, rows_first, sparse_block_classes

EXPERTS, TOP_K, LAYERS = 4, 2, 2


def tiny_moe(seed: int = 0, **config) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        decoder_sparse_step=1, **config))


def tiny_dense() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def padded_batch(seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    input_ids_BT = torch.randint(3, 50, (3, 7), generator=g)
    attention_mask_BT = torch.ones(3, 7, dtype=torch.long)
    attention_mask_BT[1, 5:] = 0  # right padding
    completion_mask_BT = attention_mask_BT.bool() & (torch.arange(7) >= 3)
    return Batch(input_ids_BT=input_ids_BT, completion_mask_BT=completion_mask_BT,
                 attention_mask_BT=attention_mask_BT, num_sequences=3)


def recorded(model, routing, batch: Batch) -> tuple[torch.Tensor, Batch]:
    """The old policy's log-probs and the batch carrying its routing, as GRPO's prepare makes them."""
    with torch.no_grad(), routing.recording() as record:
        logprobs_BT = policy_logprobs(model, batch)
    return logprobs_BT, dataclasses.replace(batch, routed_experts_BTLK=record.experts_BTLK(batch))


def experts_used(model):
    """Collects the top-k indices every Qwen3MoeExperts module is called with."""
    seen = []
    handles = [m.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
               for m in model.modules() if isinstance(m, Qwen3MoeExperts)]
    return seen, handles


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    g = torch.Generator().manual_seed(0)
    logits_LNE = torch.randn(LAYERS, 2 * 5, EXPERTS, generator=g)
    mask_BT = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]) if masked else torch.ones(2, 5, dtype=torch.long)
    ours = load_balancing_loss(logits_LNE, TOP_K, mask_BT.reshape(-1).bool())
    theirs = load_balancing_loss_func(tuple(logits_LNE), EXPERTS, TOP_K, mask_BT if masked else None)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    uniform = load_balancing_loss(torch.zeros(1, 8, EXPERTS), TOP_K, torch.ones(8, dtype=torch.bool))
    assert uniform.item() >= TOP_K - 1e-6  # ties go to the first experts: as unbalanced as top-k can be


def test_routing_agreement_counts_shared_choices():
    chosen_NK = torch.tensor([[0, 1], [2, 3], [1, 0]])
    replayed_NK = torch.tensor([[1, 0], [2, 0], [3, 2]])
    matches, choices = routing_agreement(chosen_NK, replayed_NK, torch.tensor([True, True, False]))
    assert (matches.item(), choices.item()) == (3.0, 4.0)  # the third token is padding


def test_replaying_an_unchanged_models_routing_changes_nothing():
    model, batch = tiny_moe(), padded_batch()
    routing = moe_routing(model)
    old_BT, replayed = recorded(model, routing, batch)
    assert replayed.routed_experts_BTLK.shape == (3, 7, LAYERS, TOP_K)
    with routing.training(replayed) as step:
        new_BT = policy_logprobs(model, replayed)
        loss, metrics = step.finish(new_BT.sum(), {}, weight=torch.tensor(1.0))
    assert torch.equal(new_BT, old_BT)
    assert metrics["routing_agreement"].item() == 1.0
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_replay_routes_through_the_recorded_experts_after_the_router_moved():
    model, batch = tiny_moe(), padded_batch()
    routing = moe_routing(model)
    _, replayed = recorded(model, routing, batch)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 3)
    seen, handles = experts_used(model)
    with routing.training(replayed) as step:
        moved_BT = policy_logprobs(model, replayed)
        _, metrics = step.finish(moved_BT.sum(), {}, weight=torch.tensor(1.0))
    natural_BT = policy_logprobs(model, batch)  # outside the context: the router's own choice again
    for h in handles:
        h.remove()
    expected = replayed.routed_experts_BTLK.long().flatten(0, 1)
    assert [torch.equal(s, expected[:, layer]) for layer, s in enumerate(seen[:LAYERS])] == [True] * LAYERS
    assert not torch.equal(seen[LAYERS], expected[:, 0])  # the moved router picks other experts without replay
    assert 0.0 < metrics["routing_agreement"].item() < 1.0
    assert not torch.allclose(moved_BT, natural_BT)


def test_recording_over_several_forwards_lines_up_with_the_rows():
    model, batch = tiny_moe(), padded_batch()
    routing = moe_routing(model)
    _, whole = recorded(model, routing, batch)
    with torch.no_grad(), routing.recording() as record:
        for start, stop in ((0, 2), (2, 3)):
            policy_logprobs(model, batch.rows(start, stop))
    assert torch.equal(record.experts_BTLK(batch), whole.routed_experts_BTLK)


def test_aux_loss_is_transformers_and_weighted_into_the_loss():
    model, batch = tiny_moe(), padded_batch()
    routing = moe_routing(model, aux_loss_coef=0.5)
    theirs = model(**batch.model_inputs(), output_router_logits=True).aux_loss
    with routing.training(batch) as step:
        policy_logprobs(model, batch)
        loss, metrics = step.finish(torch.tensor(2.0), {"x": torch.tensor(1.0)}, weight=torch.tensor(0.25))
    assert metrics["router_aux_loss"].item() == pytest.approx(theirs.item(), rel=1e-6)
    assert loss.item() == pytest.approx(2.0 + 0.5 * theirs.item() * 0.25, rel=1e-6)
    assert "routing_agreement" not in metrics and metrics["x"] == 1.0  # no replay without recorded experts


def test_an_unset_coefficient_is_the_model_configs_own_as_in_trl():
    assert moe_routing(tiny_moe(router_aux_loss_coef=0.02), None).aux_loss_coef == 0.02
    assert moe_routing(tiny_dense(), None).aux_loss_coef == 0.0


def test_gradient_checkpointing_recomputes_with_the_replayed_routing():
    grads = []
    for checkpointing in (False, True):
        model, batch = tiny_moe(), padded_batch()
        routing = moe_routing(model)
        _, replayed = recorded(model, routing, batch)
        with torch.no_grad():
            for router in routers(model):
                router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        with routing.training(replayed) as step:
            loss, _ = step.finish(policy_logprobs(model, replayed).sum(), {}, weight=torch.tensor(1.0))
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0])


def test_a_dense_model_has_no_routers_and_says_so():
    dense = tiny_dense()
    routing = moe_routing(dense)
    assert routing.num_routers == 0 and sparse_block_classes(dense) == []
    with routing.training(padded_batch()) as step:
        loss, metrics = step.finish(torch.tensor(1.0), {}, weight=torch.tensor(1.0))
    assert loss.item() == 1.0 and metrics == {}
    with pytest.raises(UserError, match="algo.routing_replay.*llama has none"):
        routing.require(dense, "algo.routing_replay")
    assert [c.__name__ for c in sparse_block_classes(tiny_moe())] == ["Qwen3MoeSparseMoeBlock"]


def test_a_padding_free_forward_replays_the_padded_recording():
    """Token-budget micro-batches run padding-free (packed rows): the recording, taken padded, is packed the same
    way, so every real token keeps its experts and an unchanged model agrees with itself."""
    model, batch = tiny_moe(), padded_batch()
    routing = moe_routing(model)
    old_BT, replayed = recorded(model, routing, batch)
    packed = dataclasses.replace(replayed, padding_free=True)
    seen, handles = experts_used(model)
    with routing.training(packed) as step:
        new_BT = policy_logprobs(model, packed)
        _, metrics = step.finish(new_BT.sum(), {}, weight=torch.tensor(1.0))
    for h in handles:
        h.remove()
    assert metrics["routing_agreement"].item() == 1.0
    real_N = packed.pack(packed.attention_mask_BT).reshape(-1).bool()
    expected_NLK = packed.pack(replayed.routed_experts_BTLK.long()).flatten(0, 1)
    for layer in range(LAYERS):
        assert torch.equal(seen[layer][real_N], expected_NLK[real_N, layer])
    real_BT = batch.attention_mask_BT.bool()  # padding-free scores no padding (0 there)
    torch.testing.assert_close(new_BT[real_BT], old_BT[real_BT], atol=1e-5, rtol=0)
    with torch.no_grad(), routing.recording() as record:
        policy_logprobs(model, packed)
    recorded_packed = record.experts_BTLK(packed)  # recorded padding-free: the same at every real token, 0 at padding
    assert torch.equal(recorded_packed[real_BT], replayed.routed_experts_BTLK[real_BT])
    assert not recorded_packed[~real_BT].any()


@pytest.mark.parametrize("size", [2, 3])
def test_the_groups_router_slices_line_up_into_whole_rows(size):
    """Under sequence parallelism each rank's routers flatten its slice of every row ([rows * slice] tokens, row by
    row); rows_first of each, concatenated along the sequence and cut to the row length as the group's gather does,
    is layers_first's inverse of the unsharded routers' view, token for token (rows of 7 tokens: padded to 8 or 9)."""
    rows, length = 3, 7
    values_BTLE = torch.randn(rows, length, LAYERS, EXPERTS)

    def routers_view(x_BTLE):  # [L, rows * width, E]: each layer's router gets its rows' tokens flattened
        return torch.stack([x_BTLE[:, :, layer].reshape(-1, EXPERTS) for layer in range(LAYERS)])

    slices = [routers_view(shard(values_BTLE, size, rank)) for rank in range(size)]
    gathered_BTLE = torch.cat([rows_first(s, rows) for s in slices], dim=1)[:, :length]
    assert torch.equal(layers_first(gathered_BTLE), routers_view(values_BTLE))
    assert torch.equal(rows_first(routers_view(values_BTLE), rows), values_BTLE)
