"""Reward functions for online RL: built-in rules, trained reward models and user callables, combined with weights.

A reward function is TRL's: called by keyword with prompts, completions, completion_ids, trainer_state and the
dataset's columns, returning one float (or None) per completion (see `contract`); `load_rewards` turns the recipe's
`rewards:` list into a `RewardSet`, whose `score` gives the weighted total per completion.
"""

from posttrain.rewards.builtin import BUILTIN_REWARDS, exact_match, extract_answer, format_reward, length_penalty
from posttrain.rewards.combine import Reward, RewardError, RewardSet, Scores, reward_metrics
from posttrain.rewards.contract import TrainerState, as_completions, trainer_state
from posttrain.rewards.load import load_reward, load_rewards
from posttrain.rewards.reward_model import RewardModelScorer

__all__ = ["BUILTIN_REWARDS", "Reward", "RewardError", "RewardModelScorer", "RewardSet", "Scores", "TrainerState",
           "as_completions", "exact_match", "extract_answer", "format_reward", "length_penalty", "load_reward",
           "load_rewards", "reward_metrics", "trainer_state"]
