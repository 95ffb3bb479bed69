"""posttrain.plan: byte counts worked out by hand for a small known shape, parameter counts from a 7B config.json
(meta device, no weights), and the recommendation for that 7B model on 8 x 40 GB."""

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from posttrain.config.load import load_recipe
from posttrain.algorithms.dpo import DPOAlgoConfig
from posttrain.algorithms.grpo import GRPOAlgoConfig
from posttrain.config.schema import SFTAlgoConfig
from posttrain.errors import UserError
from posttrain.plan import parse_memory, run_plan
from posttrain.plan.estimate import ENGINES, ModelShape, Workload, estimate
from posttrain.plan.recommend import make_plan, splits

ROOT = Path(__file__).resolve().parents[2]

# 1000 parameters, 2 layers, h=8, 2 heads (head_dim 4), 1 kv head (kv=4), I=16, V=10
SHAPE = ModelShape(parameters=1000, trainable=1000, vocab_size=10, hidden_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, intermediate_size=16)
FP32 = Workload(algorithm="sft", sequences=2, sequence_length=4)  # 8 tokens, fp32 weights and activations
# activations: per token per layer 9h + 4kv + 4I = 72 + 16 + 64 = 152 elements; x 8 tokens x 4 B x 2 layers
# = 9728, + embeddings / final norm 3h x 8 tokens x 4 B = 768
ACTIVATIONS = 9728 + 768
# logits + their gradient 2 x 8 x 10 x 4 = 640, float32 log-softmax rows 2 x 8 x 10 x 4 = 640
LOGITS = 1280


def test_one_process_fp32_by_hand():
    b = estimate(SHAPE, FP32, ENGINES["ddp"], world_size=1)
    assert (b.parameters, b.gradients, b.optimizer) == (4000, 4000, 8000)  # 4 B each; AdamW's 2 moments
    assert b.gradient_buffers == 0 and b.gradients_in_forward == 0
    assert b.activations == ACTIVATIONS
    assert b.logits == LOGITS
    assert b.optimizer_step == 4000 and b.gathered == 0 and b.generation == 0
    # accumulation 1: the peak is the start of backward (activations, no .grad yet), not the optimizer step (8000)
    assert b.peak_bytes == 12000 + ACTIVATIONS + LOGITS


def test_accumulation_keeps_gradients_through_the_next_forward():
    w = Workload(algorithm="sft", sequences=2, sequence_length=4, accumulation=2)
    assert estimate(SHAPE, w, ENGINES["ddp"]).peak_bytes == 12000 + 4000 + ACTIVATIONS + LOGITS


def test_cpu_adamw_steps_tensor_by_tensor():
    w = Workload(algorithm="sft", sequences=2, sequence_length=4, foreach_optimizer=False)
    assert estimate(SHAPE, w, ENGINES["ddp"]).optimizer_step == 0


def test_ddp_keeps_a_bucket_copy_of_the_gradients():
    b = estimate(SHAPE, FP32, ENGINES["ddp"], world_size=2)
    assert (b.gradients, b.gradient_buffers) == (4000, 4000)


def test_zero3_shards_everything_and_gathers_two_layers():
    b = estimate(SHAPE, FP32, ENGINES["zero3"], world_size=4)
    assert (b.parameters, b.gradient_buffers, b.optimizer) == (1000, 1000, 2000)  # fp32: no master; 8000 / 4
    assert b.gradients == 0  # reduced into DeepSpeed's buffers at once
    assert b.gathered == 2 * 500 * 4  # two layers of 1000 / 2 parameters
    assert b.optimizer_step == 0  # DeepSpeed's fused step
    assert b.peak_bytes == 4000 + ACTIVATIONS + LOGITS + 4000


