"""posttrain.losses.distill against hand-worked numbers, autograd, and TRL 1.16's own distillation losses."""

import math

import pytest
import torch

from posttrain.losses.distill import (DIVERGENCES, distill_loss, distill_loss_at, divergence_name, predicting_rows,
                                     topk_distill_loss)
from posttrain.ops.logprobs import masked_sum

# one sequence of 3 tokens, vocabulary 2; positions 1 and 2 are completion tokens (predicted by rows 0 and 1)
IDS_BT = torch.tensor([[1, 0, 1]])
MASK_BT = torch.tensor([[False, True, True]])


def hand_case(temperature: float = 1.0):
    """Row 0: student (1/2, 1/2), teacher (3/4, 1/4). Row 1: both (1/2, 1/2). Logits scaled by the temperature."""
    student = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, -5.0]]], dtype=torch.float64) * temperature
    teacher = torch.tensor([[[math.log(3), 0.0], [0.0, 0.0], [-5.0, 5.0]]], dtype=torch.float64) * temperature
    return student.requires_grad_(), teacher


# row 0 by hand: p_s = (1/2, 1/2), p_t = (3/4, 1/4), m = beta p_t + (1 - beta) p_s
FORWARD_KL = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
REVERSE_KL = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
JSD_HALF = 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)) + \
    0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))


