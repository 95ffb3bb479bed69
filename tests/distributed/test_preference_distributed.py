"""RM and DPO on 2 CPU processes (gloo) under DDP, DeepSpeed ZeRO-1/2/3 and FSDP2 give the losses and weights of one
process with the same global batch (2 processes x micro-batch 1 x accumulation 2 == 1 process x micro-batch 4).

DPO runs with a live frozen reference everywhere (under ZeRO-3 the reference is itself a sharded inference engine),
and with precompute_ref_logprobs under ZeRO-3 and FSDP2: every rank scores its slice of the pairs in step with the
others, one all-reduce assembles the table, and the cached table equals the one-process table. LoRA DPO (reference
= the adapter-off policy) runs under DDP, ZeRO-3 and FSDP2, LoRA RM under FSDP2; the merged final/ equals the
one-process one. DPO with padding-free pairs in token-budget micro-batches under DDP and ZeRO-3. Three steps each.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.distributed.launch import ENGINE_NAMES, launch
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import assert_same_update, final_weights, metrics, run_cli, run_overrides, step_losses

pytestmark = pytest.mark.distributed

STEPS = 3
ENGINES = {"ddp": None, "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp2": "fsdp2"}
NAMES = {**ENGINE_NAMES, "zero1": "deepspeed-zero1"}
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=16, n_eval=4)


def overrides(tiny_model_dir, data, out, *extra):
    return run_overrides(tiny_model_dir, data["pref_train"], out, f"data.eval={data['pref_eval']}",
                         "train.per_device_eval_batch_size=1", f"train.max_steps={STEPS}", *extra)


ONE = ["train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=1"]
TWO = ["train.per_device_train_batch_size=1", "train.gradient_accumulation_steps=2"]
SHORT = ["data.max_length=32"]  # pairs of 40-44 tokens


@pytest.fixture(scope="module")
def single(tiny_model_dir, data, tmp_path_factory):
    """(command, variant) -> the one-process run directory (run in this process, once)."""
    root = tmp_path_factory.mktemp("single")
    cache = {}

    def get(command: str, variant: str = "plain"):
        key = (command, variant)
        if key not in cache:
            out = root / f"{command}-{variant}"
            extra = LORA if variant == "lora" else []
            extra += ["algo.precompute_ref_logprobs=true"] if variant == "precomputed" else []
            extra += SHORT if variant == "short" else []
            assert run_cli(command, *overrides(tiny_model_dir, data, out, *ONE, *extra)) == 0
            cache[key] = out
        return cache[key]

    return get


def check_matches(result, reference_dir, engine):
    result.check_world(2)
    assert result.facts["engine"] == NAMES[engine]
    assert result.facts["global_batch"] == "4"
    one = {(r["step"], "eval/loss" in r): r for r in metrics(reference_dir)}
    two = {(r["step"], "eval/loss" in r): r for r in result.metrics()}
    assert one.keys() == two.keys()
    for key, expected in one.items():
        for name, value in expected.items():
            if name in ("loss", "eval/loss") or name.startswith(("rewards/", "logps/", "eval/rewards", "accuracy",
                                                                 "margin", "eval/accuracy", "eval/margin")):
                # float32 sums over other batch shapes: 1e-5 absolute, or relative for scores and log-probs far from 0
                assert two[key][name] == pytest.approx(value, rel=3e-5, abs=1e-5), (engine, key, name, two[key],
                                                                                     expected)
    assert sorted(step_losses(result.output_dir)) == list(range(1, STEPS + 1))
    assert_same_update(final_weights(reference_dir), result.final_weights())


@pytest.mark.parametrize("engine", list(ENGINES))
def test_rm_two_processes_match_one(engine, tiny_model_dir, data, tmp_path, single):
    result = launch(2, "rm", overrides(tiny_model_dir, data, tmp_path / "run", *TWO), accelerate_config=ENGINES[engine])
    check_matches(result, single("rm"), engine)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_dpo_two_processes_match_one(engine, tiny_model_dir, data, tmp_path, single):
    result = launch(2, "dpo", overrides(tiny_model_dir, data, tmp_path / "run", *TWO),
                    accelerate_config=ENGINES[engine])
    check_matches(result, single("dpo"), engine)
    assert result.metrics()[0]["eval/loss"] == pytest.approx(0.6931471805599453, abs=1e-6)


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_dpo_precomputed_reference_under_sharding(engine, tiny_model_dir, data, tmp_path, single):
    result = launch(2, "dpo", overrides(tiny_model_dir, data, tmp_path / "run", *TWO,
                                        "algo.precompute_ref_logprobs=true"), accelerate_config=ENGINES[engine])
    reference = single("dpo", "precomputed")
    check_matches(result, reference, engine)
    mine, theirs = (load_file(str(d / "ref_logprobs.safetensors")) for d in (result.output_dir, reference))
    assert mine.keys() == theirs.keys() == {"train", "eval"}
    for split in mine:
        assert (mine[split] - theirs[split]).abs().max() < 1e-5, split


@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_dpo_lora_two_processes_match_one(engine, tiny_model_dir, data, tmp_path, single):
    result = launch(2, "dpo", overrides(tiny_model_dir, data, tmp_path / "run", *TWO, *LORA),
                    accelerate_config=ENGINES[engine])
    check_matches(result, single("dpo", "lora"), engine)
    adapter = load_file(str(result.output_dir / "final" / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)  # the adapter alone, gathered whole


def test_rm_lora_under_fsdp2_exports_the_merged_model(tiny_model_dir, data, tmp_path, single):
    """FSDP2 shards the LoRA model; final/ is merged on rank 0 from the gathered state (the score head is a peft
    modules_to_save copy) and equals the one-process merged export, with no adapter entries left."""
    result = launch(2, "rm", overrides(tiny_model_dir, data, tmp_path / "run", *TWO, *LORA),
                    accelerate_config=ENGINES["fsdp2"])
    check_matches(result, single("rm", "lora"), "fsdp2")
    assert not [k for k in result.final_weights() if "lora" in k or "modules_to_save" in k or "base_layer" in k]
    adapter = load_file(str(result.output_dir / "final" / "adapter" / "adapter_model.safetensors"))
    assert any("score" in k for k in adapter) and any(".lora_B." in k for k in adapter)  # head + adapters


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_dpo_packed_budget_two_processes_match_one(engine, tiny_model_dir, data, tmp_path, single):
    """Padding-free pairs in token-budget micro-batches: the ranks' shares are balanced by tokens and each rank runs
    the agreed number of micro-batches, yet the update is the padded one-process one's. With 87 tokens (this data's
    pairs are 40-44 tokens), step 1 needs 2 micro-batches on rank 0 and 1 on rank 1, which runs a filler; steps 2
    and 3 need 1 on each rank where gradient_accumulation_steps says 2: the backend's boundary is the loop's."""
    result = launch(2, "dpo", overrides(tiny_model_dir, data, tmp_path / "run", *TWO, *SHORT, "data.packing=true",
                                        "train.max_tokens_per_microbatch=87"), accelerate_config=ENGINES[engine])
    check_matches(result, single("dpo", "short"), engine)