def test_zero2_bf16_master_copy():
    bf16 = Workload(algorithm="sft", sequences=2, sequence_length=4, compute_bytes=2, mixed_precision=True)
    b = estimate(SHAPE, bf16, ENGINES["zero2"], world_size=2)
    assert b.parameters == 2000  # 16-bit weights, whole
    assert b.gradient_buffers == 1000  # 16-bit, halved
    assert b.optimizer == 1000 * (8 + 4) // 2  # fp32 moments + fp32 master, halved
    assert b.logits == 2 * 8 * 10 * 2 + 640


def test_autocast_caches_16_bit_weight_copies_in_torch_engines_only():
    w = Workload(algorithm="sft", sequences=2, sequence_length=4, compute_bytes=2, mixed_precision=True)
    assert estimate(SHAPE, w, ENGINES["ddp"]).autocast_copies == 2000  # fp32 weights, bf16 copies
    assert estimate(SHAPE, w, ENGINES["zero2"], world_size=2).autocast_copies == 0  # DeepSpeed holds bf16 weights


def test_zero3_offload_moves_state_to_cpu():
    b = estimate(SHAPE, FP32, ENGINES["zero3_offload"], world_size=4)
    assert (b.parameters, b.gradient_buffers, b.optimizer) == (0, 0, 0)
    assert b.cpu_bytes == 1000 + 1000 + 2000


def test_gradient_checkpointing_keeps_layer_inputs_and_one_layer():
    w = Workload(algorithm="sft", sequences=2, sequence_length=4, gradient_checkpointing=True)
    # 8 B-elements per token per layer (h) x 8 tokens x 4 B x 2 layers + 768 + one layer recomputed (152 x 8 x 4)
    assert estimate(SHAPE, w, ENGINES["ddp"]).activations == 8 * 8 * 4 * 2 + 768 + 152 * 8 * 4


def test_generation_kv_cache_and_zero3_gathered_copy():
    w = Workload(algorithm="grpo", sequences=2, sequence_length=4, generation_sequences=4, generation_length=6)
    kv_cache = 2 * 2 * 4 * 6 * 4 * 4  # keys and values x layers x kv x length x sequences x 4 B
    last_logits = 4 * 10 * 4 * 2
    assert estimate(SHAPE, w, ENGINES["ddp"]).generation == kv_cache + last_logits
    assert estimate(SHAPE, w, ENGINES["zero3"], world_size=4).generation == kv_cache + last_logits + 4000 - 1000


def test_frozen_reference_copy_sharded_only_under_zero3():
    w = Workload(algorithm="dpo", sequences=2, sequence_length=4, frozen_copies=1)
    assert estimate(SHAPE, w, ENGINES["zero2"], world_size=4).frozen_copies == 4000
    assert estimate(SHAPE, w, ENGINES["zero3"], world_size=4).frozen_copies == 1000


def test_vllm_share_and_splits():
    w = Workload(algorithm="grpo", sequences=2, sequence_length=4, vllm_fraction=0.25)
    assert estimate(SHAPE, w, ENGINES["ddp"], gpu_bytes=8000).vllm == 2000
    assert splits(4, 2) == [(8, 1), (4, 2), (2, 4), (1, 8)]


def test_every_model_and_engine_the_run_holds_is_counted():
    """By hand on SHAPE (1000 parameters): the in-process vLLM engine on CPU (its float32 copy and KV cache), a
    16-bit reference beside float32 master weights, a teacher of another size, PPO's critic."""
    cpu_vllm = Workload(algorithm="grpo", sequences=2, sequence_length=4, vllm_weight_bytes=4, vllm_kv_cache_bytes=500)
    assert estimate(SHAPE, cpu_vllm, ENGINES["ddp"]).vllm == 4000 + 500
    assert estimate(SHAPE, cpu_vllm, ENGINES["ddp"], gpu_bytes=8000).vllm == 4500  # no GPU share asked for
    reference = Workload(algorithm="dpo", sequences=2, sequence_length=4, frozen_copies=1, frozen_weight_bytes=2)
    assert estimate(SHAPE, reference, ENGINES["ddp"]).frozen_copies == 2000  # bf16 beside float32 master weights
    teacher = Workload(algorithm="distill", sequences=2, sequence_length=4, frozen_parameters=3000,
                       teacher_logits=True)
    assert estimate(SHAPE, teacher, ENGINES["ddp"]).frozen_copies == 12000
    assert estimate(SHAPE, teacher, ENGINES["ddp"]).logits == LOGITS + 8 * 10 * 4  # its kept completion rows
    critic = estimate(SHAPE, Workload(algorithm="ppo", sequences=2, sequence_length=4, trained_copies=2),
                      ENGINES["ddp"])
    assert (critic.parameters, critic.gradients, critic.optimizer) == (8000, 8000, 16000)


