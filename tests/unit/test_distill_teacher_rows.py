"""A local distillation teacher projects only the rows the loss uses (Role.logits_at), as the student does: the rows
that predict a completion token, in the padded and the padding-free (data.packing) layouts, the teacher held plainly
or offloaded (algo.teacher_offload); distill's loss, the student's gradients and the metrics are those of the
full-logits path (both models' (B, T, V) logits into losses.distill.distill_loss), in float32."""

import dataclasses

import pytest
import torch

from posttrain.algorithms import ALGORITHMS
from posttrain.batch import Batch
from posttrain.config.load import load_recipe
from posttrain.distributed.offload import Offloaded
from posttrain.losses.distill import distill_loss, predicting_rows
from posttrain.models.forward import policy_logits
from posttrain.ops.logprobs import masked_mean, masked_sum
from posttrain.roles import LocalRole


@pytest.fixture(scope="module")
def models(tiny_model_dir, teacher_dir):
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    return student, teacher


def completion_batch(vocab: int) -> Batch:
    """Three rows of prompt then completion, two right-padded (different lengths, so a packed forward mixes them)."""
    ids_BT = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    lengths, prompts = [9, 6, 4], [3, 2, 1]
    positions_BT = torch.arange(9).expand(3, 9)
    attention_BT = (positions_BT < torch.tensor(lengths)[:, None]).long()
    completion_BT = attention_BT.bool() & (positions_BT >= torch.tensor(prompts)[:, None])
    return Batch(input_ids_BT=ids_BT * attention_BT, completion_mask_BT=completion_BT, attention_mask_BT=attention_BT,
                 num_sequences=3)


def full_logits_loss(student, teacher, batch: Batch, beta: float, temperature: float):
    """distill's loss and metrics as they were before Role.logits_at: both models' whole logits."""
    with torch.no_grad():
        teacher_BTV = policy_logits(teacher, batch)
    out = distill_loss(policy_logits(student, batch), teacher_BTV, batch.input_ids_BT, batch.completion_mask_BT, beta,
                       temperature)
    mask_BT = batch.completion_mask_BT
    metrics = {name: masked_mean(value_BT, mask_BT) for name, value_BT in out.metrics_BT.items()}
    return masked_sum(out.loss_BT, mask_BT) / mask_BT.sum(), metrics


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("padding_free", [False, True])
def test_the_teacher_projects_only_the_completion_rows_and_the_loss_is_the_full_logits_one(models, padding_free,
                                                                                          offload):
    student, teacher = models
    recipe = load_recipe(None, ["data.train=a.jsonl", "algo.teacher_model_name_or_path=teacher/", "algo.beta=0.5",
                                "algo.temperature=0.9"], ALGORITHMS["distill"][0])
    algorithm = ALGORITHMS["distill"][1](recipe)  # loads nothing
    batch = dataclasses.replace(completion_batch(student.config.vocab_size), padding_free=padding_free)
    role = LocalRole(Offloaded(teacher, "cpu") if offload else teacher)

    projected = []
    hooks = [model.lm_head.register_forward_hook(lambda module, args, out: projected.append(tuple(out.shape)))
             for model in (teacher, student)]
    student.zero_grad()
    loss, metrics = algorithm.loss(student, batch, batch.completion_mask_BT.sum(), teacher=role)
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in student.named_parameters()}
    rows = predicting_rows(batch.completion_mask_BT).shape[0]
    # the teacher's head, then the student's: never the (B, T, V) logits, nor the packed rows'
    assert projected == [(rows, student.config.vocab_size)] * 2
    assert "forward" not in vars(teacher.lm_head) and next(teacher.parameters()).device.type == "cpu"

    student.zero_grad()
    want_loss, want_metrics = full_logits_loss(student, teacher, dataclasses.replace(batch, padding_free=False), 0.5,
                                               0.9)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)
    assert metrics.keys() == want_metrics.keys()
    for name in metrics:
        torch.testing.assert_close(metrics[name], want_metrics[name], atol=1e-6, rtol=1e-6, msg=name)
    for name, param in student.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-5, msg=name)
