"""posttrain distill on 2 CPU processes (gloo) under DeepSpeed ZeRO-3 gives the losses, metrics and weights of one
process with accumulation 2 and the same global batch. Both the student and the frozen teacher are partitioned
(the teacher is a sharded inference engine beside the student), and the steps mix the data's completions with the
student's own: with generation.batch_size=1 each row is sampled in a call seeded by its global position, so the
samples do not depend on how rows are spread over ranks, and the loop's global token count does the rest."""

from __future__ import annotations

import pytest

from posttrain.demo.tasks import write_example_data
from tests.distributed.launch import launch
from tests.integration.helpers import final_weights, max_weight_diff, metrics, run_cli, run_overrides

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=4)


def overrides(student, teacher, data, out, accumulation):
    return run_overrides(student, data["sft_train"], out, f"algo.teacher_model_name_or_path={teacher}",
                         "train.max_steps=3", "train.per_device_train_batch_size=2",
                         f"train.gradient_accumulation_steps={accumulation}", "algo.lmbda=0.5", "algo.beta=0.5",
                         "generation.max_completion_length=6", "generation.batch_size=1", learning_rate="1e-3")


def test_zero3_two_processes_match_one_with_accumulation(tiny_model_dir, teacher_dir, data, tmp_path):
    assert run_cli("distill", *overrides(tiny_model_dir, teacher_dir, data, tmp_path / "one", accumulation=2)) == 0
    result = launch(2, "distill", overrides(tiny_model_dir, teacher_dir, data, tmp_path / "two", accumulation=1),
                    accelerate_config="zero3")
    assert result.ok, result.output[-6000:]
    result.check_world(2)
    assert result.facts["engine"] == "deepspeed-zero3"
    one, two = metrics(tmp_path / "one"), result.metrics()
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    assert {r["on_policy"] for r in one} == {0.0, 1.0}  # both kinds of step are compared
    for expected, got in zip(one, two):
        assert got["on_policy"] == expected["on_policy"]
        for name in ("loss", "forward_kl", "reverse_kl", "teacher_logprob", "student_logprob"):
            assert got[name] == pytest.approx(expected[name], rel=3e-5, abs=1e-5), (name, expected, got)
    assert max_weight_diff(final_weights(tmp_path / "one"), result.final_weights()) < 1e-4
