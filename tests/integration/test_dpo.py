"""The DPO family end to end on the tiny model (CPU, fp32): every loss type trains every parameter and starts where the
math says (policy == reference), precomputed reference log-probs give the live reference's losses, resume and
accumulation are exact, held-out preference accuracy agrees with the run's own metric, bad pairs are dropped and
counted (exit 2 when none is left), and bad algo settings stop the run with the choices."""

from __future__ import annotations

import ast
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.helpers import (BATCH_4, assert_accumulation_is_invisible, final_weights, max_weight_diff,
                                       metrics, run_cli, run_overrides, step_losses)

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected", "logps/accuracies")


def base(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["pref_train"], out, *BATCH_4, *extra)


# loss at step 1, when the policy is the reference (log-ratios 0); beta 0.1
FIRST_LOSS = {"sigmoid": math.log(2), "robust": math.log(2), "ipo": (1 / (2 * 0.1)) ** 2, "hinge": 1.0}


@pytest.mark.parametrize(
    "loss_type, extra",
    [
        ("sigmoid", []),
        ("ipo", []),
        ("hinge", []),
        ("robust", ["algo.label_smoothing=0.1"]),
        ("simpo", ["algo.beta=2.0", "algo.simpo_gamma=0.5"]),
        ("sigmoid", ["algo.rpo_alpha=0.5", "algo.label_smoothing=0.1"]),  # cDPO + the SFT term on chosen
    ],
    ids=["sigmoid", "ipo", "hinge", "robust", "simpo", "cdpo_rpo"],
)
def test_each_loss_type_trains_every_parameter(tiny_model_dir, data, tmp_path, reference_loads, loss_type, extra):
    out = tmp_path / "run"
    assert run_cli("dpo", *base(tiny_model_dir, data, out, "train.max_steps=3", f"algo.loss_type={loss_type}",
                                *extra)) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("loss", "grad_norm", *DPO_METRICS):
            assert key in r and math.isfinite(r[key]), (key, r)
    assert len(reference_loads) == (0 if loss_type == "simpo" else 1)
    if loss_type in FIRST_LOSS and not any("rpo_alpha" in e for e in extra):
        assert rows[0]["loss"] == pytest.approx(FIRST_LOSS[loss_type], abs=1e-6)
        assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    if "algo.rpo_alpha=0.5" in extra:
        assert rows[0]["loss"] > math.log(2) + 0.5 * 1.0  # log 2 + alpha x (a random model's NLL, far above 1 nat)
        assert "nll_loss" in rows[0]
    initial = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    trained = final_weights(out)
    unchanged = [k for k in initial if torch.equal(initial[k], trained[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"


def test_training_fits_the_pairs(tiny_model_dir, data, tmp_path):
    """Three epochs over the training pairs, evaluated on them: the loss falls below log 2, chosen wins mostly."""
    out = tmp_path / "run"
    assert run_cli("dpo", *base(tiny_model_dir, data, out, "train.num_train_epochs=3", "algo.beta=0.5",
                                "train.lr_scheduler_type=constant",
                                f"data.eval={data['pref_train']}", "train.save_final_model=false")) == 0
    evals = [r for r in metrics(out) if "eval/loss" in r]
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[-1]["eval/loss"] < 0.9 * math.log(2), evals[-1]
    assert evals[-1]["eval/rewards/accuracies"] > 0.6 and evals[-1]["eval/rewards/margins"] > 0, evals[-1]


def test_precomputed_reference_gives_the_live_losses(tiny_model_dir, data, tmp_path, monkeypatch):
    import gc
    import weakref

    from posttrain.algorithms.dpo import DPO

    freed = []
    real_setup = DPO.setup

    def setup(self, backend, models, *args):
        copy = weakref.ref(models.reference)
        real_setup(self, backend, models, *args)
        gc.collect()
        freed.append(models.reference is None and copy() is None)  # nothing else holds the copy: memory is back

    monkeypatch.setattr(DPO, "setup", setup)
    common = ["train.max_steps=3", f"data.eval={data['pref_eval']}", "train.eval_steps=3"]
    live, cached = tmp_path / "live", tmp_path / "cached"
    assert run_cli("dpo", *base(tiny_model_dir, data, live, *common)) == 0
    assert run_cli("dpo", *base(tiny_model_dir, data, cached, *common, "algo.precompute_ref_logprobs=true")) == 0
    assert freed == [False, True]  # the live run keeps its reference; the precomputed run frees it
    a, b = metrics(live), metrics(cached)
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            if key.startswith(("loss", "eval/", "rewards/", "logps/")):
                assert rb[key] == pytest.approx(ra[key], abs=1e-6), (key, ra, rb)
    assert a[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the eval before training: policy == reference
    tables = load_file(str(cached / "ref_logprobs.safetensors"))
    assert tables["train"].shape == (32, 2) and tables["eval"].shape == (8, 2)
    assert bool((tables["train"] < 0).all()) and bool((tables["eval"] < 0).all())
    assert max_weight_diff(final_weights(live), final_weights(cached)) < 1e-6


@pytest.mark.parametrize("precompute", [False, True], ids=["live", "precomputed"])
def test_resume_continues_exactly(tiny_model_dir, data, tmp_path, precompute):
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train.max_steps=4", "train.save_steps=2", "train.lr_scheduler_type=cosine", "train.warmup_steps=1",
              f"algo.precompute_ref_logprobs={str(precompute).lower()}"]
    assert run_cli("dpo", *base(tiny_model_dir, data, full, *common)) == 0
    assert run_cli("dpo", *base(tiny_model_dir, data, split, *common, "train.max_steps_per_run=2")) == 0
    assert not (split / "final").exists() and (split / "checkpoints" / "step-2").exists()
    if precompute:
        cache = split / "ref_logprobs.safetensors"
        before = cache.stat().st_mtime_ns
    assert run_cli("dpo", *base(tiny_model_dir, data, split, *common, "train.resume_from_checkpoint=auto")) == 0
    if precompute:
        assert cache.stat().st_mtime_ns == before  # the cached table was reused, not recomputed
    a, b = step_losses(full), step_losses(split)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    assert max_weight_diff(final_weights(full), final_weights(split)) < 1e-6


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_accumulation_gives_the_same_update(tiny_model_dir, data, tmp_path, loss_type):
    assert_accumulation_is_invisible("dpo", lambda out, *extra: base(
        tiny_model_dir, data, out, "train.max_steps=3", f"algo.loss_type={loss_type}", "algo.rpo_alpha=0.2", *extra),
        tmp_path)


def test_preference_accuracy_matches_the_runs_metric(tiny_model_dir, data, tmp_path):
    from posttrain.demo.metrics import preference_accuracy

    out = tmp_path / "run"
    assert run_cli("dpo", *base(tiny_model_dir, data, out, "train.max_steps=6", "train.learning_rate=1e-2",
                                f"data.eval={data['pref_eval']}")) == 0
    final_eval = [r for r in metrics(out) if "eval/rewards/accuracies" in r][-1]
    implicit = preference_accuracy(out / "final", examples=data["pref_eval"], reference=tiny_model_dir)
    assert implicit == pytest.approx(final_eval["eval/rewards/accuracies"], abs=1e-6)
    # the same pairs as rows, and the reference itself: every pair a tie, so 0 correct
    rows = [json.loads(line) for line in data["pref_eval"].read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert preference_accuracy(model, tokenizer, rows, reference=model) == 0.0
    plain = preference_accuracy(out / "final", examples=rows)
    assert plain == pytest.approx(final_eval["eval/logps/accuracies"], abs=1e-6)
    start = [r for r in metrics(out) if "eval/logps/accuracies" in r][0]
    assert start["step"] == 0 and start["eval/rewards/accuracies"] == 0.0
    assert start["eval/logps/accuracies"] == pytest.approx(preference_accuracy(model, tokenizer, rows), abs=1e-6)


def test_sequence_logps_match_a_naive_log_softmax(tiny_model_dir, data):
    """The memory-light path (one concatenated forward, chunked log-probs) against a full log_softmax per row."""
    from posttrain.demo.metrics import _tokenised_pairs
    from posttrain.algorithms.preference_logps import sequence_logps, split_pairs
    from posttrain.data import collate_preference

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    pairs = _tokenised_pairs(data["pref_eval"], tokenizer, 512)[:5]
    batch = collate_preference(pairs, tokenizer.pad_token_id)
    with torch.no_grad():
        sums_B, counts_B = sequence_logps(model, batch)
    chosen_P, rejected_P = split_pairs(sums_B, 5)
    for i, pair in enumerate(pairs):
        for side, got in (("chosen_ids", chosen_P[i]), ("rejected_ids", rejected_P[i])):
            ids = torch.tensor([pair["prompt_ids"] + pair[side]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            targets = ids[0, 1:]
            naive = logp[torch.arange(len(targets)), targets][len(pair["prompt_ids"]) - 1:].sum()
            assert float(got) == pytest.approx(float(naive), abs=1e-4)
    assert counts_B.tolist() == [len(p["chosen_ids"]) for p in pairs] + [len(p["rejected_ids"]) for p in pairs]


# --- bad input -------------------------------------------------------------------------------------------------------


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BAD_PAIRS = [
    {"prompt": "What is 1 + 1?", "chosen": "", "rejected": " 3"},            # empty chosen
    {"prompt": "What is 1 + 2?", "chosen": " 3", "rejected": " 3"},          # chosen == rejected
    {"chosen": "Apples are red", "rejected": "Bananas are yellow"},          # no shared (implicit) prompt
]


def test_bad_pairs_are_dropped_and_counted(tiny_model_dir, tmp_path, capsys):
    good = [{"chosen": f"What is {i} + 1? {i + 1}", "rejected": f"What is {i} + 1? {i + 2}"} for i in range(4)]
    bad = [{"chosen": "What is 1 + 1? ", "rejected": "What is 1 + 1? "}, {"chosen": "Red", "rejected": "Blue"}]
    train = write_rows(tmp_path / "mixed.jsonl", good + bad)
    out = tmp_path / "run"
    code = run_cli("dpo", f"model.name_or_path={tiny_model_dir}", f"data.train={train}", f"output_dir={out}",
                   "train.max_steps=1", "train.per_device_train_batch_size=2", "train.report=false")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    log = captured.out + captured.err
    summary = next(line for line in log.splitlines() if "posttrain command=dpo" in line)
    dropped = ast.literal_eval(summary.split("dropped=")[1].split(" | ")[0])
    assert "rows=6" in summary and sum(dropped.values()) == 2 and dropped["dropped_prompt_mismatch"] == 1, summary


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_no_usable_pair_exits_2(tiny_model_dir, tmp_path, capsys, command):
    train = write_rows(tmp_path / "bad.jsonl", BAD_PAIRS[:2])
    out = tmp_path / "run"
    code = run_cli(command, f"model.name_or_path={tiny_model_dir}", f"data.train={train}", f"output_dir={out}")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no usable preference pair in 2 rows" in err
    assert "1 had chosen == rejected" in err and "1 had an empty" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.loss_type=kto", "choose one of sigmoid, robust, ipo, hinge, simpo"),
        ("algo.beta=0", "algo.beta must be > 0"),
        ("algo.label_smoothing=0.5", "label_smoothing must be in [0, 0.5)"),
        ("algo.loss_type=ipo", None),  # valid on its own; with label smoothing it is not:
        ("algo.lose_type=ipo", "did you mean 'algo.loss_type'"),
    ],
)
def test_bad_algo_settings_exit_2(tiny_model_dir, data, tmp_path, capsys, override, message):
    extra = [override] + (["algo.label_smoothing=0.1"] if message is None else [])
    code = run_cli("dpo", *base(tiny_model_dir, data, tmp_path / "run", *extra))
    err = capsys.readouterr().err
    assert code == 2, err
    assert (message or "has no effect with loss_type ipo") in err
    assert not (tmp_path / "run").exists()