@pytest.mark.parametrize("beta, expected", [(0.0, FORWARD_KL), (1.0, REVERSE_KL), (0.5, JSD_HALF)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_hand_worked_two_token_case(beta, expected, temperature):
    student, teacher = hand_case(temperature)
    out = distill_loss(student, teacher, IDS_BT, MASK_BT, beta, temperature)
    assert out.loss_BT[0, 1].item() == pytest.approx(expected, rel=1e-9)
    assert out.loss_BT[0, 0].item() == 0.0  # nothing predicts position 0
    assert out.loss_BT[0, 2].item() == pytest.approx(0.0, abs=1e-12)  # equal distributions


def test_forward_kl_gradient_is_student_minus_teacher_over_temperature():
    student, teacher = hand_case(temperature=2.0)
    masked_sum(distill_loss(student, teacher, IDS_BT, MASK_BT, 0.0, 2.0).loss_BT, MASK_BT).backward()
    assert student.grad[0, 0].tolist() == pytest.approx([(0.5 - 0.75) / 2, (0.5 - 0.25) / 2], rel=1e-9)
    assert student.grad[0, 2].tolist() == [0.0, 0.0]  # the last row predicts nothing in the mask


def test_metrics_by_hand():
    student, teacher = hand_case()
    metrics = distill_loss(student, teacher, IDS_BT, MASK_BT, 0.5).metrics_BT
    assert metrics["forward_kl"][0, 1].item() == pytest.approx(FORWARD_KL)
    assert metrics["reverse_kl"][0, 1].item() == pytest.approx(REVERSE_KL)
    assert metrics["teacher_logprob"][0, 1].item() == pytest.approx(math.log(0.75))  # token 0 follows row 0
    assert metrics["student_logprob"][0, 1].item() == pytest.approx(math.log(0.5))
    assert metrics["teacher_logprob"][0, 2].item() == pytest.approx(math.log(0.5))  # token 1 follows row 1
    # row 0: the student's argmax (a tie: token 0) is the teacher's; row 1 ties both ways -> 0 == 0
    assert metrics["top1_agreement"][0].tolist() == [0.0, 1.0, 1.0]


def test_beta_picks_the_variant_like_trl():
    assert [divergence_name(b) for b in (0, 0.0, 0.3, 1, 1.0)] == ["forward_kl", "forward_kl", "jsd", "reverse_kl",
                                                                   "reverse_kl"]
    with pytest.raises(ValueError):
        divergence_name(1.5)


def random_case(seed=0, batch=3, length=7, vocab=11, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(batch, length, vocab, generator=g, dtype=dtype) * 2).requires_grad_()
    teacher = torch.randn(batch, length, vocab, generator=g, dtype=dtype) * 2
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.rand(batch, length, generator=g) > 0.3
    mask[:, 0] = False
    return student, teacher, ids, mask


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_chunked_gradient_equals_autograd_of_the_divergence(beta):
    """The closed-form backward against autograd through the same math on full log-softmaxes."""
    student, teacher, ids, mask = random_case()
    out = distill_loss(student, teacher, ids, mask, beta, temperature=1.5, chunk_size=2)
    weights = torch.rand(mask.shape, dtype=torch.float64)
    (out.loss_BT * weights).sum().backward()
    got = student.grad.clone()
    student.grad = None
    value = DIVERGENCES[divergence_name(beta)].value
    s = torch.log_softmax(student[:, :-1] / 1.5, -1).flatten(0, 1)
    t = torch.log_softmax(teacher[:, :-1] / 1.5, -1).flatten(0, 1)
    reference_BT = value(s, t, beta).view(mask.shape[0], -1)
    (reference_BT * (weights * mask)[:, 1:]).sum().backward()
    torch.testing.assert_close(got, student.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.loss_BT[:, 1:], torch.where(mask[:, 1:], reference_BT, 0.0).detach())


def test_the_predicting_rows_alone_give_the_same_loss_metrics_and_gradient():
    student, teacher, ids, mask = random_case(seed=2)
    full = distill_loss(student, teacher, ids, mask, 0.5, chunk_size=3)
    rows_n = predicting_rows(mask)
    student_nV = student.reshape(-1, student.shape[-1])[rows_n]
    at = distill_loss_at(student_nV, teacher.reshape(-1, teacher.shape[-1])[rows_n], ids, mask, 0.5, chunk_size=3)
    torch.testing.assert_close(at.loss_BT, full.loss_BT, rtol=0, atol=0)
    for name in full.metrics_BT:
        torch.testing.assert_close(at.metrics_BT[name], full.metrics_BT[name], rtol=0, atol=0)
    grads = [torch.autograd.grad(out.loss_BT.sum(), student)[0] for out in (full, at)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="per completion token"):
        distill_loss_at(student_nV[1:], teacher.reshape(-1, teacher.shape[-1])[rows_n][1:], ids, mask, 0.5)


def test_chunk_size_changes_nothing():
    student, teacher, ids, mask = random_case(seed=1)
    one = distill_loss(student, teacher, ids, mask, 0.5, chunk_size=1)
    many = distill_loss(student, teacher, ids, mask, 0.5, chunk_size=1000)
    torch.testing.assert_close(one.loss_BT, many.loss_BT, rtol=1e-12, atol=1e-15)  # summation order only
    for name in one.metrics_BT:
        torch.testing.assert_close(one.metrics_BT[name], many.metrics_BT[name], rtol=1e-12, atol=1e-15)
    grads = [torch.autograd.grad(out.loss_BT.sum(), student)[0] for out in (one, many)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)


def test_topk_over_the_whole_vocabulary_is_the_full_loss():
    student, teacher, ids, mask = random_case(seed=2)
    full = distill_loss(student, teacher, ids, mask, 0.5, temperature=0.7)
    teacher_logprobs_BTV = torch.log_softmax(teacher, -1)  # raw (temperature 1), as vLLM returns them
    # aligned with input_ids: position t holds the distribution that predicts token t (rows t - 1)
    logprobs_BTK, topk_ids_BTK = teacher_logprobs_BTV.topk(teacher.shape[-1], dim=-1)
    logprobs_BTK = torch.cat([logprobs_BTK[:, :1], logprobs_BTK[:, :-1]], dim=1)
    topk_ids_BTK = torch.cat([topk_ids_BTK[:, :1], topk_ids_BTK[:, :-1]], dim=1)
    topk = topk_distill_loss(student, logprobs_BTK, topk_ids_BTK, ids, mask, 0.5, temperature=0.7)
    torch.testing.assert_close(topk.loss_BT, full.loss_BT)
    for name in ("forward_kl", "reverse_kl", "student_logprob"):
        torch.testing.assert_close(topk.metrics_BT[name], full.metrics_BT[name])


def test_topk_renormalises_over_the_support_by_hand():
    # vocabulary 3, k = 2: teacher top-2 log-probs log(0.6), log(0.2) (renormalised: 3/4, 1/4); student uniform over
    # the 3 tokens (renormalised over the 2: 1/2, 1/2)
    student = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)
    logprobs = torch.tensor([[[0.0, 0.0], [math.log(0.6), math.log(0.2)]]], dtype=torch.float64)
    topk_ids = torch.tensor([[[0, 1], [2, 0]]])
    out = topk_distill_loss(student, logprobs, topk_ids, torch.tensor([[0, 2]]), torch.tensor([[False, True]]), 0.0)
    assert out.loss_BT[0, 1].item() == pytest.approx(FORWARD_KL)
    assert out.loss_BT[0, 0].item() == 0.0


# --- TRL 1.16 as the peer implementation (imported here only) -------------------------------------------------------


@pytest.fixture(scope="module")
def trl_losses():
    pytest.importorskip("trl", minversion="1.16")
    from trl.experimental.gkd import GKDTrainer
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    return GKDTrainer.generalized_jsd_loss, _chunked_divergence_loss


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_equals_trl_gkd_and_distillation_losses(trl_losses, beta, temperature):
    """Forward (beta 0), reverse (beta 1) and JSD: the step loss (sum / tokens) and its gradient equal TRL's GKD
    generalized_jsd_loss on the same logits, and TRL's DistillationTrainer chunked loss (its lm_heads given as the
    identity, so its 'hidden states' are the logits)."""
    gkd_loss, chunked_loss = trl_losses
    student, teacher, ids, mask = random_case(seed=3, dtype=torch.float32)
    ours = masked_sum(distill_loss(student, teacher, ids, mask, beta, temperature).loss_BT, mask) / mask.sum()
    ours.backward()
    our_grad, student.grad = student.grad.clone(), None

    labels = torch.where(mask[:, 1:], ids[:, 1:], -100)
    theirs = gkd_loss(student[:, :-1], teacher[:, :-1], labels=labels, beta=beta, temperature=temperature)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_grad, student.grad, rtol=1e-4, atol=1e-6)
    student.grad = None

    eye = torch.eye(student.shape[-1])
    chunked, _, _ = chunked_loss(student[:, :-1], teacher[:, :-1], eye, eye, mask[:, 1:].long(), beta,
                                 num_items_in_batch=mask.sum(), temperature=temperature)
    chunked.backward()
    torch.testing.assert_close(ours, chunked, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_grad, student.grad, rtol=1e-4, atol=1e-6)


