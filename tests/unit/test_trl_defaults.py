"""A run given in TRL's words means what it means in TRL: what it leaves out takes TRL 1.16's default for that trainer
(checked against TRL's own dataclasses, not against our table), flags are read as TRL's parser reads them, and a
posttrain recipe keeps posttrain's defaults."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.cli import main
from posttrain.config.keys import recipe_keys
from posttrain.config.load import load_recipe, resolve_recipe
from posttrain.config.trl_compat import TRL_KEYS, NoEffect, trl_defaults_line
from posttrain.config.trl_defaults import TRAINER_CONFIGS
from posttrain.config.trl_flags import split_trl_flags
from posttrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
trl = pytest.importorskip("trl")


def generator():
    spec = importlib.util.spec_from_file_location("trl_defaults_script", ROOT / "scripts" / "trl_defaults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trl_recipe(command: str, *flags: str, overrides: tuple[str, ...] = ()):
    """The recipe `posttrain <command> <TRL flags>` builds (no recipe file: the run is in TRL's words)."""
    if "--dataset_name" not in flags:
        flags = (*flags, "--dataset_name", "d.jsonl")
    rest, parsed = split_trl_flags([command, *flags, *overrides])
    from posttrain.cli import command_line_overrides

    algo_cls = ALGORITHMS[command][0]
    return resolve_recipe(None, command_line_overrides(rest[1:], parsed, algo_cls), algo_cls, trl_flags=parsed)


def test_the_generated_table_and_docs_match_trl_installed():
    script = generator()
    assert (ROOT / "posttrain" / "config" / "trl_defaults.py").read_text() == script.module_text(), \
        "python scripts/trl_defaults.py"
    assert (ROOT / "docs" / "trl.md").read_text() == script.doc_text(), "python scripts/trl_defaults.py"


@pytest.mark.parametrize("command", TRAINER_CONFIGS)
def test_what_a_trl_run_leaves_out_takes_trls_default(command):
    """Every field of the trainer's TRL config (and TRL's ModelConfig) that maps onto a recipe key: the recipe holds
    TRL's default, read here from TRL's dataclass instance, not from our generated table."""
    extra = {"grpo": ("--reward_funcs", "exact_match"), "distill": ()}.get(command, ())
    overrides = ("algo.teacher_model_name_or_path=t/",) if command == "distill" else ()
    recipe, taken = trl_recipe(command, "--model_name_or_path", "m/", "--dataset_name", "d.jsonl", *extra,
                               overrides=overrides)
    config = getattr(trl, TRAINER_CONFIGS[command])(output_dir="x", use_cpu=True)
    valid = {k.path for k in recipe_keys(ALGORITHMS[command][0])}
    checked = []
    for cls in (type(config), trl.ModelConfig):
        instance = config if cls is type(config) else trl.ModelConfig()
        for f in dataclasses.fields(cls):
            path, convert = TRL_KEYS.get(f.name, (None, None))
            value = getattr(instance, f.name)
            value = getattr(value, "value", value)  # TRL's enums: their string
            if path not in valid or f.name in ("output_dir", "generation_batch_size", "report_to") or value is None \
                    or f.name.startswith("vllm_") or f.name in ("model_name_or_path", "model_revision", "use_vllm"):
                continue
            try:
                expected = convert(value) if convert else value
            except NoEffect:
                continue
            if expected is None:
                continue
            got = recipe
            for part in path.split("."):
                got = getattr(got, part)
            got = list(got) if isinstance(got, tuple) else got
            assert got == expected, (command, f.name, path, got, expected)
            checked.append(f.name)
    assert recipe.train.report_to == ("none",)  # TRL's report_to: none (its instance: [])
    assert {"learning_rate", "num_train_epochs", "gradient_checkpointing", "save_steps"} <= set(checked)
    assert recipe.train.mixed_precision == "bf16" and recipe.train.save_total_limit is None
    assert taken and all(path in valid for _, path, _ in taken)


def test_the_issue_numbers():
    grpo, _ = trl_recipe("grpo", "--reward_funcs", "exact_match")
    assert grpo.train.learning_rate == 1e-6 and grpo.generation.max_completion_length == 512
    sft, _ = trl_recipe("sft")
    assert sft.train.learning_rate == 2e-5 and sft.data.max_length == 1024 and not sft.data.assistant_only_loss
    dpo, _ = trl_recipe("dpo")
    assert dpo.train.learning_rate == 1e-6


def test_what_the_run_gives_wins_over_trls_default(tmp_path):
    recipe, taken = trl_recipe("sft", "--max_length", "256", "--fp16", overrides=("train.save_steps=7",))
    assert recipe.data.max_length == 256 and recipe.train.mixed_precision == "fp16" and recipe.train.save_steps == 7
    assert {key for key, _, _ in taken}.isdisjoint({"max_length", "bf16", "save_steps"})
    assert recipe.train.learning_rate == 2e-5  # what it left out is still TRL's
    no_save, _ = trl_recipe("sft", "--save_strategy", "no")
    assert no_save.train.save_steps == 0  # TRL's `no`: no checkpoints, not save_steps' 500


def test_vllm_defaults_only_with_use_vllm():
    plain, _ = trl_recipe("grpo", "--reward_funcs", "exact_match")
    assert plain.algo.vllm_is_correction is False
    with_vllm, _ = trl_recipe("grpo", "--reward_funcs", "exact_match", "--use_vllm")
    assert with_vllm.algo.vllm_is_correction is True and with_vllm.algo.vllm_is_cap == 3.0


def test_a_flat_trl_file_takes_trls_defaults_a_posttrain_recipe_keeps_posttrains(tmp_path):
    flat = tmp_path / "trl.yaml"
    flat.write_text("model_name_or_path: m/\ndataset_name: d.jsonl\nlearning_rate: 3.0e-5\ntrain:\n  max_steps: 5\n")
    recipe, taken = resolve_recipe(str(flat), [], ALGORITHMS["sft"][0])
    assert recipe.train.learning_rate == 3e-5 and recipe.train.max_steps == 5  # its own values
    assert recipe.data.max_length == 1024 and recipe.train.gradient_checkpointing  # TRL's for the rest
    ours = load_recipe(str(ROOT / "recipes" / "sft.yaml"), [], ALGORITHMS["sft"][0])
    both, taken = resolve_recipe(str(ROOT / "recipes" / "sft.yaml"), ["train.learning_rate=1e-5"],
                                 ALGORITHMS["sft"][0], trl_flags={"learning_rate": 1e-5})
    assert taken == [] and both.train.learning_rate == 1e-5
    assert both.train.gradient_checkpointing == ours.train.gradient_checkpointing
    assert both.data.max_length == ours.data.max_length and both.train.report_to == ours.train.report_to


def test_the_header_says_which_defaults_came_from_trl(capsys):
    assert main(["sft", "--model_name_or_path", "/no/such/model", "--dataset_name", "d.jsonl"]) == 2
    out = capsys.readouterr().out
    assert "TRL 1.16.0 SFTConfig defaults" in out and "learning_rate=2.0e-05" in out and "max_length=1024" in out
    assert "ppo" in trl_defaults_line(ALGORITHMS["ppo"][0], []) and "posttrain's defaults" in trl_defaults_line(
        ALGORITHMS["ppo"][0], [])


@pytest.mark.parametrize("flag", ["eval_strategy", "logging_strategy"])
def test_strategy_no_is_the_word_no(flag, capsys):
    recipe, _ = trl_recipe("sft", f"--{flag}", "no")
    assert f"--{flag} no has no effect here" in capsys.readouterr().err
    assert recipe.train.eval_steps == 0 and recipe.train.logging_steps == 10


@pytest.mark.parametrize("argv, flags", [
    (["--lr_scheduler_type", "cosine", "--optim=adamw_torch"], {"lr_scheduler_type": "cosine", "optim": "adamw_torch"}),
    (["--bf16", "no", "--use_peft", "Yes", "--packing"], {"bf16": False, "use_peft": True, "packing": True}),
    (["--save_steps", "10", "--warmup_steps", "0.1"], {"save_steps": 10, "warmup_steps": 0.1}),
    (["--no_remove_unused_columns", "--no-gradient-checkpointing"],
     {"remove_unused_columns": False, "gradient_checkpointing": False}),
    (["--lora_target_modules", "all-linear"], {"lora_target_modules": ["all-linear"]}),
    (["--lora_target_modules", "q_proj", "v_proj", "--max_length", "none"],
     {"lora_target_modules": ["q_proj", "v_proj"], "max_length": None}),
    (["--dataset_text_field", "1e3", "--run_name", "true"], {"dataset_text_field": "1e3", "run_name": "true"}),
])
def test_flags_are_read_as_trls_parser_reads_them(argv, flags):
    assert split_trl_flags(["sft", *argv]) == (["sft"], flags)


def test_dpo_loss_type_is_a_list_as_in_trl():
    assert split_trl_flags(["dpo", "--loss_type", "ipo"])[1] == {"loss_type": ["ipo"]}
    assert split_trl_flags(["sft", "--loss_type", "nll"])[1] == {"loss_type": "nll"}


@pytest.mark.parametrize("argv, message", [
    (["--max_steps", "ten"], "--max_steps ten: expected a whole number"),
    (["--bf16", "maybe"], "--bf16 maybe: expected true or false"),
    (["--learning_rate"], "--learning_rate needs a value"),
    (["--max_steps", "1", "2"], "--max_steps takes one value, got 2"),
])
def test_values_trls_parser_refuses_are_refused(argv, message):
    with pytest.raises(UserError, match=message):
        split_trl_flags(["sft", *argv])


def test_no_form_only_where_trl_has_it(capsys):
    """TRL adds --no_<name> for booleans whose default is true; --no_bf16 is not one (bf16's default is None)."""
    assert main(["sft", "--no_bf16", "--dataset_name", "d.jsonl"]) == 2
    assert "--no_bf16: did you mean '--bf16'?" in capsys.readouterr().err


def test_all_linear_lora(tmp_path):
    recipe, _ = trl_recipe("sft", "--use_peft", "--lora_target_modules", "all-linear")
    assert recipe.model.lora.target_modules == ("all-linear",)
    with pytest.raises(UserError, match="all-linear names every linear layer already"):
        trl_recipe("sft", "--use_peft", "--lora_target_modules", "all-linear", "q_proj")


@pytest.mark.parametrize("targets, adapted", [
    (("all-linear",), {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ((), {"q_proj", "v_proj"}),  # TRL's default (None): PEFT's modules for Llama
])
def test_peft_chooses_what_trl_lets_it_and_plan_counts_what_peft_adds(targets, adapted, tiny_model_dir):
    """--lora_target_modules all-linear (PEFT's shorthand) and TRL's default (PEFT's table for the architecture) adapt
    what PEFT adapts in TRL; plan's count of the added parameters (model_shape) matches the model's."""
    from transformers import AutoModelForCausalLM

    from posttrain.config.schema import LoraConfig, ModelConfig
    from posttrain.models.load import apply_lora
    from posttrain.plan.shape import model_shape

    lora = LoraConfig(enabled=True, r=4, target_modules=targets)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    names = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert names == adapted
    planned = model_shape(ModelConfig(name_or_path=str(tiny_model_dir), lora=lora)).trainable
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == planned > 0


def test_use_peft_alone_takes_trls_lora_defaults():
    recipe, _ = trl_recipe("sft", "--use_peft")
    assert recipe.model.lora.target_modules == () and recipe.model.lora.dropout == 0.05


def test_a_trl_flag_given_as_false_still_chooses():
    """--bf16 false is TRL's float32 (not its bf16 default); --use_vllm false keeps the vllm_* defaults out."""
    recipe, taken = trl_recipe("sft", "--bf16", "false")
    assert recipe.train.mixed_precision == "no" and "bf16" not in {key for key, _, _ in taken}


@pytest.mark.parametrize("argv, message", [
    (["--lerning_rate", "3"], "--lerning_rate: did you mean '--learning_rate'?"),
    (["--eval_strategy", "epoch"], "'epoch' is not available"),
    (["--max_steps", "ten"], "expected a whole number"),
    (["--neftune_noise_alpha", "5"], "NEFTune embedding noise is not implemented here"),
])
def test_a_refused_flag_is_refused_before_torch_is_imported(argv, message):
    """So it is refused in about a second (was 17-28 s on busy cores): nothing heavy is imported first."""
    import subprocess
    import sys

    code = ("import sys\nfrom posttrain.cli import main\ncode = main(sys.argv[1:])\n"
            "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, "sft", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.split() == ["2", "False"] and message in done.stderr, (done.stdout, done.stderr)


def test_a_flat_trl_file_with_a_bare_no_strategy(tmp_path, capsys):
    """YAML reads `save_strategy: no` as false; in a TRL config it can only mean the word."""
    flat = tmp_path / "trl.yaml"
    flat.write_text("model_name_or_path: m/\ndataset_name: d.jsonl\nsave_strategy: no\neval_strategy: no\n")
    recipe, _ = resolve_recipe(str(flat), [], ALGORITHMS["sft"][0])
    assert recipe.train.save_steps == 0 and "eval_strategy no has no effect here" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [(), ("--logging_steps", "7"), ("--logging_steps", "7", "--eval_steps", "0")])
def test_eval_strategy_steps_without_eval_steps_evaluates_every_logging_step_as_trl(flags, capsys):
    """TRL (transformers' TrainingArguments) gives eval_steps the logging_steps when eval_strategy is steps and
    eval_steps is unset or 0: read from TRL's own config, not from our table."""
    trl_eval_steps = trl.SFTConfig(output_dir="x", use_cpu=True, eval_strategy="steps",
                                   **{flags[i][2:]: int(flags[i + 1]) for i in range(0, len(flags), 2)}).eval_steps
    recipe, _ = trl_recipe("sft", "--eval_strategy", "steps", *flags)
    assert recipe.train.eval_steps == trl_eval_steps == (7 if flags else 10)
    assert f"evaluation every logging_steps ({trl_eval_steps}) steps, as in TRL" in capsys.readouterr().err
    given, _ = trl_recipe("sft", "--eval_strategy", "steps", "--eval_steps", "3")
    assert given.train.eval_steps == 3
    unset, _ = trl_recipe("sft")  # TRL's eval_strategy no: no periodic evaluation (posttrain's 0)
    assert unset.train.eval_steps == 0
    ours, _ = resolve_recipe(str(ROOT / "recipes" / "sft.yaml"), [], ALGORITHMS["sft"][0],
                             trl_flags={"eval_strategy": "steps"})
    assert ours.train.eval_steps == 100  # recipes/sft.yaml sets it: kept


def test_max_tool_calling_iterations_means_what_it_means_in_trl():
    """TRL's GRPOTrainer runs `while idxs_with_tool and iteration_num < max_tool_calling_iterations` after the first
    generation, with None as no limit (sys.maxsize): N rounds of tool calls are N + 1 model turns, None no limit."""
    assert trl.GRPOConfig(output_dir="x", use_cpu=True).max_tool_calling_iterations is None
    unset, taken = trl_recipe("grpo", "--reward_funcs", "exact_match")
    assert unset.agent.max_turns is None and ("max_tool_calling_iterations", "agent.max_turns", None) in taken
    two, _ = trl_recipe("grpo", "--reward_funcs", "exact_match", "--max_tool_calling_iterations", "2")
    assert two.agent.max_turns == 3
    none, _ = trl_recipe("grpo", "--reward_funcs", "exact_match", "--max_tool_calling_iterations", "none")
    assert none.agent.max_turns is None
    ours = load_recipe(str(ROOT / "recipes" / "grpo.yaml"), [], ALGORITHMS["grpo"][0])
    assert ours.agent.max_turns == 4  # a posttrain recipe keeps posttrain's limit
