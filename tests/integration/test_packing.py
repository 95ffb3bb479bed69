"""Every algorithm trains padding-free under a token budget and makes the same update as with padded rows of a fixed
count: 2 steps of the tiny model, padded micro-batches of 4 rows against data.packing=true with
train.max_tokens_per_microbatch small enough to regroup the step into micro-batches of one to a few rows. The loss of
every step and the final weights agree (assert_same_update: float noise only)."""

from __future__ import annotations

import pytest

from tests.integration.helpers import BATCH_4, assert_same_update, final_weights, metrics, run_cli, run_overrides

REWARD = "rewards=[{name: 'tests.integration.test_grpo:length_reward'}]"
ONLINE = ["generation.max_completion_length=8", "data.max_prompt_length=24", REWARD]

# algorithm -> (data file, overrides shared by both runs, the token budget: the longest unit the recipe allows)
CASES = {
    "sft": ("sft_train", [*BATCH_4, "data.max_length=48"], 48),
    "dpo": ("pref_train", [*BATCH_4, "data.max_length=32"], 64),
    "rm": ("pref_train", [*BATCH_4, "data.max_length=32"], 64),
    "grpo": ("prompts_train", ["train.per_device_train_batch_size=8", "algo.num_generations=4", *ONLINE], 32),
    "ppo": ("prompts_train", ["train.per_device_train_batch_size=4", "algo.critic_learning_rate=3e-3", *ONLINE], 32),
    "distill": ("sft_train", [*BATCH_4, "data.max_length=40", "algo.lmbda=0.0", "generation.max_completion_length=8"],
                48),
}


@pytest.mark.parametrize("command", list(CASES))
def test_packed_budget_gives_the_padded_update(command, tiny_model_dir, teacher_dir, data, tmp_path):
    train_file, shared, budget = CASES[command]
    if command == "distill":
        shared = [*shared, f"algo.teacher_model_name_or_path={teacher_dir}"]
    runs = {"padded": [], "packed_budget": ["data.packing=true", f"train.max_tokens_per_microbatch={budget}"]}
    for name, extra in runs.items():
        overrides = run_overrides(tiny_model_dir, data[train_file], tmp_path / name, "train.max_steps=2", *shared,
                                  *extra, learning_rate="1e-3")
        assert run_cli(command, *overrides) == 0, name
    padded, packed = metrics(tmp_path / "padded"), metrics(tmp_path / "packed_budget")
    assert [r["step"] for r in padded] == [r["step"] for r in packed]
    for a, b in zip(padded, packed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (command, a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (command, a, b)
    assert_same_update(final_weights(tmp_path / "padded"), final_weights(tmp_path / "packed_budget"))


def test_a_budget_below_the_longest_row_exits_2_before_loading(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    code = run_cli("dpo", *run_overrides(tiny_model_dir, data["pref_train"], out, "data.max_length=32",
                                         "train.max_tokens_per_microbatch=40"))
    err = capsys.readouterr().err
    assert code == 2 and "train.max_tokens_per_microbatch=40" in err and "2 x data.max_length (32) = 64" in err, err
    assert not out.exists()
