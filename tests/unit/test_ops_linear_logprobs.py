"""ops.linear_token_logprobs (output layer + log-softmax fused and chunked) against the unfused reference, and the
model-level fused path of algorithms.forward.policy_logprobs against the logits path on the tiny model."""

import pytest
import torch

from posttrain.ops.logprobs import entropy_BT, linear_token_logprobs, linear_token_logprobs_entropy, token_logprobs


def hidden_batch(B=3, T=5, H=6, V=11, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden_BTH = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight_VH = torch.randn(V, H, generator=g, dtype=dtype)
    input_ids_BT = torch.randint(0, V, (B, T), generator=g)
    return hidden_BTH, weight_VH, input_ids_BT


def unfused(hidden_BTH, weight_VH, input_ids_BT, temperature=1.0):
    return token_logprobs(hidden_BTH @ weight_VH.t(), input_ids_BT, temperature=temperature)


def test_by_hand():
    # one row predicts token 1 from hidden [1, 0]: logits = [0, log 3] -> log p(1) = log(3/4)
    hidden_BTH = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    weight_VH = torch.tensor([[0.0, 5.0], [torch.log(torch.tensor(3.0)).item(), 1.0]])
    got = linear_token_logprobs(hidden_BTH, weight_VH, torch.tensor([[0, 1]]))
    assert got[0].tolist() == pytest.approx([0.0, torch.log(torch.tensor(0.75)).item()], abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 1000])  # B*T = 15
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_the_unfused_path(chunk_size, temperature):
    hidden_BTH, weight_VH, input_ids_BT = hidden_batch()
    weights_BT = torch.randn(input_ids_BT.shape, generator=torch.Generator().manual_seed(3))
    ours = [hidden_BTH.clone().requires_grad_(), weight_VH.clone().requires_grad_()]
    ref = [hidden_BTH.clone().requires_grad_(), weight_VH.clone().requires_grad_()]
    got = linear_token_logprobs(*ours, input_ids_BT, temperature, chunk_size=chunk_size)
    want = unfused(*ref, input_ids_BT, temperature)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (got * weights_BT).sum().backward()
    (want * weights_BT).sum().backward()
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_entropy_from_the_same_chunks_matches_entropy_of_the_logits(chunk_size):
    hidden_BTH, weight_VH, input_ids_BT = hidden_batch(seed=2)
    hidden = hidden_BTH.clone().requires_grad_()
    logprobs_BT, got_BT = linear_token_logprobs_entropy(hidden, weight_VH, input_ids_BT, 0.7, chunk_size=chunk_size)
    want_BT = entropy_BT(hidden_BTH @ weight_VH.t(), temperature=0.7)  # lse - E[x]: the same value, other rounding
    torch.testing.assert_close(got_BT, want_BT, atol=1e-5, rtol=1e-5)
    assert not got_BT.requires_grad  # a metric
    torch.testing.assert_close(logprobs_BT, linear_token_logprobs(hidden_BTH, weight_VH, input_ids_BT, 0.7))
    logprobs_BT.sum().backward()  # the entropy output takes no part in the gradient
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_a_mask_scores_only_its_positions_with_the_same_values_and_gradients():
    hidden_BTH, weight_VH, input_ids_BT = hidden_batch(seed=5)
    mask_BT = torch.zeros(input_ids_BT.shape, dtype=torch.bool)
    mask_BT[0, 2:] = mask_BT[2, 1:3] = True  # row 1: nothing scored
    weights_BT = torch.randn(input_ids_BT.shape, generator=torch.Generator().manual_seed(6))
    results = []
    for mask in (mask_BT, None):
        h, w = hidden_BTH.clone().requires_grad_(), weight_VH.clone().requires_grad_()
        logprobs_BT, entropy_BT = linear_token_logprobs_entropy(h, w, input_ids_BT, 0.9, chunk_size=2, mask_BT=mask)
        (torch.where(mask_BT, logprobs_BT, 0.0) * weights_BT).sum().backward()
        results.append((logprobs_BT.detach(), entropy_BT, h.grad, w.grad))
    (masked, masked_entropy, *masked_grads), (full, full_entropy, *full_grads) = results
    assert (masked[~mask_BT] == 0).all() and (masked_entropy[~mask_BT] == 0).all()
    torch.testing.assert_close(masked[mask_BT], full[mask_BT])
    torch.testing.assert_close(masked_entropy[mask_BT], full_entropy[mask_BT])
    for mine, theirs in zip(masked_grads, full_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


def test_gradcheck_float64():
    hidden_BTH, weight_VH, input_ids_BT = hidden_batch(B=2, T=3, H=4, V=5, dtype=torch.float64)
    inputs = (hidden_BTH.requires_grad_(), weight_VH.requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: linear_token_logprobs(h, w, input_ids_BT, 0.9, chunk_size=2), inputs)


def test_bf16_autocast_matches_the_unfused_path_under_autocast():
    hidden_BTH, weight_VH, input_ids_BT = hidden_batch(H=16, V=64, seed=4)
    results = []
    for fn in (linear_token_logprobs, unfused):
        h, w = hidden_BTH.clone().requires_grad_(), weight_VH.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(h, w, input_ids_BT)
        out.sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    assert results[0][0].dtype == torch.float32
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # both in bf16 matmuls; chunking changes rounding


def padded_batch(vocab: int, seed: int, padded_row: int, pad_from: int, length: int = 9, padding_free: bool = False):
    """Two rows of random ids, one right-padded from `pad_from`; every real token in the completion mask."""
    from posttrain.batch import Batch

    input_ids_BT = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))
    attention_mask_BT = torch.ones_like(input_ids_BT)
    attention_mask_BT[padded_row, pad_from:] = 0
    return Batch(input_ids_BT=input_ids_BT, completion_mask_BT=attention_mask_BT.bool(),
                 attention_mask_BT=attention_mask_BT, num_sequences=2, padding_free=padding_free)


