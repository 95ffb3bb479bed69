"""Recipes: YAML + overrides -> frozen dataclasses, strict validation, every shipped recipe loads."""

from pathlib import Path

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.config import SFTAlgoConfig, dump_yaml, load_recipe
from posttrain.config.load import apply_override
from posttrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


def test_overrides_parse_values_and_nested_keys(tmp_path):
    path = write(tmp_path, "data:\n  train: a.jsonl\ntrain:\n  max_steps: 5\n")
    r = load_recipe(path, ["train.max_steps=20", "train.learning_rate=3e-4", "model.lora.enabled=true",
                           "model.lora.target_modules=[q_proj,v_proj]"], SFTAlgoConfig)
    assert r.train.max_steps == 20
    assert r.train.learning_rate == pytest.approx(3e-4)
    assert r.model.lora.enabled is True
    assert r.model.lora.target_modules == ("q_proj", "v_proj")
    assert r.data.train == "a.jsonl"


def test_unknown_key_suggests_closest(tmp_path):
    path = write(tmp_path, "data:\n  train: a.jsonl\ntrain:\n  learning_rte: 0.1\n")
    with pytest.raises(UserError, match=r"unknown key 'train.learning_rte'.*did you mean 'train.learning_rate'"):
        load_recipe(path, [], SFTAlgoConfig)


def test_unknown_override_section(tmp_path):
    with pytest.raises(UserError, match="unknown key 'trian'.*did you mean 'train'"):
        load_recipe(None, ["data.train=a.jsonl", "trian.max_steps=3"], SFTAlgoConfig)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.learning_rate=0", "train.learning_rate must be > 0"),
        ("train.learning_rate=-1e-4", "train.learning_rate must be > 0"),
        ("train.per_device_train_batch_size=0", "per_device_train_batch_size must be > 0"),
        ("train.per_device_train_batch_size=two", "must be an integer"),
        ("train.max_steps=0", "train.max_steps must be"),
        ("train.lr_scheduler_type=wavy", "choose one of constant, linear, cosine"),
        ("train.mixed_precision=no", "quote the word you meant"),
        ("train.warmup_ratio=1.5", "warmup_ratio"),
        ("model.lora.enabled=maybe", "must be true or false"),
        ("train.eval_pass_k=[0,4]", r"eval_pass_k must list ks >= 1"),
        ("train.eval_pass_k=[1,a]", "must be an integer"),
        ("train.eval_pass_k_samples=8", "train.eval_pass_k is empty"),
    ],
)
def test_invalid_values(override, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, ["data.train=a.jsonl", override], SFTAlgoConfig)


def test_pass_at_k_needs_enough_samples_and_sampling():
    base = ["data.train=a.jsonl", "train.eval_pass_k=[1,4,16]"]
    assert load_recipe(None, base, SFTAlgoConfig).train.eval_pass_k == (1, 4, 16)
    with pytest.raises(UserError, match=r"eval_pass_k_samples=8 is below the largest k \(16\)"):
        load_recipe(None, base + ["train.eval_pass_k_samples=8"], SFTAlgoConfig)
    with pytest.raises(UserError, match="generation.temperature is 0"):
        load_recipe(None, base + ["generation.temperature=0"], SFTAlgoConfig)


def test_conflicting_options():
    with pytest.raises(UserError, match="conflict"):
        load_recipe(None, ["data.train=a.jsonl", "train.resume_from_checkpoint=auto", "train.overwrite_output_dir=true"],
                    SFTAlgoConfig)


def test_missing_recipe_file_and_bad_override():
    with pytest.raises(UserError, match="does not exist"):
        load_recipe("nope.yaml", [], SFTAlgoConfig)
    with pytest.raises(UserError, match="key.sub=value"):
        apply_override({}, "train.max_steps")


def test_recipe_is_frozen_and_round_trips(tmp_path):
    r = load_recipe(None, ["data.train=a.jsonl", "train.max_steps=7"], SFTAlgoConfig)
    with pytest.raises(Exception):
        r.train.max_steps = 3  # frozen
    again = load_recipe(write(tmp_path, dump_yaml(r)), [], SFTAlgoConfig)
    assert again == r


