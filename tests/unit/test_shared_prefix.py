"""Shared-prefix forwards (train.shared_prefix; ops/shared_prefix.py, Batch.prefix_group_B, models/forward.py): a
batch whose rows share their first tokens, computed with those tokens once, gives the per-token log-probs, entropies,
values, scores, GRPO and DPO losses, gradients, grad norms and updated weights of the plain batch (fp32, tiny random
Llama), with rows of very different prompt and completion lengths; the forwarded-token count of a known batch is
pinned, so a change that stops sharing fails here; start-up refuses `true` where it cannot be exact and the first
step stops a run whose shared forward disagrees with the plain one."""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

from posttrain.algorithms.dpo import DPO, DPOAlgoConfig
from posttrain.algorithms.grpo import GRPO, GRPOAlgoConfig
from posttrain.batch import share_prefixes
from posttrain.config.load import load_recipe
from posttrain.data import collate_padded, collate_preference
from posttrain.errors import UserError
from posttrain.models.critic import critic_values
from posttrain.models.forward import policy_logits_at, policy_logprobs, policy_logprobs_entropy, sequence_scores
from posttrain.models.shared_prefix import _probe, blocker, check_first_forward, resolve_shared_prefix
from posttrain.ops.shared_prefix import PrefixLayout, prefix_groups
from posttrain.train.micro_batches import shape

PAD, VOCAB = 0, 64


def rows(shapes, seed=0) -> list[dict]:
    """[(prompt length, [completion lengths])] -> prompt-completion rows, each prompt's completions consecutive."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_length, completions in shapes:
        prompt = torch.randint(3, VOCAB, (prompt_length,), generator=g).tolist()
        for n in completions:
            completion = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            out.append({"input_ids": prompt + completion, "completion_mask": [0] * prompt_length + [1] * n})
    return out


# a prompt longer than every completion, one shorter than every completion, a single row, a short-prefix pair
SHAPES = [(30, [5, 17, 3, 9]), (9, [40, 2, 25]), (12, [12]), (14, [1, 30])]


def config(**extra) -> LlamaConfig:
    torch.manual_seed(0)
    return LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=VOCAB, attn_implementation="sdpa", pad_token_id=PAD, **extra)


def plain_and_shared(shapes=SHAPES):
    plain = collate_padded(rows(shapes), PAD)
    shared = share_prefixes(plain)
    assert shared.shares_prefix
    return plain, shared


def scored(batch):
    """Real tokens but each row's first (which nothing predicts)."""
    mask = batch.attention_mask_BT.bool().clone()
    mask[:, 0] = False
    return mask


