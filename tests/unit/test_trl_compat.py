"""Coming from TRL: flat config files and `--key value` flags translate to the recipe keys that mean the same thing;
every key with no meaning here is reported at once with the closest name; `posttrain <algo> --help` lists the keys;
command-line errors name the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.cli import ALGORITHM_COMMANDS, command_line_overrides, main
from posttrain.config.keys import recipe_keys
from posttrain.config.load import load_recipe
from posttrain.config.trl_compat import TRL_KEYS
from posttrain.config.trl_flags import split_trl_flags
from posttrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_flat_trl_sft_config_file_translates(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nlearning_rate: 2.0e-5\nper_device_train_batch_size: 4\n"
                      "gradient_accumulation_steps: 8\nbf16: true\nmax_length: 1024\npacking: true\n"
                      "dataset_name: trl-lib/Capybara\noutput_dir: runs/capy\nnum_train_epochs: 3\n"
                      "lr_scheduler_type: cosine\nwarmup_ratio: 0.03\nuse_peft: true\nlora_r: 8\n")
    recipe = load_recipe(str(config), [], ALGORITHMS["sft"][0])
    assert recipe.model.name_or_path == "Qwen/Qwen2.5-0.5B" and recipe.output_dir == "runs/capy"
    assert recipe.train.learning_rate == 2e-5 and recipe.train.per_device_train_batch_size == 4
    assert recipe.train.gradient_accumulation_steps == 8 and recipe.train.mixed_precision == "bf16"
    assert recipe.train.num_train_epochs == 3 and recipe.train.lr_scheduler_type == "cosine"
    assert recipe.data.max_length == 1024 and recipe.data.packing and recipe.data.train == "trl-lib/Capybara"
    assert recipe.model.lora.enabled and recipe.model.lora.r == 8


def test_flat_trl_grpo_config_mixed_with_sections(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text("num_generations: 4\nbeta: 0.04\nmax_completion_length: 32\nuse_vllm: true\n"
                      "scale_rewards: false\ndata:\n  train: examples/data/prompts_train.jsonl\nrewards: [{name: exact_match}]\n")
    recipe = load_recipe(str(config), [], ALGORITHMS["grpo"][0])
    assert recipe.algo.num_generations == 4 and recipe.algo.beta == 0.04
    assert recipe.generation.max_completion_length == 32 and recipe.generation.engine == "vllm"
    assert recipe.algo.scale_rewards == "none" and recipe.data.train == "examples/data/prompts_train.jsonl"


def test_every_key_without_meaning_is_reported_at_once_with_closest_name(tmp_path, capsys):
    config = tmp_path / "trl.yaml"
    config.write_text("model_name_or_path: tiny/\nlerning_rate: 1e-4\nnum_generations: 4\nneftune_noise_alpha: 5\n"
                      "per_device_train_batch_sise: 2\n")
    assert main(["sft", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: 4 keys refused" in err
    assert "lerning_rate: did you mean 'learning_rate'?" in err
    assert "per_device_train_batch_sise: did you mean 'per_device_train_batch_size'?" in err
    assert "num_generations: posttrain's algo.num_generations, which `posttrain sft` does not take" in err
    assert "neftune_noise_alpha: NEFTune embedding noise is not implemented here" in err


def test_trl_style_flags_become_overrides():
    argv = ["grpo", "--config", "r.yaml", "--learning_rate", "1e-6", "--num_generations=4", "--use_vllm",
            "train.max_steps=3", "--beta", "0.0"]
    rest, flags = split_trl_flags(argv)
    assert rest == ["grpo", "--config", "r.yaml", "train.max_steps=3"]
    assert flags == {"learning_rate": 1e-6, "num_generations": 4, "use_vllm": True, "beta": 0.0}
    overrides = command_line_overrides(["train.max_steps=3"], flags, ALGORITHMS["grpo"][0])
    recipe = load_recipe(None, overrides + ["rewards=[{name: exact_match}]", "data.train=x.jsonl"], ALGORITHMS["grpo"][0])
    assert recipe.train.learning_rate == 1e-6 and recipe.algo.num_generations == 4
    assert recipe.generation.engine == "vllm" and recipe.algo.beta == 0.0 and recipe.train.max_steps == 3


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_trl_importance_sampling_flags_set_the_correction(command):
    flags = {"use_vllm": True, "vllm_importance_sampling_correction": True,
             "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 3.0,
             "vllm_importance_sampling_clip_min": 0.25}
    algo_cls = ALGORITHMS[command][0]
    overrides = command_line_overrides([], flags, algo_cls)
    recipe = load_recipe(None, overrides + ["rewards=[{name: exact_match}]", "data.train=x.jsonl"], algo_cls)
    algo = recipe.algo
    assert (algo.vllm_is_correction, algo.vllm_importance_sampling_mode, algo.vllm_is_cap, algo.vllm_is_min) == \
        (True, "token_mask", 3.0, 0.25)
    with pytest.raises(UserError, match="vllm_importance_sampling_mode is 'token_clip'; choose one of token_truncate"):
        load_recipe(None, command_line_overrides([], {**flags, "vllm_importance_sampling_mode": "token_clip"}, algo_cls)
                    + ["rewards=[{name: exact_match}]", "data.train=x.jsonl"], algo_cls)
    with pytest.raises(UserError, match="algo.vllm_is_min must be >= 0 and below algo.vllm_is_cap"):
        load_recipe(None, command_line_overrides([], {**flags, "vllm_importance_sampling_clip_min": 3.0}, algo_cls)
                    + ["rewards=[{name: exact_match}]", "data.train=x.jsonl"], algo_cls)


def test_unknown_flags_all_reported_as_flags(capsys):
    assert main(["sft", "--lerning_rate", "3", "--warmup_stepz=2", "--bf16"]) == 2
    err = capsys.readouterr().err
    assert "command line: 2 keys" in err
    assert "--lerning_rate: did you mean '--learning_rate'?" in err and "--warmup_stepz: did you mean" in err


def test_override_errors_name_the_command_line_and_echo_it(capsys):
    assert main(["sft", "--config", str(ROOT / "recipes" / "sft.yaml"), "train.max_steps=abc"]) == 2
    err = capsys.readouterr().err
    assert "command line 'train.max_steps=abc'" in err and "sft.yaml" not in err


def test_bare_no_on_the_command_line_is_the_word_no():
    overrides = command_line_overrides(["train.mixed_precision=no"], {}, ALGORITHMS["sft"][0])
    assert load_recipe(None, overrides + ["data.train=x.jsonl"], ALGORITHMS["sft"][0]).train.mixed_precision == "no"


def test_bare_no_in_a_yaml_file_gets_a_true_hint(tmp_path):
    config = tmp_path / "r.yaml"
    config.write_text("train:\n  mixed_precision: no\n")
    with pytest.raises(UserError) as e:
        load_recipe(str(config), [], ALGORITHMS["sft"][0])
    assert "'False'" not in str(e.value) and "mixed_precision: 'no'" in str(e.value)


def test_every_trl_key_lands_on_a_recipe_key():
    every = {k.path for cls, _ in ALGORITHMS.values() for k in recipe_keys(cls)}
    missing = {trl: path for trl, (path, _) in TRL_KEYS.items() if path not in every}
    assert set(missing.values()) <= {"train.report_to"}, missing  # the trackers' key (#26) where it is not yet


def test_algorithm_help_lists_recipe_keys_with_defaults_and_docs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["grpo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "train.learning_rate = 0.0001  # Peak learning rate (AdamW)." in out
    assert "algo.num_generations = 8  #" in out and "generation.max_staleness = 0" in out
    assert "--learning_rate 1e-4" in out  # the TRL-style flags are announced


def test_commands_listed_without_import_match_the_algorithm_table():
    assert ALGORITHM_COMMANDS == tuple(ALGORITHMS)


def test_top_level_help_imports_no_torch():
    code = ("import sys, contextlib, io\nfrom posttrain.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['--help'])\n    except SystemExit: pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "False"
