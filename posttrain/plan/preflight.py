"""The checks every run makes of its recipe before anything heavy, in one list that run.py, the Ray driver and
`posttrain plan` all call: a check added here for runs is one the planner makes too, so a plan never recommends a
command that exits 2.

    check_recipe(recipe, algorithm)             # run.py and launch/ray_launcher.py: this launch's world
    check_recipe(recipe, algorithm, world=8)    # posttrain plan --gpus 8

Each reads the recipe and, where the model is local or cached, its config.json; nothing is loaded or written and no
user code is imported. What needs more (the algorithm's own preflight: rewards, teacher, critic; the output
directory, the tokenizer, servers, the agent's tools, the data) stays with the run, in that order (run.py).
"""

from __future__ import annotations

from typing import Callable, Optional

from posttrain.distributed.precision import check_master_weights
from posttrain.generation.vllm_engine import check_fp32_head
from posttrain.models.limits import check_position_limit, check_sequence_parallel, model_config_file
from posttrain.models.load import check_model_source
from posttrain.models.moe import check_moe_options
from posttrain.models.packing import check_packing
from posttrain.models.vision import check_vision_recipe
from posttrain.online.evaluation import check_eval_settings
from posttrain.train.micro_batches import check_token_budget

# name -> check(recipe, algorithm, world); world None: this launch's WORLD_SIZE
RECIPE_CHECKS: dict[str, Callable[..., None]] = {
    "model source": lambda recipe, algorithm, world: check_model_source(recipe.model),
    "vision-language model": lambda recipe, algorithm, world: check_vision_recipe(recipe, algorithm) and None,
    "position limit": lambda recipe, algorithm, world: check_position_limit(recipe, algorithm.data_kind),
    "packing": lambda recipe, algorithm, world: check_packing(recipe),  # attention that would mix packed rows
    "master weights": lambda recipe, algorithm, world: check_master_weights(recipe.model, recipe.train),
    "mixture of experts": lambda recipe, algorithm, world: check_moe_options(recipe, algorithm.routing_replay),
    "token budget": lambda recipe, algorithm, world: check_token_budget(recipe, algorithm),
    "sequence parallelism": lambda recipe, algorithm, world: check_sequence_parallel(recipe, algorithm, world=world),
    "LoRA targets": lambda recipe, algorithm, world: check_lora_targets(recipe, algorithm),
    "pass@k": lambda recipe, algorithm, world: check_eval_settings(recipe, algorithm),  # only where eval samples
    "float32 output layer": lambda recipe, algorithm, world: check_fp32_head(recipe),  # vLLM's side of it
}


def check_lora_targets(recipe, algorithm) -> None:
    """model.lora.target_modules names linear layers of the model (built on the meta device from its config.json,
    where that is local or cached and needs no remote code), so a typo (or TRL's --lora_target_modules naming
    another architecture's layers) stops the run before it writes anything."""
    from posttrain.plan.shape import model_shape

    model = recipe.model
    if model.lora.enabled and not model.trust_remote_code and model_config_file(model.name_or_path, model.revision):
        model_shape(model, algorithm.model_kind)  # UserError when they match no linear layer


def check_recipe(recipe, algorithm, world: Optional[int] = None) -> None:
    """Every check of RECIPE_CHECKS, in order; the first bad input raises its UserError (exit 2)."""
    for check in RECIPE_CHECKS.values():
        check(recipe, algorithm, world)
