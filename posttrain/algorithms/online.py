"""What every online algorithm (GRPO family, PPO) shares: its rewards and reward models. run.py gives it the generic
rollout source (train/rollout_source.py) and held-out evaluation by generating (train/evaluation.py)."""

from __future__ import annotations

from posttrain.algorithms.base import Algorithm
from posttrain.config.schema import Recipe
from posttrain.errors import UserError
from posttrain.rewards import load_rewards
from posttrain.rewards.reward_model import load_scorer


def check_is_correction(config, recipe: Recipe) -> None:
    """algo.vllm_is_correction needs an engine that reports its own log-probs apart from the trainer's."""
    if config.vllm_is_cap < 1:
        raise UserError(f"algo.vllm_is_cap must be >= 1 (it caps pi_old / pi_sampler), got {config.vllm_is_cap}")
    if config.vllm_is_correction and recipe.generation.engine == "hf":
        raise UserError("algo.vllm_is_correction corrects for an engine that samples apart from the trainer; "
                        "generation.engine=hf samples with the policy itself. Use generation.engine=vllm or server, "
                        "or set algo.vllm_is_correction=false")


class OnlineAlgorithm(Algorithm):
    source_kind = "rollout"
    data_kind = "prompt"

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.rewards = load_rewards(recipe.rewards)  # a bad reward fails here, before any model is loaded

    def reward_models(self) -> list:
        """The scorers of the recipe's `reward_model` entries (one per directory and settings; see load_scorer); one
        given its own `device` kwarg stays where it is."""
        scorers = [load_scorer(**r.kwargs) for r in self.recipe.rewards if r.name == "reward_model"]
        return [s for s in dict.fromkeys(scorers) if not s.device_given]