def shipped_recipes():
    return sorted(p for p in (ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path):
    command = path.stem.split("_")[0]
    assert command in ALGORITHMS, f"{path.name}: recipe names start with the command ({', '.join(ALGORITHMS)})"
    recipe = load_recipe(str(path), [], ALGORITHMS[command][0])
    assert recipe.output_dir
    for source in (recipe.data.train, recipe.data.eval):
        if source and source.startswith("examples/"):
            assert (ROOT / source).exists(), f"{path.name} names {source}, which is not shipped"


def test_generation_async_is_read_as_max_staleness_said_once(tmp_path, capsys):
    grpo = ALGORITHMS["grpo"][0]
    base = ["data.train=a.jsonl", "rewards=[{name: exact_match}]", "generation.engine=vllm"]
    r = load_recipe(None, base + ["generation.async=true"], grpo)
    assert r.generation.max_staleness == 1 and r == load_recipe(None, base + ["generation.max_staleness=1"], grpo)
    assert capsys.readouterr().err.count("generation.async=true is now generation.max_staleness=1") == 1
    assert "max_staleness: 1" in dump_yaml(r) and "async" not in dump_yaml(r)
    assert load_recipe(write(tmp_path, dump_yaml(r)), [], grpo) == r
    assert load_recipe(None, base + ["generation.async=false"], grpo).generation.max_staleness == 0
    with pytest.raises(UserError, match=r"generation.async=true means generation.max_staleness=1, but "
                                        r"generation.max_staleness=2 is given too"):
        load_recipe(None, base + ["generation.async=true", "generation.max_staleness=2"], grpo)
    with pytest.raises(UserError, match="generation.async must be true or false, got 'soon'"):
        load_recipe(None, base + ["generation.async=soon"], grpo)


@pytest.mark.parametrize("overrides, message", [
    (["generation.async=true"], r"generation.max_staleness=1 \(generation.async\) .*needs an engine with its own"),
    (["generation.engine=vllm", "generation.max_staleness=-1"], "generation.max_staleness must be >= 0"),
    (["algo.vllm_is_correction=true"], "generation.engine=hf samples with the policy itself"),
    (["generation.engine=vllm", "algo.vllm_is_cap=0.5"], "algo.vllm_is_cap must be >= 1"),
    (["generation.engine=vllm", "generation.max_staleness=2", "generation.vllm.enable_sleep_mode=true"],
     "enable_sleep_mode .*cannot apply"),
])
@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_off_policy_options_that_conflict(command, overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, ["data.train=a.jsonl", "rewards=[{name: exact_match}]"] + overrides, ALGORITHMS[command][0])


# --- YAML that safe_load accepts silently (issue #25) -----------------------------------------------------------------


def write(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_a_key_given_twice_is_refused_at_any_depth_with_both_lines(tmp_path):
    recipe = write(tmp_path, "output_dir: x\ntrain:\n  max_steps: 5\n  learning_rate: 1.0e-4\n  max_steps: 7\n")
    with pytest.raises(UserError, match=r"line 5: key 'train.max_steps' is given twice \(first on line 3\)"):
        load_recipe(recipe, [], SFTAlgoConfig)
    recipe = write(tmp_path, "rewards:\n  - name: format\n    kwargs: {a: 1, b: 2, a: 3}\n")
    with pytest.raises(UserError, match=r"key 'rewards\[0\].kwargs.a' is given twice"):
        load_recipe(recipe, [], SFTAlgoConfig)
    with pytest.raises(UserError, match=r"override 'rewards=.*key 'rewards\[0\].x' is given twice"):
        load_recipe(None, ["rewards=[{name: format, x: 1, x: 2}]"], SFTAlgoConfig)


def test_merge_keys_may_override_what_they_merge(tmp_path):
    recipe = write(tmp_path, "base: &b {max_steps: 3, logging_steps: 1}\n".replace("base", "x-base") +
                   "train:\n  <<: *b\n  max_steps: 9\n")
    with pytest.raises(UserError, match="x-base: neither a TRL key posttrain knows nor a recipe key"):  # merging works; the anchor key itself is unknown
        load_recipe(recipe, [], SFTAlgoConfig)


def test_an_alias_bomb_is_refused_quickly_and_plain_aliases_pass(tmp_path):
    levels = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    recipe = write(tmp_path, "rewards:\n  - name: format\n    kwargs:\n" + "".join(f"      {line}\n" for line in levels))
    with pytest.raises(UserError, match=r"aliases \(\*name\) expand 'rewards\[0\].kwargs.e\[0\]'"):
        load_recipe(recipe, [], SFTAlgoConfig)
    small = write(tmp_path, "rewards:\n  - name: format\n    kwargs: &k {x: [1, 2]}\n  - name: format\n    kwargs: *k\n")
    assert [r.kwargs for r in load_recipe(small, ["data.train=x.jsonl"], SFTAlgoConfig).rewards] == [{"x": [1, 2]}] * 2


def test_an_alias_inside_itself_and_deep_nesting_are_refused(tmp_path):
    with pytest.raises(UserError, match="alias inside its own anchor"):
        load_recipe(write(tmp_path, "train: &t [*t]\n"), [], SFTAlgoConfig)
    with pytest.raises(UserError, match="nested too deeply"):
        load_recipe(write(tmp_path, "a: " + "[" * 20000 + "]" * 20000 + "\n"), [], SFTAlgoConfig)
