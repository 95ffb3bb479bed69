"""posttrain.plan with packed, token-budget and sequence-parallel micro-batches: the tokens a micro-batch holds and
the bytes they cost per rank, worked out by hand on the small shape of test_plan_estimate.py; the SP degree and the
token budget the recommender picks."""

import dataclasses
import functools

import pytest

from posttrain.plan.estimate import ENGINES, ModelShape, Workload, estimate
from posttrain.plan.recommend import USABLE_FRACTION, largest_budget, make_plan, sequence_parallel_degrees
from posttrain.plan.workload import with_tokens

# 1000 parameters, 2 layers, h=8, 2 heads (head_dim 4), 1 kv head (kv=4), I=16, V=10
SHAPE = ModelShape(parameters=1000, trainable=1000, vocab_size=10, hidden_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, intermediate_size=16)
PER_TOKEN = (152 * 2 + 3 * 8) * 4  # 152 elements per layer (9h + 4kv + 4I) x 2 layers + embeddings / norm (3h), fp32


def rows(sequences, length, accumulation=1, **more):
    return Workload(algorithm="sft", sequences=sequences, sequence_length=length, accumulation=accumulation, **more)


def test_padded_rows_cost_their_longest_packed_rows_their_real_tokens():
    """4 rows of up to 8 tokens, 3 on average: padded 4 x 8 = 32 tokens; packed 12 real tokens laid in rows of 8:
    2 rows = 16."""
    padded = with_tokens(rows(4, 8), 1, 3, packed=False, budget=None)
    packed = with_tokens(rows(4, 8), 1, 3, packed=True, budget=None)
    assert (padded.tokens, padded.real_tokens) == (32, 12)
    assert (packed.tokens, packed.real_tokens) == (16, 12)
    assert estimate(SHAPE, packed, ENGINES["ddp"]).activations == 16 * PER_TOKEN
    assert estimate(SHAPE, padded, ENGINES["ddp"]).activations == 32 * PER_TOKEN
    full = with_tokens(rows(4, 8), 1, None, packed=True, budget=None)  # no mean given: every row full
    assert full.tokens == 32


def test_a_token_budget_bounds_packed_tokens_whatever_the_data():
    """8 rows a step (4 x accumulation 2) of up to 8 tokens, mean 3, budget 10: a packed micro-batch holds at most
    10 real tokens, in ceil(10 / 8) = 2 rows of 8; the step's 24 real tokens take ceil(24 / 10) = 3 micro-batches.
    Padded, 10 // 3 = 3 rows fit the budget, each as wide as the longest (8): 24 tokens, 9 of them real."""
    packed = with_tokens(rows(4, 8, accumulation=2), 1, 3, packed=True, budget=10)
    assert (packed.tokens, packed.real_tokens, packed.accumulation) == (16, 10, 3)
    padded = with_tokens(rows(4, 8, accumulation=2), 1, 3, packed=False, budget=10)
    assert (padded.sequences, padded.tokens, padded.real_tokens) == (3, 24, 9)
    pairs = with_tokens(rows(4, 8, accumulation=2), 2, 3, packed=False, budget=10)  # units of 2 rows: 10 // 6 = 1
    assert (pairs.sequences, pairs.tokens) == (2, 16)
    whole_step = with_tokens(rows(4, 8, accumulation=2), 1, 3, packed=True, budget=1000)  # at most 8 rows x 8
    assert (whole_step.tokens, whole_step.accumulation) == (64, 1)


def test_sequence_parallel_shards_tokens_but_not_replicated_kv_heads():
    """2 rows x 4 tokens over 2 ranks: each holds 4 tokens. The model has 1 kv head for 2 ranks, so DeepSpeed
    replicates it: each rank keeps k and v of the whole head over all 8 tokens (2 x 4 x 8 = 64 elements a layer)
    where its half share counted 2 x kv x 8 / 2 = 32: 32 elements more per layer."""
    w = rows(2, 4, sequence_parallel=2)
    replicated = 32 * 2 * 4  # elements x layers x fp32
    assert estimate(SHAPE, w, ENGINES["ddp"]).activations == 4 * PER_TOKEN + replicated
    enough_kv = dataclasses.replace(SHAPE, num_kv_heads=2)  # 2 kv heads (kv=8): no replication
    per_token = ((9 * 8 + 4 * 8 + 4 * 16) * 2 + 3 * 8) * 4
    assert estimate(enough_kv, w, ENGINES["ddp"]).activations == 4 * per_token
    odd = rows(1, 7, sequence_parallel=2)  # 7 tokens: the row is padded to 8, 4 a rank
    assert estimate(enough_kv, odd, ENGINES["ddp"]).activations == 4 * per_token


