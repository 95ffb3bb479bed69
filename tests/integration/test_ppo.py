"""PPO end to end on the tiny model (CPU, fp32): every parameter of actor and critic moves, final/ and final-critic/
load in transformers, resume is exact (both optimisers, the KL controller, data and sampling), each estimator runs,
and bad input stops the run with exit 2 before a model loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import (assert_resume_is_exact, final_weights, max_weight_diff, metrics, run_cli,
                                       run_overrides, step_losses)

HERE = "tests.integration.test_ppo"


def length_reward(completions, **kwargs):
    """Varies between completions even for a random model: longer text, more reward (conversational data: each
    completion is [{"role": "assistant", "content": ...}])."""
    return [len(c[0]["content"]) / 40.0 for c in completions]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=6)


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["prompts_train"], out, "train.max_steps=3",
                         "train.per_device_train_batch_size=4", "generation.max_completion_length=8",
                         f"rewards=[{{name: '{HERE}:length_reward'}}]", "algo.critic_learning_rate=3e-3", *extra,
                         learning_rate="1e-3")


def test_three_steps_train_actor_and_critic(tiny_model_dir, data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    out = tmp_path / "run"
    assert run_cli("ppo", *base(tiny_model_dir, data, out, "algo.ppo_epochs=1")) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    keys = ["loss", "grad_norm", "loss/critic", "grad_norm/critic", "learning_rate/critic", "clip_fraction",
            "value_clip_fraction", "approx_kl", "entropy", "kl", "kl_coef", "values/mean", "returns/mean",
            "reward/mean", "time/generate", "time/score", "time/ref", "time/train", "time/update/policy",
            "time/update/critic", "time/reference", "time/values"]
    for r in rows:
        for key in keys:
            assert key in r and torch.isfinite(torch.tensor(r[key])), (key, r)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["kl"] != 0  # starts at the reference
    assert rows[0]["learning_rate/critic"] == pytest.approx(3 * rows[0]["learning_rate"])  # 3e-3 vs 1e-3, same schedule
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    assert not [k for k in initial if torch.equal(initial[k], trained[k])]
    critic_dir = out / "final-critic"
    critic = {}
    for f in critic_dir.glob("*.safetensors"):
        critic.update(load_file(str(f)))
    # the critic starts from the policy: its backbone moved away from the policy's starting weights, and its head
    backbone = {k: v for k, v in critic.items() if k.startswith("model.")}
    assert backbone and not [k for k, v in backbone.items() if torch.equal(initial[k], v)]
    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None
    loaded = AutoModelForTokenClassification.from_pretrained(critic_dir)
    assert loaded.config.num_labels == 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {"completion", "reward", "advantage"} <= samples[0].keys()


def test_critic_changes_every_parameter_from_a_reward_model(tiny_model_dir, data, tmp_path):
    """The critic's head starts as the reward model's score head and, like every other critic weight, moves."""
    rm = tmp_path / "rm"
    assert run_cli("rm", *run_overrides(tiny_model_dir, data["pref_train"], rm, "train.max_steps=1",
                                        "train.per_device_train_batch_size=2")) == 0
    out = tmp_path / "run"
    assert run_cli("ppo", *base(tiny_model_dir, data, out, "train.max_steps=2", f"algo.critic_model_name_or_path={rm}/final",
                                "train.save_final_model=true")) == 0
    start = load_file(str(next((rm / "final").glob("*.safetensors"))))
    critic = load_file(str(next((out / "final-critic").glob("*.safetensors"))))
    assert "score.weight" in start  # the token classifier's head has the reward model's name: it starts from it
    unchanged = [k for k in critic if k in start and torch.equal(start[k], critic[k])]
    assert not unchanged, unchanged


def test_reward_model_with_another_tokenizer_scores_the_decoded_text(tiny_model_dir, data, tmp_path, monkeypatch):
    """A reward model whose tokenizer is not the policy's scores the decoded completion re-encoded with its own
    tokenizer (so the critic starts from the policy, not from it); reference and reward model offloaded."""
    import posttrain.run as loop  # run.py calls the loop's train
    from posttrain.distributed.offload import Offloaded
    from posttrain.models.tiny import train_tokenizer
    from posttrain.rewards.reward_model import RewardModelScorer
    from tests.unit.test_rewards_reward_model import save_classifier
    from transformers import AutoConfig

    rm = save_classifier(tmp_path / "rm", train_tokenizer(vocab_size=300))
    policy_vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    assert AutoConfig.from_pretrained(rm).vocab_size != policy_vocab  # the policy's ids mean nothing to it
    roles = {}
    train = loop.train
    monkeypatch.setattr(loop, "train", lambda ctx: roles.update(vars(ctx.models)) or train(ctx))
    out = tmp_path / "run"
    assert run_cli("ppo", *base(tiny_model_dir, data, out, "train.max_steps=1", "algo.log_samples=4",
                                f"rewards=[{{name: reward_model, kwargs: {{path: '{rm}'}}}}]",
                                "algo.ref_offload=true", "algo.reward_model_offload=true")) == 0
    for name in ("reference", "reward_model"):  # weights in CPU memory between forwards
        assert roles[name].placement == "offload" and isinstance(roles[name].model, Offloaded), name
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    scorer = RewardModelScorer(str(rm), device="cpu")
    scores = scorer([s["prompt"] for s in samples], [s["completion"] for s in samples])
    assert [s["reward"] for s in samples] == pytest.approx(scores, abs=1e-4)
    assert AutoConfig.from_pretrained(out / "final-critic").vocab_size == policy_vocab


@pytest.mark.parametrize("extra", [
    ["algo.advantage_estimator=reinforce++", "algo.kl_estimator=k3"],
    ["algo.advantage_estimator=rloo", "algo.num_generations=2", "algo.kl_target=1.0", "algo.missing_eos_penalty=1"],
    ["algo.advantage_estimator=grpo", "algo.num_generations=2", "algo.whiten_advantages=false", "algo.value_clip=null"],
], ids=lambda e: e[0].split("=")[-1])
def test_estimators_train(tiny_model_dir, data, tmp_path, extra):
    out = tmp_path / "run"
    assert run_cli("ppo", *base(tiny_model_dir, data, out, "train.max_steps=2", "train.save_final_model=false",
                                *extra)) == 0
    losses = step_losses(out)
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


def test_critic_warmup_leaves_the_policy_alone(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("ppo", *base(tiny_model_dir, data, out, "train.max_steps=2", "algo.critic_warmup_steps=2")) == 0
    rows = metrics(out)
    assert all("loss" not in r and "loss/critic" in r for r in rows)
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    assert max_weight_diff(initial, final_weights(out)) == 0.0


def test_resume_continues_exactly(tiny_model_dir, data, tmp_path):
    common = ["train.max_steps=4", "train.save_steps=2", "algo.kl_target=0.01", "algo.ppo_epochs=2",
              "train.lr_scheduler_type=cosine"]
    assert_resume_is_exact("ppo", lambda out, *extra: base(tiny_model_dir, data, out, *extra), tmp_path, common,
                           stop_after=2, steps=4)
    full, split = metrics(tmp_path / "full"), metrics(tmp_path / "split")
    for a, b in zip(full, split):  # the critic and the KL controller continue exactly too
        assert b["loss/critic"] == pytest.approx(a["loss/critic"], abs=1e-6)
        assert b["kl_coef"] == pytest.approx(a["kl_coef"], abs=1e-12)
    assert full[2]["kl_coef"] != full[0]["kl_coef"]  # the controller moved, so its restored value mattered
    critic = lambda run: load_file(str(next((tmp_path / run / "final-critic").glob("*.safetensors"))))  # noqa: E731
    assert max_weight_diff(critic("full"), critic("split")) < 1e-6


@pytest.mark.parametrize("override, message", [
    ("algo.critic_model_name_or_path=/no/such/critic", "algo.critic_model_name_or_path"),
    ("rewards=[{name: reward_model, kwargs: {path: TINY}}]", "not a reward model"),
    ("algo.critic_model_name_or_path=OTHER_VOCAB", "vocabulary"),
])
def test_bad_input_exits_2_before_loading(tiny_model_dir, data, tmp_path, capsys, override, message):
    if "OTHER_VOCAB" in override:
        from transformers import AutoConfig

        other = tmp_path / "other"
        config = AutoConfig.from_pretrained(tiny_model_dir)
        config.vocab_size += 7
        config.save_pretrained(other)
        override = override.replace("OTHER_VOCAB", str(other))
    override = override.replace("TINY", str(tiny_model_dir))
    out = tmp_path / "run"
    code = run_cli("ppo", *base(tiny_model_dir, data, out, override))
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not out.exists()
