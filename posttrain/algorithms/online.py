"""What every online algorithm (GRPO family, PPO) shares: its rewards, the generic rollout source, and held-out
evaluation by generating."""

from __future__ import annotations

from posttrain.algorithms.base import Algorithm, Models
from posttrain.config.schema import Recipe
from posttrain.errors import UserError


def check_is_correction(config, recipe: Recipe) -> None:
    """algo.vllm_is_correction needs an engine that reports its own log-probs apart from the trainer's."""
    if config.vllm_is_cap < 1:
        raise UserError(f"algo.vllm_is_cap must be >= 1 (it caps pi_old / pi_sampler), got {config.vllm_is_cap}")
    if config.vllm_is_correction and recipe.generation.engine == "hf":
        raise UserError("algo.vllm_is_correction corrects for an engine that samples apart from the trainer; "
                        "generation.engine=hf samples with the policy itself. Use generation.engine=vllm or server, "
                        "or set algo.vllm_is_correction=false")


class OnlineAlgorithm(Algorithm):
    data_kind = "prompt"
    model_kind = "causal_lm"

    def __init__(self, recipe: Recipe):
        from posttrain.rewards import load_rewards

        self.recipe = recipe
        self.rewards = load_rewards(recipe.rewards)  # a bad reward fails here, before any model is loaded

    def reward_models(self) -> list:
        """The scorers of the recipe's `reward_model` entries (one per directory and settings; see load_scorer); one
        given its own `device` kwarg stays where it is."""
        from posttrain.rewards.reward_model import load_scorer

        scorers = [load_scorer(**r.kwargs) for r in self.recipe.rewards if r.name == "reward_model"]
        return [s for s in dict.fromkeys(scorers) if not s.device_given]

    def make_source(self, backend, models: Models, train_examples):
        from posttrain.train.rollout_source import RolloutSource

        self.source = RolloutSource(self.recipe, backend, models, self, train_examples, self.rewards)
        return self.source

    def evaluate(self, backend, models: Models, eval_examples) -> dict[str, float]:
        """Held-out greedy accuracy (exact_match), mean total reward and completion length, over all ranks; with
        the source's engine, so it runs wherever generation does, on the current policy's weights."""
        from posttrain.algorithms.grpo_eval import evaluate_prompts

        self.source.before_evaluation()  # an engine with its own copy of the weights gets the current policy
        return evaluate_prompts(backend, self.source.engine, models.tokenizer, eval_examples, self.rewards,
                                self.recipe.generation, self.source.agent)