def grads(model, loss_fn):
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close(a, b, rtol=1e-6, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_the_forwarded_token_count_of_a_known_batch():
    """CI pin: a refactor that stops sharing (or shares wrongly) changes these numbers."""
    plain, shared = plain_and_shared()
    assert shared.prefix_group_B.tolist() == [0, 0, 0, 0, 4, 4, 4, 7, 8, 8]
    assert shared.prefix_length_B.tolist() == [30] * 4 + [9] * 3 + [24] + [14, 14]
    real = 4 * 30 + 34 + 3 * 9 + 67 + 24 + 2 * 14 + 31
    assert plain.forwarded_tokens() == plain.input_ids_BT.numel() == 10 * 49  # padded rows
    assert shared.forwarded_tokens(shared=False) == real == 331
    assert shared.forwarded_tokens() == (30 + 34) + (9 + 67) + 24 + (14 + 31) == 209


def test_a_short_prefix_before_long_rows_is_not_shared():
    """The cost rule: 8 shared tokens before two 200-token rows would lengthen the packed row (and its dense
    attention) more than they save; a 150-token prompt before two 40-token completions is shared."""
    long_rows = torch.tensor([[5] * 8 + list(range(10, 210)), [5] * 8 + list(range(20, 220))])
    group_B, _ = prefix_groups(long_rows, torch.ones_like(long_rows, dtype=torch.bool))
    assert group_B.tolist() == [0, 1]
    prompt_rows = torch.tensor([[5] * 150 + [6] * 40, [5] * 150 + [7] * 40])
    group_B, length_B = prefix_groups(prompt_rows, torch.ones_like(prompt_rows, dtype=torch.bool))
    assert group_B.tolist() == [0, 0] and length_B.tolist() == [150, 150]


def test_pairs_share_their_whole_prompt_before_groups_share_a_system_prompt():
    """Two preference pairs under one 10-token system prompt: each pair's rows share their 30-token prompt (the
    longest common prefixes merge first); the two pairs are not merged over the system prompt, which would shrink
    every row's shared part to 10 tokens."""
    system, g = [7] * 10, torch.Generator().manual_seed(3)
    prompts = [system + torch.randint(10, VOCAB, (20,), generator=g).tolist() for _ in range(2)]
    answers = [torch.randint(10, VOCAB, (5,), generator=g).tolist() for _ in range(4)]
    ids = torch.tensor([prompts[0] + answers[0], prompts[1] + answers[1], prompts[0] + answers[2],
                        prompts[1] + answers[3]])
    group_B, length_B = prefix_groups(ids, torch.ones_like(ids, dtype=torch.bool))
    assert group_B.tolist() == [0, 1, 0, 1] and length_B.tolist() == [30] * 4


@pytest.mark.parametrize("shapes", [SHAPES, [(3 * 16, [2, 1, 3]), (8, [60, 45])]])
def test_logprobs_entropy_and_gradients_equal_the_plain_forward(shapes):
    model = LlamaForCausalLM(config()).float()
    plain, shared = plain_and_shared(shapes)
    mask = scored(plain)
    assert_close(policy_logprobs(model, shared)[mask], policy_logprobs(model, plain)[mask])
    assert (policy_logprobs(model, shared)[~mask] == 0).all()
    completion = plain.completion_mask_BT.bool()
    (lp_s, ent_s), (lp_p, ent_p) = policy_logprobs_entropy(model, shared), policy_logprobs_entropy(model, plain)
    assert_close(lp_s[completion], lp_p[completion])
    assert_close(ent_s[completion], ent_p[completion], atol=1e-5)
    loss_s, grad_s = grads(model, lambda: policy_logprobs_entropy(model, shared)[0].sum())
    loss_p, grad_p = grads(model, lambda: (policy_logprobs_entropy(model, plain)[0] * completion).sum())
    assert_close(loss_s, loss_p)
    for name in grad_p:
        assert_close(grad_s[name], grad_p[name], atol=1e-6, rtol=1e-5)


def test_packing_and_a_teachers_rows_compose_with_the_shared_layout():
    """data.packing: a padding-free batch that shares prefixes runs the shared layout (which drops padding too);
    a distillation teacher's logits at chosen rows come from the same slots."""
    model = LlamaForCausalLM(config()).float().eval()
    plain, shared = plain_and_shared()
    packed = share_prefixes(dataclasses.replace(plain, padding_free=True))
    assert packed.shares_prefix and packed.forwarded_tokens() == shared.forwarded_tokens()
    mask = scored(plain)
    assert_close(policy_logprobs(model, packed)[mask], policy_logprobs(model, plain)[mask])
    rows_n = plain.completion_mask_BT.reshape(-1).nonzero().squeeze(-1)
    assert_close(policy_logits_at(model, shared, rows_n), policy_logits_at(model, plain, rows_n), atol=1e-5,
                 rtol=1e-5)


def test_values_and_scores_equal_the_plain_forward():
    plain, shared = plain_and_shared()
    critic = LlamaForTokenClassification(config(num_labels=1)).float().eval()  # no dropout
    mask = plain.attention_mask_BT.bool()
    assert_close(critic_values(critic, shared)[mask], critic_values(critic, plain)[mask])
    scorer = LlamaForSequenceClassification(config(num_labels=1)).float().eval()
    assert_close(sequence_scores(scorer, shared), sequence_scores(scorer, plain))


def one_update(model, loss_fn):
    """Loss, grad norm and weights after one SGD step of a copy of `model` (AdamW's first step is about the sign
    of each gradient element, which float rounding flips where an element is ~0: SGD shows the update itself)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    loss = loss_fn(model)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    optimizer.step()
    return loss.detach(), norm, {n: p.detach() for n, p in model.named_parameters()}


def assert_same_update(model, plain, shared, loss_of):
    loss_p, norm_p, weights_p = one_update(model, lambda m: loss_of(m, plain))
    loss_s, norm_s, weights_s = one_update(model, lambda m: loss_of(m, shared))
    assert_close(loss_s, loss_p, rtol=1e-6, atol=1e-7)
    assert_close(norm_s, norm_p, rtol=1e-6, atol=0)
    for name in weights_p:
        assert_close(weights_s[name], weights_p[name], rtol=1e-6, atol=1e-7)


def test_grpo_loss_grad_norm_and_update_equal_the_plain_batch():
    recipe = load_recipe(None, ["model.name_or_path=x", "data.train=y.jsonl", "algo.beta=0.1", "algo.num_generations=2",
                                "train.per_device_train_batch_size=10", "rewards=[{name: exact_match}]"],
                         GRPOAlgoConfig)
    grpo, model = GRPO(recipe), LlamaForCausalLM(config()).float()
    plain, _ = plain_and_shared()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an old and a reference policy a little away from this one
        old_BT = policy_logprobs(model, plain) + 0.05 * torch.randn(plain.input_ids_BT.shape, generator=g)
    plain = dataclasses.replace(plain, advantages_B=torch.randn(10, generator=g), old_logprobs_BT=old_BT,
                                ref_logprobs_BT=old_BT - 0.1)
    shared = share_prefixes(plain)
    normaliser = grpo.count(plain).float()
    assert_same_update(model, plain, shared, lambda m, b: grpo.loss(m, b, normaliser)[0])


def test_dpo_pairs_share_their_prompt_and_update_as_the_plain_batch():
    recipe = load_recipe(None, ["model.name_or_path=x", "data.train=y.jsonl"], DPOAlgoConfig)
    dpo, model = DPO(recipe), LlamaForCausalLM(config()).float()
    g = torch.Generator().manual_seed(2)
    pairs = [{"prompt_ids": torch.randint(3, VOCAB, (k,), generator=g).tolist(),
              "chosen_ids": torch.randint(3, VOCAB, (c,), generator=g).tolist(),
              "rejected_ids": torch.randint(3, VOCAB, (r,), generator=g).tolist()}
             for k, c, r in ((20, 4, 9), (10, 30, 2))]
    plain = collate_preference(pairs, PAD)
    shared = share_prefixes(plain)
    assert shared.prefix_group_B.tolist() == [0, 1, 0, 1]  # each chosen row with its rejected partner
    with torch.no_grad():
        ref_B = (policy_logprobs(model, plain) * plain.completion_mask_BT).sum(-1) - 0.3
    plain, shared = (dataclasses.replace(b, ref_logprobs_B=ref_B) for b in (plain, shared))
    normaliser = dpo.count(plain).float()
    assert_same_update(model, plain, shared, lambda m, b: dpo.loss(m, b, normaliser)[0])


def test_shape_finds_shared_prefixes_again_after_a_token_budget_regroups_rows():
    plain = collate_padded(rows(SHAPES), PAD)
    recipe = SimpleNamespace(train=SimpleNamespace(max_tokens_per_microbatch=120), data=SimpleNamespace(packing=False))
    shaped = shape([share_prefixes(plain)], recipe, PAD, agree=lambda count: count, shared_prefix=True)
    assert len(shaped) > 1
    for batch in shaped:
        if batch.shares_prefix:  # group ids of its own rows, found in this micro-batch
            assert set(batch.prefix_group_B.tolist()) <= set(range(batch.input_ids_BT.shape[0]))
    assert sum(b.forwarded_tokens() for b in shaped) < sum(b.forwarded_tokens(shared=False) for b in shaped)
    assert shape([plain], recipe, PAD, agree=lambda count: count)[0].prefix_group_B is None  # off: never shared


def test_first_step_check_stops_a_run_whose_shared_forward_differs(monkeypatch):
    model = LlamaForCausalLM(config()).float()
    _, shared = plain_and_shared()
    assert check_first_forward(model, shared) < 1e-5
    # a layout whose mask lets every token see every earlier slot (members would read each other)
    monkeypatch.setattr(PrefixLayout, "attention_mask_R1WW",
                        lambda self: torch.ones(self.group_RW.shape[1], self.group_RW.shape[1],
                                                dtype=torch.bool).tril().expand(self.group_RW.shape[0], 1, -1, -1))
    with pytest.raises(RuntimeError, match="train.shared_prefix=false"):
        check_first_forward(model, shared)


def test_start_up_refuses_true_where_it_cannot_be_exact_and_auto_falls_back(capsys):
    common = ["model.name_or_path=x", "data.train=y.jsonl"]
    eager = load_recipe(None, [*common, "model.attn_implementation=eager", "train.shared_prefix=true"], DPOAlgoConfig)
    with pytest.raises(UserError, match="attn_implementation=eager"):
        resolve_shared_prefix(eager, None)
    auto = load_recipe(None, [*common, "train.sequence_parallel_size=2"], DPOAlgoConfig)
    assert resolve_shared_prefix(auto, None) is False
    assert "train.shared_prefix=auto is off: train.sequence_parallel_size=2" in capsys.readouterr().err
    assert resolve_shared_prefix(load_recipe(None, common, DPOAlgoConfig), None) is True
    off = load_recipe(None, [*common, "train.shared_prefix=false"], DPOAlgoConfig)
    assert resolve_shared_prefix(off, None) is False
    with pytest.raises(UserError, match="train.shared_prefix"):
        load_recipe(None, [*common, "train.shared_prefix=sometimes"], DPOAlgoConfig)


def test_models_whose_attention_the_mask_cannot_keep_exact_turn_auto_off():
    """Mixture-of-experts (the router loss counts routed tokens) and sliding windows (the mask ignores them) are named;
    a dense Llama passes the probe (a narrow random model scored shared and plain)."""
    recipe = load_recipe(None, ["model.name_or_path=x", "data.train=y.jsonl"], DPOAlgoConfig)
    assert "mixture of experts" in blocker(recipe, {"model_type": "qwen3_moe"})
    assert "sliding window" in blocker(recipe, {"model_type": "mistral", "sliding_window": 4096})
    assert "vision-language" in blocker(recipe, {"model_type": "qwen2_5_vl", "vision_config": {}})
    llama = {**config().to_dict(), "model_type": "llama"}
    assert blocker(recipe, llama) is None and _probe(json.dumps(llama, sort_keys=True)) is True  # the probe ran



def every_other_completion_token_the_models_argmax(model, batch):
    """The batch with each even completion position set to the model's greedy choice there (a prediction depends on
    the tokens before it only), so a random model's accuracy is neither 0 nor 1."""
    ids, completion = batch.input_ids_BT.clone(), batch.completion_mask_BT.bool()
    for t in range(2, ids.shape[1], 2):
        if completion[:, t].any():
            with torch.no_grad():
                logits_BV = model(input_ids=ids[:, :t], attention_mask=batch.attention_mask_BT[:, :t]).logits[:, -1]
            ids[:, t] = torch.where(completion[:, t], logits_BV.argmax(-1), ids[:, t])
    return dataclasses.replace(batch, input_ids_BT=ids)