def test_a_bf16_checkpoint_is_estimated_with_its_master_weights(tmp_path):
    from posttrain.plan.workload import workload_from_recipe

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_7B, "dtype": "bfloat16"}))
    common = [f"model.name_or_path={tmp_path}/", "data.train=rows.jsonl", "model.dtype=auto",
              "rewards=[{name: exact_match}]"]
    mixed = workload_from_recipe("dpo", load_recipe(None, common, DPOAlgoConfig))
    assert (mixed.weight_bytes, mixed.frozen_weight_bytes, mixed.compute_bytes, mixed.mixed_precision) == (4, 2, 2,
                                                                                                         True)
    pure = workload_from_recipe("dpo", load_recipe(None, [*common, "train.master_weights=false"], DPOAlgoConfig))
    assert (pure.weight_bytes, pure.frozen_weight_bytes) == (2, 2)
    vllm = workload_from_recipe("grpo", load_recipe(None, [*common, "generation.engine=vllm",
                                                           "generation.vllm.kv_cache_gb=1"], GRPOAlgoConfig),
                                on_gpu=False)
    assert (vllm.vllm_weight_bytes, vllm.vllm_kv_cache_bytes, vllm.generation_sequences) == (4, 2**30, 0)
    on_gpu = workload_from_recipe("grpo", load_recipe(None, [*common, "generation.engine=vllm",
                                                             "generation.vllm.gpu_memory_utilization=0.5"],
                                                      GRPOAlgoConfig))
    assert (on_gpu.vllm_fraction, on_gpu.vllm_weight_bytes) == (0.5, 0)


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("40GB") == 40 * 10**9
    assert parse_memory("24") == 24 * 2**30
    with pytest.raises(UserError, match="--gpu-memory"):
        parse_memory("lots")


# --- a 7B config.json, no weights -------------------------------------------------------------------------------------

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5)
H, I, L, V = 4096, 11008, 32, 32000
PARAMS_7B = 2 * V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H  # embeddings + lm_head, 32 blocks, final norm
LORA_7B = L * 16 * (4 * (H + H) + 3 * (H + I))  # r=16 on q, k, v, o (h -> h) and gate, up, down (h <-> I)


@pytest.fixture(scope="module")
def config_7b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama7b")
    (path / "config.json").write_text(json.dumps(LLAMA_7B))
    return path


def _recipe(path, *more):
    return load_recipe(None, [f"model.name_or_path={path}/", "data.train=rows.jsonl", "model.dtype=bfloat16", "train.mixed_precision=bf16",
                              "data.max_length=2048", "train.per_device_train_batch_size=4",
                              "train.gradient_accumulation_steps=4", "train.gradient_checkpointing=true", *more],
                       SFTAlgoConfig)


def test_7b_counts_from_config_json(config_7b):
    from posttrain.plan.shape import model_shape

    recipe = _recipe(config_7b)
    shape = model_shape(recipe.model)
    assert shape.parameters == PARAMS_7B == 6_738_415_616
    assert shape.trainable == PARAMS_7B
    assert shape.largest_layer == 4 * H * H + 3 * H * I + 2 * H
    lora = model_shape(_recipe(config_7b, "model.lora.enabled=true").model)
    assert lora.trainable == LORA_7B
    assert lora.parameters == PARAMS_7B + LORA_7B


