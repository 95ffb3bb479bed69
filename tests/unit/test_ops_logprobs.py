"""posttrain.ops.logprobs against hand-worked numbers and a naive full log-softmax."""

import math

import pytest
import torch

from posttrain.ops.logprobs import (
    entropy_BT,
    masked_mean,
    masked_sum,
    segment_sum,
    sequence_mean,
    sequence_sum,
    token_logprobs,
)


def naive_token_logprobs(logits_BTV, input_ids_BT, temperature=1.0):
    logprobs_BTV = torch.log_softmax(logits_BTV.double() / temperature, dim=-1)
    picked_BT = logprobs_BTV[:, :-1].gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked_BT[:, :1]), picked_BT], dim=1)


def random_batch(B=3, T=5, V=11, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits_BTV = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
    input_ids_BT = torch.randint(0, V, (B, T), generator=g)
    return logits_BTV, input_ids_BT


def test_token_logprobs_by_hand():
    # logits at t=0 predict token 1, at t=1 predict token 2; the last position predicts nothing
    logits_BTV = torch.tensor([[[0.0, math.log(2.0), 0.0], [1.0, 2.0, 3.0], [9.0, 9.0, 9.0]]])
    input_ids_BT = torch.tensor([[2, 1, 0]])
    expected = [0.0, math.log(2 / 4), 1.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))]
    assert token_logprobs(logits_BTV, input_ids_BT)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_token_logprobs_temperature_by_hand():
    # logits / 2 = [0, 1]: log p(token 1) = 1 - log(1 + e)
    logits_BTV = torch.tensor([[[0.0, 2.0], [5.0, 5.0]]])
    got = token_logprobs(logits_BTV, torch.tensor([[0, 1]]), temperature=2.0)
    assert got[0].tolist() == pytest.approx([0.0, 1.0 - math.log(1 + math.e)], abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 1024])  # B*T = 15: smaller, uneven, equal, larger
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_naive(chunk_size, temperature):
    logits_BTV, input_ids_BT = random_batch()
    got = token_logprobs(logits_BTV, input_ids_BT, temperature=temperature, chunk_size=chunk_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_token_logprobs(logits_BTV, input_ids_BT, temperature), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_token_logprobs_gradient_matches_naive(chunk_size):
    logits_BTV, input_ids_BT = random_batch(seed=1)
    weights_BT = torch.randn(input_ids_BT.shape, generator=torch.Generator().manual_seed(2))
    ours = logits_BTV.clone().requires_grad_()
    (token_logprobs(ours, input_ids_BT, temperature=0.7, chunk_size=chunk_size) * weights_BT).sum().backward()
    naive = logits_BTV.clone().requires_grad_()
    (naive_token_logprobs(naive, input_ids_BT, temperature=0.7).float() * weights_BT).sum().backward()
    torch.testing.assert_close(ours.grad, naive.grad, atol=1e-6, rtol=1e-5)


def test_token_logprobs_gradcheck_float64():
    logits_BTV, input_ids_BT = random_batch(B=2, T=3, V=4, seed=3, dtype=torch.float64)
    logits_BTV.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, input_ids_BT, 0.9, chunk_size=2), (logits_BTV,))


def test_token_logprobs_bf16_logits_use_float32_math():
    logits_BTV, input_ids_BT = random_batch(dtype=torch.bfloat16)
    logits_BTV.requires_grad_()
    got = token_logprobs(logits_BTV, input_ids_BT, chunk_size=4)
    assert got.dtype == torch.float32
    # bf16 values are exact in float32, so float32 math must match the float64 reference to float32 precision
    torch.testing.assert_close(got.double(), naive_token_logprobs(logits_BTV.detach(), input_ids_BT), atol=1e-5, rtol=0)
    got.sum().backward()
    assert logits_BTV.grad.dtype == torch.bfloat16


def test_token_logprobs_non_contiguous_logits():
    logits_BTV, input_ids_BT = random_batch()
    strided_BTV = logits_BTV.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided_BTV.is_contiguous()
    torch.testing.assert_close(token_logprobs(strided_BTV, input_ids_BT, chunk_size=4), token_logprobs(logits_BTV, input_ids_BT))


