"""A tiny Qwen3-MoE trains end to end on CPU: SFT with the load-balancing loss added to the loss it logs, and GRPO
with routing replay (the old policy's experts replayed; routing_agreement logged every step)."""

from __future__ import annotations

import pytest
import torch

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import metrics, run_cli, run_overrides

REWARD = "tests.integration.test_grpo:length_reward"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=16, n_eval=4)


def test_sft_adds_the_load_balancing_loss(tiny_moe_model_dir, data, tmp_path):
    """Step 1's loss (the untrained model) is the language-model loss plus coef x the logged router_aux_loss."""
    rows = {}
    for coef in (0.0, 0.5):
        out = tmp_path / f"coef{coef}"
        assert run_cli("sft", *run_overrides(tiny_moe_model_dir, data["sft_train"], out, "train.max_steps=2",
                                             "train.per_device_train_batch_size=4",
                                             f"model.router_aux_loss_coef={coef}")) == 0
        rows[coef] = metrics(out)
    plain, with_aux = rows[0.0][0], rows[0.5][0]
    assert plain["router_aux_loss"] == pytest.approx(with_aux["router_aux_loss"], rel=1e-6)
    assert with_aux["loss"] == pytest.approx(plain["loss"] + 0.5 * plain["router_aux_loss"], rel=1e-5)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows[0.5])


def test_grpo_replays_the_old_policys_routing(tiny_moe_model_dir, data, tmp_path):
    """Padding-free micro-batches within a token budget: the routing recorded on the padded rollout batch is packed
    with them (agreement 1.0 on each batch's first step says every token got its own experts back)."""
    out = tmp_path / "run"
    assert run_cli("grpo", *run_overrides(
        tiny_moe_model_dir, data["prompts_train"], out, "train.max_steps=4", "train.per_device_train_batch_size=4",
        "generation.max_completion_length=8", "algo.num_generations=4", "algo.num_iterations=2",
        "algo.routing_replay=old_policy", "model.router_aux_loss_coef=0.001", "train.save_final_model=false",
        "data.packing=true", "data.max_prompt_length=56", "train.max_tokens_per_microbatch=64",
        f"rewards=[{{name: '{REWARD}'}}]", learning_rate="3e-2")) == 0
    rows = {r["step"]: r for r in metrics(out)}
    assert sorted(rows) == [1, 2, 3, 4]
    for step, r in rows.items():
        assert torch.isfinite(torch.tensor([r["loss"], r["router_aux_loss"]])).all(), r
        # the first pass over a generation batch runs the old policy itself: its own routing, agreement 1; after
        # one update (a large learning rate) the router would pick other experts for some tokens: replay forced them
        assert r["routing_agreement"] == 1.0 if step % 2 else 0.0 < r["routing_agreement"] < 1.0, (step, r)


GRPO = ["algo.num_generations=4", "train.per_device_train_batch_size=4", f"rewards=[{{name: '{REWARD}'}}]"]


@pytest.mark.parametrize("command, extra, message", [
    ("grpo", ["algo.num_iterations=2", "algo.routing_replay=old_policy"],
     "algo.routing_replay: the model must be a mixture-of-experts model"),
    ("sft", ["model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef: the model must be a mixture-of-experts"),
    ("sft", ["model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef must be >= 0"),
    ("grpo", ["algo.routing_replay=old_policy"], "set algo.num_iterations >= 2"),
    ("grpo", ["algo.routing_replay=sampler"], "algo.routing_replay is 'sampler'; choose one of none, old_policy"),
])
def test_moe_options_are_checked_before_the_model_loads(tiny_model_dir, data, tmp_path, capsys, command, extra,
                                                        message):
    train = data["prompts_train" if command == "grpo" else "sft_train"]
    overrides = run_overrides(tiny_model_dir, train, tmp_path / "run", *(GRPO if command == "grpo" else []), *extra)
    assert run_cli(command, *overrides) == 2
    assert message in capsys.readouterr().err