def test_sequence_parallel_logits_and_eager_scores():
    """Log-probs are taken on each rank's shard (4 of 8 tokens: logits + gradient 2 x 4 x 10 x 4 B, float32 work rows
    as many); a loss that needs the logits gathers all 8 tokens' on every rank. Eager attention keeps each rank's
    heads (2 / 2 = 1) over whole rows: 2 layers x 2 rows x 1 head x 4^2 x 4 B."""
    shard = rows(2, 4, sequence_parallel=2, logprobs_only=True)
    assert estimate(SHAPE, shard, ENGINES["ddp"]).logits == 2 * 4 * 10 * 4 + 2 * 4 * 10 * 4
    gathered = rows(2, 4, sequence_parallel=2)
    assert estimate(SHAPE, gathered, ENGINES["ddp"]).logits == 2 * 8 * 10 * 4 + 2 * 8 * 10 * 4
    eager = dataclasses.replace(gathered, eager_attention=True)
    scores = estimate(SHAPE, eager, ENGINES["ddp"]).activations - estimate(SHAPE, gathered, ENGINES["ddp"]).activations
    assert scores == 2 * 2 * 1 * 16 * 4


def test_sequence_parallel_under_gradient_checkpointing():
    """Checkpointed: each layer keeps its input (h = 8 elements a local token), one layer is recomputed whole, and
    that one layer keeps the replicated kv head (32 elements, see above); embeddings / norm 3h."""
    w = rows(2, 4, sequence_parallel=2, gradient_checkpointing=True)
    assert estimate(SHAPE, w, ENGINES["ddp"]).activations == (8 * 4 * 2 + 3 * 8 * 4 + 152 * 4 + 32) * 4


def test_degrees_divide_the_gpus_and_the_heads():
    qwen3_8b = dataclasses.replace(SHAPE, num_heads=32, num_kv_heads=8)
    assert sequence_parallel_degrees(qwen3_8b, 8) == [2, 4, 8]
    qwen25_05b = dataclasses.replace(SHAPE, num_heads=14, num_kv_heads=2)  # 14 heads: only 2 divides them
    assert sequence_parallel_degrees(qwen25_05b, 8) == [2]
    gqa = dataclasses.replace(SHAPE, num_heads=24, num_kv_heads=8)  # 3 ranks: 8 kv heads and 3 divide neither way
    assert sequence_parallel_degrees(gqa, 6) == [2]


def _workload_for(algorithm, length=4096, recipe_sp=1):
    """A pure stand-in for workload_from_recipe: one row of `length` per micro-batch, 4 micro-batches a step."""
    def workload_for(batch, max_length=None, *, sequence_parallel=None, budget=None):
        w = Workload(algorithm=algorithm, sequences=batch, sequence_length=length, accumulation=4 // batch,
                     sequence_parallel=sequence_parallel or recipe_sp)
        packed = w.sequence_parallel == 1
        return with_tokens(w, 1, None, packed, budget) if budget is not None else w
    return workload_for


def test_the_least_sequence_parallel_degree_that_fits_is_recommended():
    """One 4,096-token row does not fit a device at SP=1 under any engine, fits at SP=2: recommended, on an engine
    that runs SP (not FSDP). DPO does not run sequence-parallel: nothing is recommended for it."""
    gpu = int(estimate(SHAPE, rows(1, 4096, sequence_parallel=2), ENGINES["ddp"], 2).peak_bytes / USABLE_FRACTION) + 1
    assert not any(o.fits for o in make_plan(SHAPE, _workload_for("sft"), 1, 4, 2, gpu).at_recipe_batch)
    plan = make_plan(SHAPE, _workload_for("sft"), 1, 4, 2, gpu, shortest_budget=4096)
    assert plan.recommended.sequence_parallel == 2 and plan.recommended.engine.sequence_parallel
    assert plan.token_budget[0] == 4096  # padded under SP: one row a micro-batch, no more
    assert make_plan(SHAPE, _workload_for("dpo"), 1, 4, 2, gpu).recommended is None


def test_fsdp_never_fits_a_sequence_parallel_recipe():
    plan = make_plan(SHAPE, _workload_for("sft", recipe_sp=2), 1, 4, 2, 10**9)
    assert {o.engine.name for o in plan.at_recipe_batch if not o.fits} == {"fsdp2"}
    assert plan.recommended.engine.name == "ddp" and plan.recommended.sequence_parallel == 2


def test_the_largest_token_budget_that_fits():
    """Packed rows of 16 tokens: a budget B costs ceil(B / 16) x 16 tokens. The device holds 48 tokens' worth: the
    largest budget is 48 (49 would take a fourth row); all 64 of the step's tokens fit a bigger device."""
    workload_for = _workload_for("sft", length=16)
    option = make_plan(SHAPE, workload_for, 1, 4, 1, 10**9).recommended
    at = lambda budget: estimate(SHAPE, workload_for(1, budget=budget), ENGINES["ddp"]).peak_bytes  # noqa: E731
    assert (workload_for(1, budget=48).tokens, workload_for(1, budget=49).tokens) == (48, 64)
    gpu = int(at(48) / USABLE_FRACTION) + 1
    assert largest_budget(SHAPE, workload_for, option, 1, 1, gpu, shortest=16)[0] == 48
    assert largest_budget(SHAPE, workload_for, option, 1, 1, 10**9, shortest=16)[0] == 64
    assert largest_budget(SHAPE, workload_for, option, 1, 1, int(at(16) * 0.5), shortest=16) is None


@pytest.mark.parametrize("mean", [0, -5])
def test_a_mean_length_below_one_is_refused(mean):
    from posttrain.errors import UserError
    from posttrain.plan import run_plan

    with pytest.raises(UserError, match="--mean-length"):
        run_plan("sft", None, None, [], 1, 1, "80GiB", False, mean_length=mean)
