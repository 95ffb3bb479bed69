"""Hostile inputs to wave 4's keys and flags (token budget, sequence parallelism, master weights, export dtype,
save_final_checkpoint, `posttrain plan`, bench/compare_trl.py --model): each is refused with one message naming it,
exit 2, before any model loads or anything is written. No model is loaded here: config.json files stand in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.rundir import attempts, claim as outputs
from posttrain.cli import main
from posttrain.config.load import load_recipe
from posttrain.config.schema import ModelConfig, SFTAlgoConfig, TrainConfig
from posttrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, vocab_size=633,
                  max_position_embeddings=1024, dtype="float32")


def model_dir(tmp_path: Path, **changes) -> Path:
    """A directory holding only config.json: all the checks before a model loads read."""
    out = tmp_path / "model"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps({**TINY_LLAMA, **changes}))
    return out


@pytest.mark.parametrize("overrides, message", [
    (["train.max_tokens_per_microbatch=0"], r"train.max_tokens_per_microbatch must be a number of tokens > 0"),
    (["train.max_tokens_per_microbatch=-5"], r"train.max_tokens_per_microbatch must be .* got -5"),
    (["train.export_dtype=float16", "train.save_final_model=false"],
     r"train.export_dtype=float16 is the dtype of final/, but train.save_final_model=false writes no final/"),
])
def test_contradictions_and_impossible_values_are_refused_when_the_recipe_loads(overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, ["data.train=a.jsonl", *overrides], SFTAlgoConfig)


def test_master_weights_false_on_float32_weights_is_refused_naming_where_the_dtype_comes_from(tmp_path):
    from posttrain.distributed.precision import check_master_weights

    pure = TrainConfig(master_weights=False)
    with pytest.raises(UserError, match=r"master_weights=false asks for pure 16-bit weights, but model.dtype=float32"):
        check_master_weights(ModelConfig(dtype="float32"), pure)
    with pytest.raises(UserError, match="mixed_precision=bf16 autocasts the compute only"):
        check_master_weights(ModelConfig(dtype="float32"), TrainConfig(master_weights=False, mixed_precision="bf16"))
    auto = ModelConfig(name_or_path=str(model_dir(tmp_path)), dtype="auto")
    with pytest.raises(UserError, match=r"model.dtype=auto reads float32 from .*model's config"):
        check_master_weights(auto, pure)
    check_master_weights(ModelConfig(dtype="bfloat16"), pure)  # what the key is for
    check_master_weights(ModelConfig(name_or_path=str(model_dir(tmp_path, dtype="bfloat16")), dtype="auto"), pure)
    check_master_weights(ModelConfig(dtype="float32"), TrainConfig())


def plan(tmp_path, *overrides, command="sft", gpus=1, mean_length=None):
    from posttrain.algorithms import ALGORITHMS
    from posttrain.plan import run_plan

    recipe = load_recipe(None, [f"model.name_or_path={model_dir(tmp_path)}", "data.train=a.jsonl",
                                "data.max_length=64", *overrides], ALGORITHMS[command][0])
    return run_plan(command, recipe, None, list(overrides), gpus, 1, "80GiB", False, mean_length)


@pytest.mark.parametrize("overrides, command, gpus, message", [
    (["train.sequence_parallel_size=2", "data.packing=true"], "sft", 2, "with data.packing=true"),
    (["train.sequence_parallel_size=4"], "sft", 4, "must divide the model's 2 attention heads"),
    (["train.sequence_parallel_size=2"], "dpo", 2, "dpo does not run sequence-parallel"),
    (["train.sequence_parallel_size=2", "model.attn_implementation=eager"], "sft", 2, "needs model.attn_implementation"),
    (["train.master_weights=false"], "sft", 1, "master_weights=false asks for pure 16-bit weights"),
])
def test_plan_refuses_what_the_run_would_refuse(tmp_path, overrides, command, gpus, message):
    """Else the plan recommends a command line that exits 2."""
    with pytest.raises(UserError, match=message):
        plan(tmp_path, *overrides, command=command, gpus=gpus)


def test_plan_refuses_a_mean_length_above_the_longest_row(tmp_path):
    with pytest.raises(UserError, match=r"--mean-length \(65\) is above the longest row this recipe makes \(64"):
        plan(tmp_path, "data.packing=true", mean_length=65)
    assert "mean 64" in plan(tmp_path, "data.packing=true", mean_length=64)


def finished_run(tmp_path, final_step: int | None) -> Path:
    """A run that ended (exit 0) with final/ written at `final_step` (None: an attempt that wrote no final/)."""
    out = tmp_path / "run"
    outputs.begin_run(out, overwrite=False, command="sft")
    (out / "config.yaml").write_text("x")
    (out / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    (out / "final").mkdir()
    outputs.end_attempt(out, final_step=final_step)
    return out


def test_resume_of_a_finished_run_from_behind_its_final_is_refused_where_it_would_lose_it(tmp_path, capsys):
    """save_final_checkpoint off: auto found no checkpoint and trained from step 0 over final/ and metrics.jsonl, exit
    0; from an older checkpoint with a lower max_steps it put that older model into final/. From an older checkpoint
    (the newest damaged) at the same max_steps the steps are trained again exactly: said, not refused."""
    out = finished_run(tmp_path, final_step=4)
    assert attempts.read_marker(out)["final_step"] == 4
    with pytest.raises(UserError, match=r"finished at step 4 \(final/\) but saved no checkpoint .* from step 0"):
        outputs.check_output_dir(load_recipe(None, [f"output_dir={out}", "data.train=x.jsonl",
                                                    "train.resume_from_checkpoint=auto"], SFTAlgoConfig), "sft")
    older = out / "checkpoints" / "step-2"
    older.mkdir(parents=True)
    (older / "trainer_state.json").write_text(json.dumps({"state": {"step": 2}}))
    with pytest.raises(UserError, match=r"max_steps=2: .* finished at step 4 .* replace final/ with the model of step 2"):
        outputs.check_not_behind(out, older, max_steps=2)
    outputs.check_not_behind(out, older, max_steps=4)
    assert "steps 3-4 are trained again" in capsys.readouterr().err
    (older / "trainer_state.json").write_text(json.dumps({"state": {"step": 4}}))
    outputs.check_not_behind(out, older, max_steps=2)  # the last step checkpointed: final/ is exported from it
    assert capsys.readouterr().err == ""


def test_an_attempt_that_wrote_no_final_keeps_the_step_final_holds(tmp_path):
    """A stop before the end (max_steps_per_run) exports nothing: the final/ on disk is still the earlier one's."""
    out = finished_run(tmp_path, final_step=4)
    outputs.begin_run(out, overwrite=False, command="sft")
    outputs.end_attempt(out)
    assert attempts.read_marker(out)["final_step"] == 4
    outputs.begin_run(out, overwrite=True, command="sft")  # a replaced run's final/ is gone with it
    assert "final_step" not in attempts.read_marker(out)