def test_token_logprobs_saves_no_float32_copy_of_the_logits():
    logits_BTV, input_ids_BT = random_batch(B=2, T=8, V=64, dtype=torch.bfloat16)
    logits_BTV.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        token_logprobs(logits_BTV, input_ids_BT, chunk_size=4)
    logits_bytes = logits_BTV.numel() * logits_BTV.element_size()
    assert sum(saved) <= logits_bytes + 1024  # the logits themselves plus per-row targets and logsumexps


def test_token_logprobs_rejects_bad_arguments():
    logits_BTV, input_ids_BT = random_batch()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits_BTV, input_ids_BT, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(logits_BTV, input_ids_BT, chunk_size=0)


def test_entropy_by_hand():
    # uniform over 4 tokens: log 4; logits [0, log 3]: p = [1/4, 3/4]
    logits_BTV = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4], [1.0, 2.0, 3.0, 4.0]]])
    expected = [0.0, math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert entropy_BT(logits_BTV, chunk_size=2)[0].tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_entropy_matches_naive(chunk_size):
    logits_BTV, _ = random_batch(dtype=torch.bfloat16)
    logprobs_BTV = torch.log_softmax(logits_BTV.double() / 0.8, dim=-1)
    naive_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    naive_BT = torch.cat([torch.zeros_like(naive_BT[:, :1]), naive_BT[:, :-1]], dim=1)
    got = entropy_BT(logits_BTV, chunk_size=chunk_size, temperature=0.8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_BT, atol=1e-5, rtol=0)


def test_masked_reductions_by_hand():
    x_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask_BT = torch.tensor([[False, True, True], [False, True, False]])
    assert masked_sum(x_BT, mask_BT).item() == 2 + 3 + 5
    assert masked_mean(x_BT, mask_BT).item() == pytest.approx((2 + 3 + 5) / 3)
    assert sequence_sum(x_BT, mask_BT).tolist() == [5.0, 5.0]
    assert sequence_mean(x_BT, mask_BT).tolist() == [2.5, 5.0]


def test_masked_reductions_of_an_empty_mask_are_zero():
    x_BT, mask_BT = torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x_BT, mask_BT).item() == 0.0
    assert sequence_mean(x_BT, mask_BT).tolist() == [0.0, 0.0]


def test_segment_sum_by_hand():
    # packed: [pad-ish token of none | seq 0: 3 tokens | seq 1: 2 tokens | seq 2: 1 token]
    x_BT = torch.tensor([[100.0, 1.0, 2.0, 3.0, 10.0, 20.0, 7.0]])
    mask_BT = torch.tensor([[True, False, True, True, False, True, True]])
    index_BT = torch.tensor([[-1, 0, 0, 0, 1, 1, 2]])
    assert segment_sum(x_BT, mask_BT, index_BT, num_sequences=3).tolist() == [2.0 + 3.0, 20.0, 7.0]


def test_segment_sum_equals_sequence_sum_of_the_unpacked_rows():
    x_BT, mask_BT = torch.randn(3, 4), torch.rand(3, 4) > 0.3
    index_BT = torch.arange(3)[:, None].expand(3, 4)
    packed = segment_sum(x_BT.reshape(1, -1), mask_BT.reshape(1, -1), index_BT.reshape(1, -1), num_sequences=3)
    torch.testing.assert_close(packed, sequence_sum(x_BT, mask_BT))


def test_segment_sum_passes_gradient():
    x_BT = torch.ones(1, 4, requires_grad=True)
    segment_sum(x_BT, torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]]), num_sequences=2).sum().backward()
    assert x_BT.grad.tolist() == [[0.0, 1.0, 1.0, 1.0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_token_logprobs_cuda_bf16_matches_naive():
    logits_BTV, input_ids_BT = random_batch(B=4, T=64, V=1000, dtype=torch.bfloat16)
    logits_BTV = logits_BTV.cuda().requires_grad_()
    got = token_logprobs(logits_BTV, input_ids_BT.cuda(), chunk_size=100)
    naive = naive_token_logprobs(logits_BTV.detach().cpu(), input_ids_BT)
    torch.testing.assert_close(got.double().cpu(), naive, atol=1e-5, rtol=0)
    got.sum().backward()
    assert torch.isfinite(logits_BTV.grad.float()).all()
