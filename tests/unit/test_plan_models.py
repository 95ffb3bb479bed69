"""The planner asks each algorithm what it holds while training (Algorithm.models_needed) instead of re-deriving it:
for every algorithm, the count it plans for equals the models a run really has once its roles are built and its
setup has run (DPO's precomputed table frees the reference there), and the workload carries them."""

from __future__ import annotations

import datasets
import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.config.load import load_recipe
from posttrain.data import tokenize_preference
from posttrain.distributed.backend import Backend
from posttrain.models.load import load_tokenizer
from posttrain.plan.workload import models_needed, workload_from_recipe
from posttrain.roles import build_roles
from posttrain.run import load_policy, make_collate

CASES = {  # name: (command, overrides), tiny model paths filled in by the test
    "sft": ("sft", []),
    "rm": ("rm", []),
    "dpo": ("dpo", []),
    "dpo-precomputed": ("dpo", ["algo.precompute_ref_logprobs=true"]),
    "simpo": ("dpo", ["algo.loss_type=simpo"]),
    "grpo": ("grpo", ["rewards=[{name: exact_match}]", "algo.num_generations=2"]),
    "grpo-kl": ("grpo", ["rewards=[{name: exact_match}]", "algo.num_generations=2", "algo.beta=0.1"]),
    "ppo": ("ppo", ["rewards=[{name: exact_match}]"]),
    "distill": ("distill", ["algo.teacher_model_name_or_path={model}"]),
    "distill-offline": ("distill", ["algo.teacher_model_name_or_path={model}", "algo.lmbda=0"]),
}
PAIRS = [{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}, {"prompt": "Hi", "chosen": " there", "rejected": " x"}]


def resident_models(models) -> int:
    """The models a run holds while it trains: its roles, every reward model of the reward_model role."""
    roles = [models.policy, models.reference, models.critic, models.teacher]
    return sum(r is not None for r in roles)


@pytest.mark.parametrize("case", CASES)
def test_planner_counts_the_models_the_run_holds(case, tiny_model_dir, tmp_path):
    command, overrides = CASES[case]
    recipe = load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "data.train=unused.jsonl",
                                f"output_dir={tmp_path}", *(o.replace("{model}", str(tiny_model_dir)) for o in overrides)],
                         ALGORITHMS[command][0])
    algorithm = ALGORITHMS[command][1](recipe)
    algorithm.preflight()
    needed = models_needed(command, recipe)

    backend = Backend(recipe)
    tokenizer = load_tokenizer(recipe.model)
    models = build_roles(recipe, algorithm, backend, tokenizer, load_policy(recipe, algorithm))
    examples = []
    if algorithm.data_kind == "preference":
        examples, _ = tokenize_preference(datasets.Dataset.from_list(PAIRS), tokenizer, recipe.data)
    algorithm.setup(backend, models, examples, make_collate(recipe, algorithm, tokenizer), tmp_path)

    assert needed.loaded == resident_models(models) + len(algorithm.reward_models()), case
    assert needed.trained == len(models.trained())
    workload = workload_from_recipe(command, recipe)
    assert (workload.frozen_copies + bool(workload.frozen_parameters), workload.trained_copies) == (needed.frozen,
                                                                                                  needed.trained)
    assert bool(workload.generation_sequences) == (algorithm.source_kind != "dataset")


def test_a_critic_and_a_teachers_logits_are_counted_by_hand():
    """PPO's critic trains beside the policy (its weights, gradients, AdamW moments, at the policy's size); a local
    teacher's logits of the completion rows live beside the student's in the distillation loss."""
    from posttrain.plan.estimate import ENGINES, ModelShape, Workload, estimate

    shape = ModelShape(parameters=1000, trainable=1000, vocab_size=50, hidden_size=8, num_layers=2, num_heads=2,
                       num_kv_heads=2, intermediate_size=16)
    plain = Workload(algorithm="x", sequences=2, sequence_length=10)
    one, critic = (estimate(shape, w, ENGINES["ddp"]) for w in (plain, Workload(**{**vars(plain), "trained_copies": 2})))
    assert (critic.parameters, critic.gradients, critic.optimizer) == (8000, 8000, 16000)  # fp32: 4 + 4 + 2 x 4 each
    assert (one.parameters, one.gradients, one.optimizer) == (4000, 4000, 8000)
    teacher = estimate(shape, Workload(**{**vars(plain), "teacher_logits": True}), ENGINES["ddp"])
    assert teacher.logits - one.logits == (2 * 10) * 50 * 4  # its completion rows (all: B x T x V) in fp32
