"""DAPO dynamic sampling end to end on the tiny model (CPU): groups that do not vary are dropped and refilled from
further prompts, the step's counts are logged, a resumed run equals its uninterrupted self (the prompt order's
position is in the checkpoint), and a step that runs out of draws trains on what it has and says so."""

from __future__ import annotations

import pytest
import torch

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import assert_resume_is_exact, metrics, run_cli, run_overrides

HERE = "tests.integration.test_dynamic_sampling"


def first_letter_reward(completions, **kwargs):
    """1 when a completion (TRL's message list for these chat prompts) starts with one of a-f: for the random tiny
    model, a group of 4 is sometimes all 0 or all 1 (dropped) and often mixed (kept)."""
    return [float(c[0]["content"].strip()[:1].lower() in "abcdef") for c in completions]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=48, n_eval=4)


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["prompts_train"], out, "train.max_steps=4",
                         "train.per_device_train_batch_size=8", "generation.max_completion_length=6",
                         "algo.num_generations=4", f"rewards=[{{name: '{HERE}:first_letter_reward'}}]",
                         "algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.metric=reward",
                         "algo.dynamic_sampling.max_batches=0", *extra,
                         learning_rate="1e-3")


def test_groups_are_refilled_and_resume_is_exact(tiny_model_dir, data, tmp_path):
    assert_resume_is_exact("grpo", lambda out, *extra: base(tiny_model_dir, data, out, *extra), tmp_path,
                           ["train.save_steps=2"], stop_after=2, steps=4)
    rows = metrics(tmp_path / "full")
    for r in rows:  # every trained group varies: no zero-std group reaches the loss
        assert r["frac_reward_zero_std"] == 0.0 and r["dynamic_sampling/filler_groups"] == 0.0
        assert r["dynamic_sampling/groups_kept"] >= 2 and r["dynamic_sampling/groups_drawn"] >= 2
        assert r["dynamic_sampling/groups_dropped"] == r["dynamic_sampling/groups_drawn"] - r[
            "dynamic_sampling/groups_kept"]
        assert r["dynamic_sampling/batches"] * 2 == r["dynamic_sampling/groups_drawn"]
    assert any(r["dynamic_sampling/batches"] > 1 for r in rows)  # some step had to draw again


def test_out_of_draws_trains_on_what_there_is(tiny_model_dir, data, tmp_path, caplog):
    # exact match against the answer: the random model is never right, so no group varies
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "rewards=[{name: exact_match}]", "train.max_steps=1",
                                 "algo.dynamic_sampling.metric=accuracy", "algo.dynamic_sampling.max_batches=2",
                                 "train.save_final_model=false")) == 0
    (row,) = metrics(out)
    assert (row["dynamic_sampling/groups_drawn"], row["dynamic_sampling/groups_kept"],
            row["dynamic_sampling/filler_groups"], row["dynamic_sampling/batches"]) == (4.0, 0.0, 2.0, 2.0)
    assert row["loss"] == 0.0 and torch.isfinite(torch.tensor(row["grad_norm"]))  # every completion masked
    assert "0 of the 2 prompt groups" in caplog.text and "this step trains on nothing" in caplog.text


@pytest.mark.parametrize("extra, message", [
    (["algo.dynamic_sampling.metric=accuracy"], "algo.dynamic_sampling.metric=accuracy compares completions with the "
                                                "'answer' column, which data.train does not have"),
    (["algo.dynamic_sampling.enabled=false", "train.eval_pass_k=[1,2]", "data.eval={rows}"],
     "train.eval_pass_k compares completions with the 'answer' column, which data.eval does not have"),
])
def test_a_missing_answer_column_stops_before_any_model_loads(tiny_model_dir, tmp_path, capsys, extra, message):
    rows = tmp_path / "no_answer.jsonl"
    rows.write_text("".join(f'{{"prompt": "What is {i} + 1?"}}\n' for i in range(8)))
    extra = [e.format(rows=rows) for e in extra]
    assert run_cli("grpo", *base(tiny_model_dir, {"prompts_train": rows}, tmp_path / "run", *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped before the run began


def always_fails(completions, **kwargs):
    raise ConnectionError("the judge is down")


def test_a_run_whose_every_batch_is_unscored_stops_instead_of_training_at_loss_0(tiny_model_dir, data, tmp_path,
                                                                                 capsys):
    """Issue 48 class 5: with on_error: skip a reward that always fails left every completion unscored, and the run
    trained at loss 0 to exit 0."""
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "algo.dynamic_sampling.enabled=false", "train.max_steps=2",
                                 f"rewards=[{{name: '{HERE}:always_fails', on_error: skip}}]",
                                 "train.save_final_model=false")) == 1
    err = capsys.readouterr().err
    assert "no reward scored any completion of every step so far (to step 1) ('always_fails' 8 of 8 missing)" in err, err[-600:]
    assert not (out / "final").exists()