def test_two_trl_flags_for_one_key_are_called_a_conflict(capsys):
    assert main(["sft", "--padding_free", "true", "--packing", "false", "data.train=a.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "--padding_free (True) and --packing (False) both set data.packing" in err and "no meaning" not in err


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "--model '/nonexistent/model' is not a model directory"),
    (["--model", ""], "--model '' is not a model directory"),
    (["--algo", "distill", "--teacher", "/nonexistent"], "--teacher '/nonexistent' is not a model directory"),
    (["--teacher", str(ROOT)], "--teacher is the teacher of --algo distill; --algo sft has none"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--bs", "0"], "--bs must be >= 1"),
])
def test_compare_trl_refuses_bad_flags_before_making_anything(args, message):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "compare_trl.py"), *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("command, key", [("distill", "algo.teacher_model_name_or_path"),
                                          ("ppo", "algo.critic_model_name_or_path")])
def test_sequence_parallel_checks_the_heads_of_a_teacher_or_critic_of_another_shape(tmp_path, command, key):
    """A one-head teacher under sequence_parallel_size=2 passed the policy's check and crashed in its first forward."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.models.limits import check_sequence_parallel

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_attention_heads": 1, "head_dim": 64}))
    recipe = load_recipe(None, [f"model.name_or_path={model_dir(tmp_path)}", "data.train=a.jsonl", f"{key}={other}",
                                "train.sequence_parallel_size=2", "rewards=[{name: exact_match}]"],
                         ALGORITHMS[command][0])
    with pytest.raises(UserError, match=rf"sequence_parallel_size=2 must divide .*{other}'s 1 attention heads"):
        check_sequence_parallel(recipe, ALGORITHMS[command][1](recipe), world=2)


def test_an_export_dtype_that_cannot_hold_a_weight_stops_before_writing_final():
    """train.export_dtype=float16 on a weight of 1e6 wrote inf into final/ with rc 0."""
    import torch

    from posttrain.rundir.checkpoint import check_castable
    from posttrain.errors import RunStopped

    weights = {"model.layers.0.mlp.down_proj.weight": torch.tensor([[1e6, 1.0]]), "ids": torch.tensor([70000])}
    with pytest.raises(RunStopped, match=r"down_proj.weight holds 1e\+06, beyond float16's largest value \(65504\)"):
        check_castable(weights, "float16")
    check_castable(weights, "bfloat16")
    check_castable({"w": torch.tensor([65504.0, -65504.0])}, "float16")
