"""GRPO end to end on the tiny model (CPU, fp32): every parameter moves, the metrics are there, each variant runs,
resume is exact, accumulation does not change the update, and bad batch sizes or failing rewards stop the run
with a message that names what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import (ONE_PROCESS_SPLITS, assert_resume_is_exact, final_weights, max_weight_diff,
                                       metrics, run_cli, run_overrides, step_losses)

HERE = "tests.integration.test_grpo"
ROOT = Path(__file__).resolve().parents[2]


def length_reward(completions, **kwargs):
    """Varies within a group even for a random model: longer text, more reward (the data is conversational: each
    completion is [{"role": "assistant", "content": ...}], as TRL passes it)."""
    return [len(c[0]["content"]) / 40.0 for c in completions]


def every_other_length_reward(completions, **kwargs):
    """length_reward for even-numbered completions, None ("not applicable") for the others."""
    return [None if i % 2 else r for i, r in enumerate(length_reward(completions))]


def constant_reward(completions, **kwargs):
    """A reward that never varies (a bug users meet: it reads the wrong column, or the wrong shape)."""
    return [1.0] * len(completions)


def raising_reward(prompts, completions, **kwargs):
    raise ValueError("this reward always fails")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=6)


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["prompts_train"], out, "train.max_steps=3",
                         "train.per_device_train_batch_size=8", "generation.max_completion_length=8",
                         "algo.num_generations=4", f"rewards=[{{name: '{HERE}:length_reward'}}]", *extra,
                         learning_rate="1e-3")


def test_three_steps_change_every_parameter(tiny_model_dir, data, tmp_path, reference_loads):
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out)) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    keys = ["loss", "grad_norm", "clip_fraction", "entropy", "reward/mean", "reward/std", "frac_reward_zero_std",
            "rewards/length_reward/mean", "rewards/length_reward/std", "completion_length/mean",
            "completion_length/max", "truncated_fraction", "time/generate", "time/score", "time/ref", "time/train"]
    for r in rows:
        for key in keys:
            assert key in r and torch.isfinite(torch.tensor(r[key])), (key, r)
        assert "kl" not in r
    assert any(r["reward/std"] > 0 for r in rows)
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    unchanged = [k for k in initial if torch.equal(initial[k], trained[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert reference_loads == []  # beta = 0: no reference model
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3]
    assert {"prompt", "completion", "reward", "rewards", "advantage", "truncated"} <= samples[0].keys()


def test_beta_adds_kl_against_a_reference(tiny_model_dir, data, tmp_path, reference_loads):
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "algo.beta=0.1", "train.max_steps=2")) == 0
    rows = metrics(out)
    assert all("kl" in r and r["kl"] >= 0 for r in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert rows[1]["kl"] > 0
    assert len(reference_loads) == 1


def test_lora_takes_the_reference_from_the_disabled_adapter(tiny_model_dir, data, tmp_path, reference_loads):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "algo.beta=0.1", "train.max_steps=2",
                                 "model.lora.enabled=true", "model.lora.r=4", "train.save_final_model=false")) == 0
    rows = metrics(out)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl"] > 0
    assert reference_loads == []


@pytest.mark.parametrize("extra", [
    ["algo.loss_type=grpo"],
    ["algo.loss_type=bnpo", "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=2"],
    ["algo.loss_type=dr_grpo", "algo.scale_rewards=none"],
    ["algo.importance_sampling_level=sequence", "algo.scale_rewards=batch"],
    ["algo.mask_truncated_completions=true", "algo.epsilon_high=0.28"],
], ids=lambda e: e[0].split(".")[-1])
def test_variants_train(tiny_model_dir, data, tmp_path, extra):
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "train.max_steps=2", "train.save_final_model=false",
                                 *extra)) == 0
    losses = step_losses(out)
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


def test_num_iterations_reuses_the_generation_batch(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, "algo.num_iterations=2", "train.max_steps=4",
                                 "train.save_final_model=false", "algo.epsilon=0.01")) == 0
    rows = {r["step"]: r for r in metrics(out)}
    assert rows[2]["time/generate"] == 0.0 and rows[4]["time/generate"] == 0.0
    assert rows[1]["time/generate"] > 0 and rows[3]["time/generate"] > 0
    assert rows[2]["reward/mean"] == rows[1]["reward/mean"]  # the same completions
    assert rows[1]["clip_fraction"] == 0.0  # first pass: the policy is the sampler
    assert rows[2]["clip_fraction"] > 0  # second pass: ratios moved away from 1 against the stored old log-probs


def test_resume_continues_exactly(tiny_model_dir, data, tmp_path):
    common = ["train.max_steps=4", "train.save_steps=2", "algo.beta=0.05", "train.lr_scheduler_type=cosine"]
    assert_resume_is_exact("grpo", lambda out, *extra: base(tiny_model_dir, data, out, *extra), tmp_path, common,
                           stop_after=2, steps=4)


def test_accumulation_gives_the_same_update(tiny_model_dir, data, tmp_path):
    runs = {
        **ONE_PROCESS_SPLITS,
        "mb2_acc2": ["train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=2"],
    }
    for name, extra in runs.items():
        assert run_cli("grpo", *base(tiny_model_dir, data, tmp_path / name, "algo.num_generations=2", *extra)) == 0
    ref_rows, ref_weights = metrics(tmp_path / "mb4"), final_weights(tmp_path / "mb4")
    assert any(r["loss"] != 0 for r in ref_rows)
    for name in ("mb1_acc4", "mb2_acc2"):
        rows = metrics(tmp_path / name)
        for ref, row in zip(ref_rows, rows):
            assert row["reward/mean"] == ref["reward/mean"], name  # identical samples
            assert row["loss"] == pytest.approx(ref["loss"], abs=1e-5), (name, ref["step"])
        assert max_weight_diff(ref_weights, final_weights(tmp_path / name)) < 1e-5, name


def test_eval_logs_held_out_accuracy(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("grpo", *base(tiny_model_dir, data, out, f"data.eval={data['prompts_eval']}", "train.max_steps=1",
                                 "train.save_final_model=false")) == 0
    evals = [r for r in metrics(out) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and "eval/reward" in r for r in evals)


def test_a_run_that_cannot_learn_says_so_once_and_doctor_agrees(tiny_model_dir, tmp_path, capsys):
    """Plain-text prompts for a chat-template tokenizer and a constant reward: every group's rewards are equal, the
    gradient is 0, and the run says each sign once with its fix (rundir/health.py); `posttrain doctor RUN_DIR` reads
    metrics.jsonl and prints the same diagnosis."""
    prompts = tmp_path / "plain.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                               for i in range(16)))
    out = tmp_path / "run"
    overrides = run_overrides(tiny_model_dir, prompts, out, "train.max_steps=3", "train.per_device_train_batch_size=8",
                              "generation.max_completion_length=8", "algo.num_generations=4",
                              f"rewards=[{{name: '{HERE}:constant_reward'}}]")
    assert run_cli("grpo", *overrides) == 0
    err = capsys.readouterr().err
    said = {name: err.count(f"posttrain: warning: step {step}: {what}") for name, step, what in (
        ("untemplated", 1, "100% of the prompts are plain text"), ("zero_std", 3, "frac_reward_zero_std=1.00"),
        ("constant", 3, "reward function constant_reward gave every completion the same value (1)"),
        ("grad", 3, "the gradient norm is 0"))}
    assert said == {"untemplated": 1, "zero_std": 1, "constant": 1, "grad": 1}, err
    assert main(["doctor", str(out)]) == 1
    printed = capsys.readouterr().out
    for check in ("untemplated_prompts", "reward_zero_std", "constant_reward (constant_reward)", "zero_grad_norm"):
        assert f"WARN  {check}: step" in printed, printed


def test_batch_that_splits_a_group_exits_2(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    code = run_cli("grpo", *base(tiny_model_dir, data, out, "train.per_device_train_batch_size=3",
                                 "train.gradient_accumulation_steps=2"))
    err = capsys.readouterr().err
    assert code == 2, err
    for fragment in ("per_device_train_batch_size (3)", "gradient_accumulation_steps (2)", "num_generations (4)"):
        assert fragment in err, (fragment, err)
    assert not out.exists()


def test_raising_reward_stops_the_run_naming_it(tiny_model_dir, data, tmp_path, capsys):
    rewards = f"rewards=[{{name: '{HERE}:raising_reward'}}]"
    code = run_cli("grpo", *base(tiny_model_dir, data, tmp_path / "run", rewards))
    err = capsys.readouterr().err
    assert code == 1 and "raising_reward" in err and "this reward always fails" in err, err


def test_skipped_and_unscored_rewards_continue(tiny_model_dir, data, tmp_path):
    """A skipped reward counts as missing; a completion no reward scores (every one None or skipped) is TRL's
    unscorable completion: advantage 0, reward null in samples.jsonl, counted in rewards/unscored."""
    out = tmp_path / "run"
    rewards = (f"rewards=[{{name: '{HERE}:raising_reward', on_error: skip}}, "
               f"{{name: '{HERE}:every_other_length_reward'}}]")
    assert run_cli("grpo", *base(tiny_model_dir, data, out, rewards, "train.max_steps=2",
                                 "train.save_final_model=false")) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rewards/skipped"] == 8 + 4 and r["rewards/unscored"] == 4 and r["reward/mean"] > 0 for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    unscored = [s for s in samples if s["reward"] is None]
    assert len(unscored) == len(samples) // 2 and all(s["advantage"] == 0.0 for s in unscored)
    assert all(s["rewards"] == {"raising_reward": None, "every_other_length_reward": None} for s in unscored)
    assert any(s["advantage"] != 0.0 for s in samples if s["reward"] is not None)


def test_trl_reward_file_through_reward_funcs(tiny_model_dir, data, tmp_path, capsys):
    """A TRL-style reward file (examples/rewards/trl_rewards.py: message-list completions, a dataset column,
    trainer_state, log_metric) passed with TRL's --reward_funcs / --reward_weights trains on conversational data."""
    out, rewards = tmp_path / "run", str(ROOT / "examples" / "rewards" / "trl_rewards.py")
    flags = ["--reward_funcs", *(f"{rewards}:{f}" for f in ("format_reward", "accuracy_reward", "brevity_reward")),
             "--reward_weights", "0.2", "1.0", "1.0"]
    overrides = [o for o in base(tiny_model_dir, data, out, "train.max_steps=2") if not o.startswith("rewards=")]
    assert run_cli("grpo", *flags, *overrides) == 0
    header = capsys.readouterr().out  # a run in TRL's words: TRL's GRPO defaults for what it leaves out, said
    said = header.split("TRL 1.16.0 GRPOConfig defaults for what this run in TRL's words leaves out: ", 1)[1]
    assert "num_train_epochs=3.0" in said.splitlines()[0]
    assert "| defaults=TRL 1.16.0 GRPOConfig" in header and "lora_dropout" not in header
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for name in ("format_reward", "accuracy_reward", "brevity_reward"):
            assert 0 <= r[f"rewards/{name}/std"] and f"rewards/{name}/mean" in r, (name, r)
        assert r["brevity/mean_chars"] > 0 and r["reward/std"] > 0
        assert r["rewards/brevity_reward/mean"] < 0  # the function's own numbers, weighted 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["extra"]["chars"] == len(s["completion"]) for s in samples)  # log_extra's column, per completion
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)


@pytest.mark.parametrize("override, message", [
    ("algo.num_generations=1", "num_generations must be >= 2"),
    ("algo.loss_type=ppo", "choose one of dapo, grpo, dr_grpo, bnpo"),
    ("algo.scale_rewards=rank", "choose one of group, batch, none"),
    ("generation.temperature=0", "generation.temperature > 0"),
    ("rewards=[]", "grpo needs at least one reward"),
    ("algo.num_iterations=2", "train.save_steps=3 is not a multiple of algo.num_iterations=2"),
])
def test_recipe_checks(override, message):
    from posttrain.algorithms.grpo import GRPOAlgoConfig
    from posttrain.config.load import load_recipe
    from posttrain.errors import UserError

    with pytest.raises(UserError, match=message):
        load_recipe(None, ["data.train=a.jsonl", "rewards=[{name: exact_match}]", "train.per_device_train_batch_size=8",
                           "train.save_steps=3", override], GRPOAlgoConfig)
