"""What every online algorithm (GRPO family, PPO) shares: its rewards, the generic rollout source, and held-out
evaluation by generating."""

from __future__ import annotations

from posttrain.algorithms.base import Algorithm, Models
from posttrain.config.schema import Recipe


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
        the source's engine, so it runs wherever generation does."""
        from posttrain.algorithms.grpo_eval import evaluate_prompts

        return evaluate_prompts(backend, self.source.engine, models.tokenizer, eval_examples, self.rewards,
                                self.recipe.generation)