def test_vllm_prompt_logprobs_become_top_k_tensors():
    """The shape of vLLM's choices[0].prompt_logprobs (JSON keys are strings): the prompt's own token rides along with
    its rank and is dropped when it is not in the top k."""
    from posttrain.generation.teacher_server import parse_prompt_logprobs

    answer = [None,
              {"7": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}, "3": {"logprob": -2.5, "rank": 2},
               "9": {"logprob": -6.0, "rank": 40}},
              {"4": {"logprob": -1.5, "rank": 2}, "5": {"logprob": -0.4, "rank": 1}}]
    logprobs_TK, ids_TK = parse_prompt_logprobs(answer, k=2)
    assert ids_TK.tolist() == [[0, 1], [7, 3], [5, 4]]
    torch.testing.assert_close(logprobs_TK, torch.tensor([[0.0, 0.0], [-0.1, -2.5], [-0.4, -1.5]]))
    with pytest.raises(ValueError, match="max-logprobs"):
        parse_prompt_logprobs(answer, k=3)


@pytest.mark.parametrize("answer, says", [
    ([None, {"70000": {"logprob": -0.1, "rank": 1}, "3": {"logprob": -2.5, "rank": 2}}],
     "position 1: token id 70000 is outside the vocabulary [0, 1000)"),
    ([None, {"7": {"logprob": 0.5, "rank": 1}, "3": {"logprob": -2.5, "rank": 2}}],
     "position 1: log-prob 0.5 of token 7: a log-prob is a finite number <= 0"),
    ([None, {"7": {"logprob": float("nan"), "rank": 1}, "3": {"logprob": -2.5, "rank": 2}}], "log-prob nan"),
    ([None, {"7": {"logprob": -0.1, "rank": 0}, "3": {"logprob": -2.5, "rank": 2}}], "rank 0 of token 7"),
    ([None, {"x": {"logprob": -0.1, "rank": 1}}], "position 1: 'x'"),
    ([None, [1, 2]], "position 1: an entry must be an object"),
    ([None], "'prompt_logprobs' must hold one entry per token (2), got 1"),
])
def test_a_teacher_server_answer_that_no_vllm_sends_is_named_and_stops_the_run(monkeypatch, answer, says):
    """Ids out of range, positive or NaN log-probs and short answers used to crash or be trained on."""
    from posttrain.errors import RunStopped
    from posttrain.generation import teacher_server

    server = teacher_server.TeacherServer("http://127.0.0.1:1", top_k=2, timeout=1.0, retries=0)
    server.vocab_size = 1000
    monkeypatch.setattr(teacher_server, "call_with_retries",
                        lambda *a, **k: {"choices": [{"prompt_logprobs": answer}]})
    with pytest.raises(RunStopped) as e:
        server.topk([[5, 6]])
    assert "the teacher server http://127.0.0.1:1 sent a wrong answer to /v1/completions" in str(e.value)
    assert says in str(e.value)


def test_a_teacher_server_that_names_no_model_is_exit_2_at_start_up(monkeypatch):
    from posttrain.errors import UserError
    from posttrain.generation import teacher_server

    monkeypatch.setattr(teacher_server, "call", lambda url, path, *a, **k: {"data": []} if "models" in path
                        else {"tokens": [1]})
    with pytest.raises(UserError, match=r"algo.teacher_server = http://127.0.0.1:1: its /v1/models or /tokenize "
                                        r"answer names no model or tokens \({'data': \[\]}\)"):
        teacher_server.TeacherServer("http://127.0.0.1:1", 2, 1.0, 0).check(None, "tiny/")