def test_7b_on_8x40gb_ddp_does_not_fit_zero3_does(config_7b):
    from posttrain.plan.shape import model_shape
    from posttrain.plan.workload import workload_from_recipe

    recipe = _recipe(config_7b)
    shape = model_shape(recipe.model)
    plan = make_plan(shape, functools.partial(workload_from_recipe, "sft", recipe), 4, 4, gpus=8,
                     gpu_bytes=40 * 10**9)
    table = {o.engine.name: o for o in plan.at_recipe_batch}
    # DDP on a bf16 checkpoint: float32 master weights + gradients (+ bucket copy) + AdamW moments are
    # 4+8+8 = 20 B x 6.7B = 135 GB (distributed/precision.py)
    assert not table["ddp"].fits and table["ddp"].breakdown.parameters == 4 * PARAMS_7B
    assert table["zero3"].fits
    assert table["zero3"].breakdown.optimizer == -(-PARAMS_7B * 12 // 8)
    assert plan.recommended is not None and plan.recommended.fits
    assert plan.recommended.per_device_batch * plan.recommended.accumulation == 16  # the global batch is kept
    text = run_plan("sft", recipe, "r.yaml", [], 8, 1, "40GB", as_json=False)
    assert f"accelerate launch --config_file {ROOT}/recipes/accelerate/" in text and "--num_processes 8" in text
    assert f"--config {Path('r.yaml').resolve()}" in text  # absolute: the command runs from any directory


def test_nothing_fits_says_what_would(config_7b):
    recipe = _recipe(config_7b)
    # 2 GiB: even ZeRO-3 with everything offloaded cannot hold two gathered 16-bit layers (2 x 0.4 GB) + activations
    out = json.loads(run_plan("sft", recipe, None, [], 1, 1, "2GiB", as_json=True))
    assert out["recommended"] is None and out["suggestions"]
    assert all(not e["fits"] for e in out["engines"])


def test_the_algorithm_is_told_by_the_recipe():
    from posttrain.plan import infer_algorithm

    for name in ("sft", "dpo", "grpo", "rm"):
        assert infer_algorithm(str(RECIPES / f"{name}.yaml"), []) == name
    with pytest.raises(UserError, match="--algorithm"):
        infer_algorithm(None, ["algo.beta=0.1"])  # dpo and grpo both have beta


def test_bad_launch_shape_is_a_user_error(config_7b):
    with pytest.raises(UserError, match="--gpus"):
        run_plan("sft", _recipe(config_7b), None, [], 3, 2, "80GiB", as_json=False)
    with pytest.raises(UserError, match="'0GiB' is no memory at all"):  # it planned on, "nothing fits"
        run_plan("sft", _recipe(config_7b), None, [], 1, 1, "0GiB", as_json=False)


@pytest.mark.parametrize("shape, message", [
    ("train.max_tokens_per_microbatch=3", "train.max_tokens_per_microbatch=3 is below data.max_length = 2048"),
    ("data.max_length=99999999", "the model holds 4,096 positions"),
])
def test_what_a_run_refuses_the_plan_refuses(config_7b, shape, message):
    """The plan recommended a command (data.max_length cut to fit memory, or the budget kept) that exits 2 at once."""
    with pytest.raises(UserError, match=message):
        run_plan("sft", _recipe(config_7b, shape), None, [], 1, 1, "80GiB", as_json=False)


def test_fused_output_layer_never_makes_the_logits():
    import dataclasses

    fused = dataclasses.replace(SHAPE, fused_head=True)
    w = Workload(algorithm="sft", sequences=2, sequence_length=4, logprobs_only=True)
    assert estimate(fused, w, ENGINES["ddp"]).logits == 2 * 8 * 10 * 4  # one float32 chunk (all 8 rows) and its work
    assert estimate(SHAPE, w, ENGINES["ddp"]).logits == LOGITS  # a head that cannot be fused: the logits path


def test_a_token_budget_bounds_the_micro_batch_the_estimate_sees():
    from posttrain.algorithms.dpo import DPOAlgoConfig
    from posttrain.plan.workload import workload_from_recipe

    base = ["data.train=a.jsonl", "data.max_length=1024", "train.per_device_train_batch_size=8",
            "train.gradient_accumulation_steps=2"]
    padded = workload_from_recipe("dpo", load_recipe(None, base, DPOAlgoConfig))
    budget = workload_from_recipe("dpo", load_recipe(None, [*base, "train.max_tokens_per_microbatch=4096"],
                                                     DPOAlgoConfig))
    assert (padded.sequences, padded.sequence_length, padded.accumulation) == (16, 1024, 2)
    # 2 x 16 rows x 1024 tokens in micro-batches of 4,096 tokens: 4 rows each, 8 of them
    assert (budget.sequences, budget.sequence_length, budget.accumulation) == (4, 1024, 8)
    assert estimate(SHAPE, budget, ENGINES["ddp"]).activations < estimate(SHAPE, padded, ENGINES["ddp"]).activations


def test_32k_tokens_of_a_7b_model_need_sequence_parallelism(tmp_path):
    """One 32k-token row of the 7B model keeps ~540 GB of bf16 activations: no engine fits it on an 80 GiB GPU; split
    over N ranks it does. The plan names N, the keys to set, and a token budget."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_7B, "max_position_embeddings": 131072}))  # 32k fits
    recipe = _recipe(tmp_path, "data.max_length=32768", "train.per_device_train_batch_size=1",
                     "train.gradient_checkpointing=false", "data.packing=true")
    out = json.loads(run_plan("sft", recipe, None, [], 8, 1, "80GiB", as_json=True))
    assert not any(e["fits"] for e in out["engines"])
    chosen = out["recommended"]
    assert chosen["sequence_parallel_size"] in (2, 4, 8) and chosen["engine"] != "fsdp2"
    assert f"train.sequence_parallel_size={chosen['sequence_parallel_size']}" in out["command"]
    assert "data.packing=false" in out["command"]  # sequence parallelism refuses packed rows
    assert out["token_budget"]["max_tokens_per_microbatch"] >= 32768 and not out["token_budget"]["packing"]
    # the other way: gradient checkpointing, each layer keeps its input (h), one layer is recomputed whole
    # (9h + 4kv + 4I), embeddings / norm 3h: bf16, per row of 32k tokens
    instead = out["gradient_checkpointing_instead"]
    per_token = H * L + 3 * H + 9 * H + 4 * H + 4 * I
    assert instead["sequence_parallel_size"] == 1
    assert instead["breakdown"]["activations"] == instead["per_device_train_batch_size"] * 32768 * per_token * 2
    text = run_plan("sft", recipe, None, [], 8, 1, "80GiB", as_json=False)
    assert "one sequence's activations do not fit one GPU" in text and "train.max_tokens_per_microbatch=" in text


def test_the_recipes_token_budget_is_planned_and_its_split_kept(config_7b):
    """A budget of 8,192 packed tokens cuts 4 x 4 rows of 2,048 into micro-batches of 4 rows whatever the split: the
    table costs that micro-batch (checkpointed, bf16), the recommendation keeps the recipe's 4 x 4."""
    from posttrain.plan.shape import model_shape
    from posttrain.plan.workload import workload_from_recipe

    recipe = _recipe(config_7b, "data.packing=true", "train.max_tokens_per_microbatch=8192")
    shape = model_shape(recipe.model)
    plan = make_plan(shape, functools.partial(workload_from_recipe, "sft", recipe), 4, 4, gpus=8, gpu_bytes=80 * 2**30)
    per_token = H * L + 3 * H + 9 * H + 4 * H + 4 * I  # checkpointed layer inputs, embeddings, one layer recomputed
    assert all(o.breakdown.activations == 8192 * per_token * 2 for o in plan.at_recipe_batch)
    assert (plan.recommended.per_device_batch, plan.recommended.accumulation) == (4, 4)


def test_lean_activations_are_planned_where_the_run_keeps_fewer():
    """models/lean_activations.py drops silu(gate) and the product (2I) and each norm's normalised input (2h) per
    token and layer: 9h + 4kv + 4I - 2I - 2h = 56 + 16 + 32 = 104 elements; the recomputed layer under checkpointing
    runs without it (152). The kinds come from transformers' own classes of the model type."""
    import dataclasses

    from transformers import AutoConfig

    from posttrain.models.lean_activations import lean_kinds

    lean = dataclasses.replace(SHAPE, lean=frozenset({"mlp", "norm"}))
    assert estimate(lean, FP32, ENGINES["ddp"]).activations == 104 * 8 * 4 * 2 + 768
    checkpointed = dataclasses.replace(FP32, gradient_checkpointing=True)
    assert estimate(lean, checkpointed, ENGINES["ddp"]).activations == 8 * 8 * 4 * 2 + 768 + 152 * 8 * 4
    assert lean_kinds(AutoConfig.for_model("llama")) == {"mlp", "norm"}
    assert lean_kinds(AutoConfig.for_model("gpt2")) == frozenset()  # its MLP and LayerNorm: every activation kept


def test_online_fused_head_scores_the_completion_rows_only(config_7b):
    """GRPO's surrogate takes log-probs and entropy from the fused head over the rows that predict a completion
    token: the planned chunk is per_device rows x max_completion_length, not the prompts; under sequence parallelism
    the logits are gathered (no fused chunk)."""
    from posttrain.plan.workload import workload_from_recipe

    recipe = load_recipe(None, [f"model.name_or_path={config_7b}/", "data.train=rows.jsonl",
                                "train.per_device_train_batch_size=8", "algo.num_generations=4",
                                "generation.max_completion_length=32", "data.max_prompt_length=512",
                                "rewards=[{name: length}]"], GRPOAlgoConfig)
    w = workload_from_recipe("grpo", recipe)
    assert w.logprobs_only and w.scored_tokens == w.sequences * 32
    sp = workload_from_recipe("grpo", recipe, sequence_parallel=2)
    assert not sp.logprobs_only and sp.scored_tokens == 0


def test_a_vision_towers_activations_by_hand():
    """2 rows of 16 tokens, 10 of them image tokens (the largest image; told 20: at most the row, 16), 4 patches a
    token: 80 patches through 3 blocks of width 4, MLP 8: a block keeps 13 x 4 + 4 x 8 = 84 elements a patch, in
    bf16 (2 bytes). Trained: every block's; checkpointed: each block's input (4) and one block; frozen: one block."""
    from posttrain.plan.estimate import VisionShape, vision_activation_bytes

    tower = VisionShape(width=4, intermediate=8, depth=3, patches=4, trains=True, largest_image=10)
    shape = dataclasses.replace(SHAPE, vision=tower)
    w = Workload(algorithm="sft", sequences=2, sequence_length=16, compute_bytes=2)
    assert vision_activation_bytes(shape, w) == 80 * 3 * 84 * 2
    assert vision_activation_bytes(shape, dataclasses.replace(w, gradient_checkpointing=True)) == 80 * (3 * 4 + 84) * 2
    frozen = dataclasses.replace(shape, vision=dataclasses.replace(tower, trains=False))
    assert vision_activation_bytes(frozen, w) == 80 * 84 * 2
    assert vision_activation_bytes(shape, dataclasses.replace(w, image_tokens=20)) == 2 * 16 * 4 * 3 * 84 * 2
    assert vision_activation_bytes(SHAPE, w) == 0  # a text model
    text = estimate(SHAPE, w, ENGINES["ddp"]).activations
    assert estimate(shape, w, ENGINES["ddp"]).activations == text + 80 * 3 * 84 * 2
