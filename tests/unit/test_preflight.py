"""One list of recipe checks (posttrain/plan/preflight.py) made by a run, the Ray driver and `posttrain plan`: a check
added to it refuses the recipe in all three, before any model loads or anything is written."""

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.config.load import load_recipe
from posttrain.errors import UserError
from posttrain.plan import preflight


def refuse(recipe, algorithm, world):
    raise UserError(f"sentinel check refused the recipe (world {world})")


@pytest.fixture
def sentinel(monkeypatch):
    monkeypatch.setitem(preflight.RECIPE_CHECKS, "sentinel", refuse)


def sft_recipe(tmp_path, tiny_model_dir):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    return load_recipe(None, [f"data.train={tmp_path / 'train.jsonl'}", f"model.name_or_path={tiny_model_dir}",
                              f"output_dir={tmp_path / 'out'}"], ALGORITHMS["sft"][0])


def test_a_check_in_the_list_stops_a_run_before_it_writes(sentinel, tmp_path, tiny_model_dir):
    from posttrain.run import run_attempt

    with pytest.raises(UserError, match="sentinel check refused the recipe"):
        run_attempt("sft", sft_recipe(tmp_path, tiny_model_dir))
    assert not (tmp_path / "out").exists()


def test_the_same_check_stops_the_planner_with_its_gpus_as_the_world(sentinel, tmp_path, tiny_model_dir):
    from posttrain.plan import check_as_run

    with pytest.raises(UserError, match=r"sentinel check refused the recipe \(world 8\)"):
        check_as_run("sft", sft_recipe(tmp_path, tiny_model_dir), gpus=8)


def test_the_same_check_stops_the_ray_driver_before_a_cluster_starts(sentinel, tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.launch import ray_launcher

    monkeypatch.setattr(ray_launcher, "import_ray", lambda: None)  # ray itself is optional here
    monkeypatch.setattr(ray_launcher, "start_ray", lambda *a: pytest.fail("the cluster was touched before the checks"))
    with pytest.raises(UserError, match="sentinel check refused the recipe"):
        ray_launcher.run_on_ray("sft", sft_recipe(tmp_path, tiny_model_dir))


def test_the_list_holds_every_shape_check_a_run_made_before_it_was_one_list():
    assert list(preflight.RECIPE_CHECKS) == ["model source", "vision-language model", "position limit", "packing",
                                             "master weights", "mixture of experts", "token budget",
                                             "sequence parallelism", "LoRA targets", "pass@k",
                                             "float32 output layer"]


def test_lora_targets_that_match_no_layer_stop_the_run_before_it_writes(tmp_path, tiny_model_dir):
    """TRL's --lora_target_modules naming another architecture's layers (c_attn on a Llama) is refused, not found
    once the run folder is written."""
    from posttrain.run import run_attempt

    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    recipe = load_recipe(None, [f"data.train={tmp_path / 'train.jsonl'}", f"model.name_or_path={tiny_model_dir}",
                                f"output_dir={tmp_path / 'out'}", "model.lora.enabled=true",
                                "model.lora.target_modules=[c_attn]"], ALGORITHMS["sft"][0])
    with pytest.raises(UserError, match=r"model.lora.target_modules \['c_attn'\] match no linear layer"):
        run_attempt("sft", recipe)
    assert not (tmp_path / "out").exists()