def test_sft_accuracy_of_rows_that_start_alike_equals_the_plain_forward():
    """SFT rows that start alike become a shared-prefix batch under train.shared_prefix auto: its log-probs and
    TRL's is_top1 (mean_token_accuracy's numerator) equal the plain batch's at the loss tokens, with the fused head
    (untied) and with full logits (tied); policy_logprobs_top1 used to refuse a shared batch, stopping such a run."""
    from posttrain.algorithms.sft import SFT
    from posttrain.config.schema import SFTAlgoConfig
    from posttrain.models.forward import policy_logprobs_top1

    for tied in (False, True):
        model = LlamaForCausalLM(config(tie_word_embeddings=tied)).float()
        plain = every_other_completion_token_the_models_argmax(model, collate_padded(rows(SHAPES), PAD))
        shared = share_prefixes(plain)
        completion = plain.completion_mask_BT.bool()
        (lp_s, top_s), (lp_p, top_p) = (policy_logprobs_top1(model, b, mask_BT=b.completion_mask_BT)
                                        for b in (shared, plain))
        assert_close(lp_s[completion], lp_p[completion])
        assert torch.equal(top_s[completion], top_p[completion]) and not top_s[~completion].any()
        assert 0 < int(top_p[completion].sum()) < int(completion.sum())  # a real mix of right and wrong
        sft = SFT(SimpleNamespace(algo=SFTAlgoConfig()))
        (loss_s, m_s), (loss_p, m_p) = (sft.loss(model, b, completion.sum()) for b in (shared, plain))
        assert_close(loss_s, loss_p)
        assert_close(m_s["mean_token_accuracy"], m_p["mean_token_accuracy"])