def test_policy_logprobs_fused_equals_the_logits_path(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.models.forward import fusable_head, policy_logits, policy_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert fusable_head(model) is model.lm_head
    batch = padded_batch(model.config.vocab_size, seed=0, padded_row=1, pad_from=6)
    input_ids_BT = batch.input_ids_BT
    fused = policy_logprobs(model, batch, temperature=0.8)
    assert "forward" not in vars(model.lm_head)  # the swap is undone
    (fused * batch.completion_mask_BT).sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = token_logprobs(policy_logits(model, batch), input_ids_BT, temperature=0.8)
    (reference * batch.completion_mask_BT).sum().backward()
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_heads_that_are_not_plain_take_the_logits_path(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.models.forward import fusable_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.model_type = "gemma2"  # soft-caps its logits after the head
    assert fusable_head(model) is None


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_policy_logprobs_entropy_equals_logprobs_and_entropy_of_the_logits(tiny_model_dir, padding_free, fused):
    import dataclasses

    from transformers import AutoModelForCausalLM

    from posttrain.models.forward import policy_logits, policy_logprobs_entropy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if not fused:
        model.config.model_type = "gemma2"  # not fusable: the logits path
    batch = padded_batch(model.config.vocab_size, seed=1, padded_row=1, pad_from=6, padding_free=padding_free)
    input_ids_BT, attention_mask_BT = batch.input_ids_BT, batch.attention_mask_BT
    logprobs_BT, got_BT = policy_logprobs_entropy(model, batch, temperature=0.8)
    reference_batch = dataclasses.replace(batch, padding_free=False)
    with torch.no_grad():
        logits_BTV = policy_logits(model, reference_batch)
    mask_BT = attention_mask_BT.bool()
    want_logprobs_BT = token_logprobs(logits_BTV, input_ids_BT, temperature=0.8)
    want_BT = entropy_BT(logits_BTV, temperature=0.8)
    torch.testing.assert_close(logprobs_BT[mask_BT], want_logprobs_BT[mask_BT], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_BT[mask_BT], want_BT[mask_BT], atol=1e-5, rtol=1e-5)
    assert logprobs_BT.requires_grad and not got_BT.requires_grad


def test_policy_logits_at_projects_only_the_asked_rows_with_the_same_values_and_gradients(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.models.forward import policy_logits, policy_logits_at

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = padded_batch(model.config.vocab_size, seed=2, padded_row=0, pad_from=5, length=7)
    rows_n = torch.tensor([1, 3, 8, 12])
    calls = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    got_nV = policy_logits_at(model, batch, rows_n)
    handle.remove()
    assert calls == [torch.Size([4, model.config.vocab_size])] and "forward" not in vars(model.lm_head)
    got_nV.square().sum().backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want_nV = policy_logits(model, batch).reshape(-1, model.config.vocab_size)[rows_n]
    want_nV.square().sum().backward()
    torch.testing.assert_close(got_nV, want_nV, atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_top1_from_the_chunks_is_trls_is_top1_ties_included():
    """linear_next_token_stats' top1 against the argmax of the full logits and TRL 1.16's own chunked kernel
    (trl.kernels.chunked_logprob, its torch path): equal, a tie between two vocabulary rows included (the first index
    wins, so a target tied with an earlier token is not top-1)."""
    from posttrain.ops.logprobs import linear_next_token_stats

    kernel = pytest.importorskip("trl.kernels.chunked_logprob")
    hidden_BTH, weight_VH, _ = hidden_batch(B=4, T=6, H=6, V=11, seed=3)
    weight_VH[7] = weight_VH[2]  # tokens 2 and 7 always tie
    logits_BTV = hidden_BTH @ weight_VH.t()
    next_ids_BT = logits_BTV.argmax(-1)  # every target top-1 ...
    next_ids_BT[0] = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(0))  # ... but row 0's
    next_ids_BT[1, :] = torch.where(logits_BTV[1].argmax(-1) == 2, 7, next_ids_BT[1])  # tied, later index
    for chunk_size in (1, 5, 100):
        _, _, top1_BT = linear_next_token_stats(hidden_BTH, weight_VH, next_ids_BT, chunk_size=chunk_size,
                                                with_top1=True)
        assert top1_BT.dtype == torch.bool
        assert torch.equal(top1_BT, logits_BTV.argmax(-1) == next_ids_BT)
        outputs = kernel.ChunkedLogProbFunction.apply(hidden_BTH.reshape(-1, 6), weight_VH, None,
                                                      next_ids_BT.reshape(-1), 1.0, 4, None, 1.0, ("is_top1",))
        assert torch.equal(top1_BT.reshape(-1), outputs[-1])
    assert 0 < top1_BT.float().mean() < 1 and not top1_BT[1][logits_BTV[1].argmax(-1) == 2].any()


def greedy_batch(model, padding_free: bool):
    """Row 0: a prompt and the model's own greedy continuation (its tokens are mostly top-1); row 1: random ids,
    right-padded. Every real token after the first in the completion mask."""
    from posttrain.batch import Batch

    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=9,
                                min_new_tokens=9, pad_token_id=0)[:, :12]
    rows = torch.cat([greedy, torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(6))])
    attention_mask_BT = torch.ones_like(rows)
    attention_mask_BT[1, 9:] = 0
    completion_mask_BT = attention_mask_BT.bool().clone()
    completion_mask_BT[:, :1] = False
    return Batch(input_ids_BT=rows, completion_mask_BT=completion_mask_BT, attention_mask_BT=attention_mask_BT,
                 num_sequences=2, padding_free=padding_free)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_sft_mean_token_accuracy_is_trls_formula(tiny_model_dir, padding_free, fused):
    """SFT's mean_token_accuracy against TRL's formula on the full logits of the tiny model (its SFTTrainer before
    the fused head: shift, argmax, compare with the labels where they are not -100, divide by their count)."""
    from transformers import AutoModelForCausalLM

    from posttrain.algorithms.sft import SFT
    from posttrain.config.load import load_recipe
    from posttrain.config.schema import SFTAlgoConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = greedy_batch(model, padding_free)
    if not fused:
        model.config.model_type = "gemma2"  # not fusable: the logits path
    sft = SFT(load_recipe(None, ["data.train=x.jsonl"], SFTAlgoConfig))
    loss, metrics = sft.loss(model, batch, batch.completion_mask_BT.sum())
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    labels = torch.where(batch.completion_mask_BT, batch.input_ids_BT, -100)[:, 1:]
    predictions, mask = logits[:, :-1].argmax(dim=-1), labels != -100
    trl_accuracy = ((predictions == labels) & mask).sum() / mask.sum()
    assert 0.2 < float(trl_accuracy) < 0.9  # greedy row mostly right, random row mostly wrong
    assert float(metrics["mean_token_accuracy"]) == pytest.approx(float(trl_accuracy), abs=1e-7)
    assert not metrics["mean_token_accuracy"].requires_grad and loss.requires_grad


def test_the_accuracy_makes_no_full_vocabulary_tensor(tiny_model_dir, monkeypatch):
    """Every tensor the SFT loss makes, forward and backward, with the fused output layer in chunks of 4 rows: none has
    the vocabulary as its last dimension over more rows than a chunk, with the accuracy as without it; the logits
    path, checked the same way, does make one (the check can see it)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from posttrain.algorithms.sft import SFT
    from posttrain.config.load import load_recipe
    from posttrain.config.schema import SFTAlgoConfig
    from posttrain.models.forward import policy_logprobs
    from posttrain.ops import logprobs as ops

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    monkeypatch.setattr(ops, "LINEAR_CHUNK_ELEMENTS", 4 * vocab)
    batch = greedy_batch(model, padding_free=False)
    sft = SFT(load_recipe(None, ["data.train=x.jsonl"], SFTAlgoConfig))

    class VocabRows(TorchDispatchMode):
        """The most rows of any tensor made whose last dimension is the vocabulary (views, such as the output layer's
        weight transposed for its matmul, make no memory)."""
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in () if func.is_view else out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab:
                    self.most = max(self.most, t.numel() // vocab)
            return out

    def rows_of(loss_fn):
        with VocabRows() as seen:
            loss_fn().backward()
        model.zero_grad()
        return seen.most

    with_accuracy = rows_of(lambda: sft.loss(model, batch, batch.completion_mask_BT.sum())[0])
    without = rows_of(lambda: (policy_logprobs(model, batch) * batch.completion_mask_BT).sum())
    assert with_accuracy == without == 4 < batch.input_ids_BT.numel()
    model.config.model_type = "gemma2"  # the logits path: (B, T, V) logits
    assert rows_of(lambda: sft.loss(model, batch, batch.completion_mask_BT.sum())[0]) >= batch.input_ids_BT.numel()
