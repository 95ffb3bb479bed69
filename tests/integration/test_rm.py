"""The Bradley-Terry reward model end to end on the tiny model (CPU, fp32): from a causal-LM checkpoint a fresh score
head and every weight train, the pair loss starts at log 2, a margin column is honoured, eval reports accuracy and
margin, resume and accumulation are exact, and final/ loads in RewardModelScorer and scores the pairs as training
did."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from tests.integration.helpers import (BATCH_4, assert_accumulation_is_invisible, assert_resume_is_exact, final_weights,
                                       metrics, run_cli, run_overrides, step_losses)


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["pref_train"], out, *BATCH_4, *extra)


def initial_classifier(tiny_model_dir, seed=3):
    """The model `posttrain rm` starts from: the recipe seed is set before the score head is initialised."""
    from transformers import set_seed

    from posttrain.config import ModelConfig
    from posttrain.models.load import load_sequence_classifier

    set_seed(seed)
    return load_sequence_classifier(ModelConfig(name_or_path=str(tiny_model_dir)))


def test_three_steps_train_every_parameter_and_report_accuracy(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli("rm", *base(tiny_model_dir, data, out, "train.max_steps=3", f"data.eval={data['pref_eval']}")) == 0
    rows = metrics(out)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        for key in ("loss", "grad_norm", "accuracy", "margin", "rewards/chosen", "rewards/rejected"):
            assert key in r and math.isfinite(r[key]), (key, r)
    evals = [r for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and all("eval/accuracy" in r and "eval/margin" in r for r in evals)

    initial = {k: v for k, v in initial_classifier(tiny_model_dir).state_dict().items()}
    trained = final_weights(out)
    assert "score.weight" in trained and trained.keys() <= initial.keys()
    unchanged = [k for k in trained if torch.equal(initial[k], trained[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    config = AutoConfig.from_pretrained(out / "final")
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    assert config.pad_token_id == AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id


def test_the_first_loss_is_the_bradley_terry_loss_of_the_initial_scores(tiny_model_dir, data, tmp_path):
    """Step 1's loss recomputed by hand from the initial model on the step's pairs (the same seeded data order)."""
    from posttrain.algorithms.rm import pair_scores
    from posttrain.config import DataConfig
    from posttrain.data import collate_preference, load_rows, tokenize_preference
    from posttrain.train.sources import DatasetSource

    out = tmp_path / "run"
    assert run_cli("rm", *base(tiny_model_dir, data, out, "train.max_steps=1", "train.save_final_model=false")) == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples, _ = tokenize_preference(load_rows(str(data["pref_train"])), tokenizer, DataConfig(train="x"))
    source = DatasetSource(examples, lambda e: collate_preference(e, tokenizer.pad_token_id), 4, 1, 1, 0, 3)
    (batch,) = source.step_batches(0)
    with torch.no_grad():
        chosen, rejected = pair_scores(initial_classifier(tiny_model_dir).eval(), batch)
    expected = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    assert step_losses(out)[1] == pytest.approx(float(expected), abs=1e-5)


def test_margin_column_is_subtracted(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "chosen": f" {i + 1}", "rejected": f" {i + 3}", "margin": 2.0}
            for i in range(8)]
    train = tmp_path / "margin.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses = {}
    for use_margin in ("true", "false"):
        out = tmp_path / use_margin
        assert run_cli("rm", *base(tiny_model_dir, {"pref_train": train}, out, "train.max_steps=1",
                                   f"algo.use_margin={use_margin}", "train.save_final_model=false")) == 0
        losses[use_margin] = step_losses(out)[1]
    # with a random head the score gap is ~0: -log sigmoid(-2) = 2.13 with the margin, log 2 without
    assert losses["false"] == pytest.approx(math.log(2), abs=0.1)
    assert losses["true"] == pytest.approx(-math.log(1 / (1 + math.exp(2.0))), abs=0.2)


def test_resume_continues_exactly(tiny_model_dir, data, tmp_path):
    common = ["train.max_steps=4", "train.save_steps=2", "train.lr_scheduler_type=cosine", "train.warmup_steps=1",
              "algo.center_rewards_coefficient=0.01"]
    assert_resume_is_exact("rm", lambda out, *extra: base(tiny_model_dir, data, out, *extra), tmp_path, common,
                           stop_after=2, steps=4)


def test_accumulation_gives_the_same_update(tiny_model_dir, data, tmp_path):
    assert_accumulation_is_invisible(
        "rm", lambda out, *extra: base(tiny_model_dir, data, out, "train.max_steps=3", *extra), tmp_path)


def test_export_scores_in_reward_model_scorer_as_in_training(tiny_model_dir, data, tmp_path):
    """final/ in RewardModelScorer: the score of (prompt, completion) is the score training gave that sequence, so
    GRPO / PPO reward with exactly the function the RM learned; and it ranks pairs as the run's eval accuracy says."""
    from posttrain.algorithms.rm import pair_scores
    from posttrain.config import DataConfig
    from posttrain.data import collate_preference, load_rows, tokenize_preference
    from posttrain.rewards.reward_model import RewardModelScorer

    out = tmp_path / "run"
    assert run_cli("rm", *base(tiny_model_dir, data, out, "train.max_steps=8", f"data.eval={data['pref_eval']}",
                               "train.per_device_eval_batch_size=8")) == 0
    rows = [json.loads(line) for line in data["pref_eval"].read_text().splitlines()]
    scorer = RewardModelScorer(str(out / "final"), device="cpu", batch_size=3)
    prompts = [r["prompt"] for r in rows]
    chosen = scorer(prompts, [r["chosen"][0]["content"] for r in rows])
    rejected = scorer(prompts, [r["rejected"][0]["content"] for r in rows])

    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    examples, _ = tokenize_preference(load_rows(str(data["pref_eval"])), tokenizer, DataConfig(train="x"))
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    with torch.no_grad():
        train_chosen, train_rejected = pair_scores(model, collate_preference(examples, tokenizer.pad_token_id))
    assert chosen == pytest.approx(train_chosen.tolist(), abs=1e-5)
    assert rejected == pytest.approx(train_rejected.tolist(), abs=1e-5)
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(rows)
    assert accuracy == pytest.approx([r for r in metrics(out) if "eval/accuracy" in r][-1]["eval/accuracy"])
