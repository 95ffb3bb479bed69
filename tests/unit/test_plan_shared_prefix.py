"""posttrain plan with shared prefixes (train.shared_prefix): a GRPO micro-batch forwards each prompt once per group
plus its completions, and its 4-D mask costs a copy per attention layer; worked out by hand on the small shape of
test_plan_estimate.py, read from a recipe on the session's tiny model, and the larger micro-batch the recommender then
picks. bench/plan_accuracy.py checks the figures against a measured run (tests/integration/test_plan_accuracy.py)."""

import functools

from posttrain.algorithms.grpo import GRPOAlgoConfig
from posttrain.config.load import load_recipe
from posttrain.plan.estimate import ENGINES, ModelShape, Workload, estimate
from posttrain.plan.recommend import USABLE_FRACTION, make_plan
from posttrain.plan.shape import model_shape
from posttrain.plan.workload import prompt_groups, shared_layout, workload_from_recipe

# 1000 parameters, 2 layers, h=8, 2 heads (head_dim 4), 1 kv head (kv=4), I=16, V=10
SHAPE = ModelShape(parameters=1000, trainable=1000, vocab_size=10, hidden_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, intermediate_size=16)
PER_TOKEN = (152 * 2 + 3 * 8) * 4  # 152 elements per layer (9h + 4kv + 4I) x 2 layers + embeddings / norm (3h), fp32


def test_a_micro_batch_holds_the_groups_the_source_cuts():
    """The source cuts a step's rows (G a prompt, in order) into consecutive micro-batches: 3 rows of G = 2 hold
    2 + 1, then 1 + 2 rows of two prompts; 8 rows of G = 4, two whole groups; 2 rows of G = 8, one group's two."""
    assert prompt_groups(3, 2, 6) == [2, 1]
    assert prompt_groups(8, 4, 16) == [4, 4]
    assert prompt_groups(2, 8, 16) == [2]
    assert prompt_groups(4, 3, 12) == [3, 1]  # [0, 4): 3 + 1; [4, 8): 2 + 2; [8, 12): 1 + 3


def test_shared_layout_and_its_mask_by_hand():
    """Two groups of 4 rows, prompt 6, completions 2: each group one row of 6 + 4 x 2 = 14 tokens (the plain layout:
    8 rows x 8 = 64); the mask 2 x 14^2 entries, 1 B each plus a float32 copy in each of the 2 layers. At half the
    full length on average, the groups (7 tokens each) share one row of 14."""
    assert shared_layout([4, 4], 6, 2, 1.0) == (28, 28, 2 * 14 * 14)
    assert shared_layout([4, 4], 6, 2, 0.5) == (14, 14, 14 * 14)
    w = Workload(algorithm="grpo", sequences=8, sequence_length=8, tokens=28, mask_elements=2 * 14 * 14)
    assert estimate(SHAPE, w, ENGINES["ddp"]).activations == 28 * PER_TOKEN + 392 * (1 + 2 * 4)


def grpo_recipe(model_dir, *more):
    return load_recipe(None, [f"model.name_or_path={model_dir}", "data.train=rows.jsonl", "rewards=[{name: length}]",
                              "train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=2",
                              "algo.num_generations=4", "data.max_prompt_length=16",
                              "generation.max_completion_length=8", *more], GRPOAlgoConfig)


def test_a_grpo_workload_counts_each_prompt_once(tiny_model_dir):
    """8 completions a micro-batch, 4 a prompt, prompts of 16, completions of 8: 2 x (16 + 4 x 8) = 96 tokens
    forwarded with shared prefixes, 8 x 24 = 192 without (train.shared_prefix=false, or eager attention, which
    cannot take the mask), and the mask 2 rows x 48^2."""
    shared = workload_from_recipe("grpo", grpo_recipe(tiny_model_dir))
    assert (shared.tokens, shared.real_tokens, shared.mask_elements, shared.sequences) == (96, 96, 2 * 48 * 48, 8)
    assert shared.scored_tokens == 8 * 8  # every completion token still reaches the output layer
    for off in ("train.shared_prefix=false", "model.attn_implementation=eager"):
        plain = workload_from_recipe("grpo", grpo_recipe(tiny_model_dir, off))
        assert (plain.tokens, plain.mask_elements) == (192, 0), off
    # a budget of 40 tokens holds runs of (40 - 16) // 8 = 3 rows of a group (16 + 3 x 8 = 40), one a micro-batch;
    # a step's 4 groups of 2 runs (3 + 1 rows: 40 + 24 tokens) take ceil(4 x 64 / 40) = 7 micro-batches
    budget = workload_from_recipe("grpo", grpo_recipe(tiny_model_dir, "train.max_tokens_per_microbatch=40"))
    assert (budget.tokens, budget.sequences, budget.mask_elements, budget.accumulation) == (40, 3, 40 * 40, 7)


def test_the_plan_recommends_the_larger_micro_batch_that_sharing_fits(tiny_model_dir):
    """On a device just large enough for 16 completions a micro-batch with each prompt forwarded once, the plan keeps
    the recipe's 16 x 1 with sharing; without it, the same device takes 8 x 2. A micro-batch of one row per prompt
    shares nothing, and is planned as the plain one (no mask)."""
    def planned(*more):
        recipe = grpo_recipe(tiny_model_dir, "train.per_device_train_batch_size=16",
                             "train.gradient_accumulation_steps=1", "data.max_prompt_length=256",
                             "generation.max_completion_length=32", *more)
        return model_shape(recipe.model, "causal_lm"), functools.partial(workload_from_recipe, "grpo", recipe)

    shape, shared_for = planned()
    gpu_bytes = int(estimate(shape, shared_for(16), ENGINES["ddp"]).peak_bytes / USABLE_FRACTION) + 1
    shared = make_plan(shape, shared_for, 16, 1, 1, gpu_bytes)
    _, plain_for = planned("train.shared_prefix=false")
    plain = make_plan(shape, plain_for, 16, 1, 1, gpu_bytes)
    assert (shared.recommended.engine.name, shared.recommended.per_device_batch) == ("ddp", 16)
    assert (plain.recommended.per_device_batch, plain.recommended.accumulation) == (8, 2)
    assert estimate(shape, plain_for(16), ENGINES["ddp"]).peak_bytes > USABLE_FRACTION * gpu_bytes
    assert shared_for(1) == plain_for(1)
