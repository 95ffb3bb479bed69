"""`posttrain doctor --config`'s checks of the recipe itself: it builds, and its model and data are there.

    posttrain doctor --config recipes/sft.yaml model.name_or_path=Qwen/Qwen2.5-0.5B

Why: "all checks passed" must not be said of a launch whose model path has a typo or whose data file is missing;
those would fail only once every node had started (and, offline, after a minute of retrying the hub).
"""

from __future__ import annotations

import os

from posttrain.errors import UserError


def check_inputs(report, config: str, overrides: list[str]) -> None:
    """Add a recipe, model and data line (PASS / WARN / FAIL) to the doctor's report."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.plan import infer_algorithm

    try:
        algorithm = infer_algorithm(config, overrides)
        recipe = load_recipe(config, overrides, ALGORITHMS[algorithm][0])
    except UserError as e:
        report.add("FAIL", "recipe", str(e), "fix the recipe: `posttrain <algorithm> --help` lists every key")
        return
    report.add("PASS", "recipe", f"{config} builds as a `posttrain {algorithm}` recipe")
    check_model(report, recipe.model)
    for which in ("train", "eval"):
        source = getattr(recipe.data, which)
        if source:
            check_data(report, f"data.{which}", source, getattr(recipe.data, f"{which}_split"))


def check_model(report, model_cfg) -> None:
    from posttrain.models.load import _looks_local, check_model_source

    name = model_cfg.name_or_path
    try:
        check_model_source(model_cfg)
    except UserError as e:
        report.add("FAIL", "model", str(e))
        return
    if _looks_local(name):
        report.add("PASS", "model", f"{name} is a model directory")
        return
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", revision=model_cfg.revision)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if isinstance(cached, str):
        report.add("PASS", "model", f"{name} is in the Hugging Face cache")
    elif offline:
        report.add("FAIL", "model", f"{name} is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
                   f"hf download {name} (where the hub is reachable), or give a model directory")
    else:
        report.add("WARN", "model", f"{name} is not cached: every node downloads it at launch",
                   f"hf download {name} on each node first")


def check_data(report, what: str, source: str, split: str) -> None:
    from posttrain.data import load_rows

    try:
        rows = load_rows(source, split, what)
    except UserError as e:
        report.add("FAIL", what, str(e))
    except Exception as e:  # the hub's and datasets' own errors: unreachable, no such dataset or split
        report.add("FAIL", what, f"{source}: {type(e).__name__}: {e}")
    else:
        report.add("PASS", what, f"{source}: {len(rows)} rows")
