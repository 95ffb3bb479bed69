"""Per-device peak memory of a training run, from the model's shape and the recipe's numbers: pure arithmetic.

    shape = ModelShape(parameters=..., trainable=..., vocab_size=..., hidden_size=..., ...)   # plan/shape.py reads it
    workload = Workload(algorithm="dpo", sequences=16, sequence_length=512, ...)             # plan/workload.py
    breakdown = estimate(shape, workload, ENGINES["zero3"], world_size=8)
    breakdown.peak_bytes, breakdown.parts()                     # where the bytes go, per device

Peak = persistent bytes + the largest of three phases that never overlap (training, the optimizer step, generation;
`Breakdown` sums them); docs/planning.md has the table, part by part.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

GIB = 2**30
LOGPROB_CHUNK = 1024  # rows of ops.logprobs.token_logprobs' float32 log-softmax work (its chunk_size)
LINEAR_CHUNK = 2**25  # logits elements per chunk of ops.logprobs.linear_token_logprobs (LINEAR_CHUNK_ELEMENTS)


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's encoder, for its activations: each image token is `patches` patches, each through
    `depth` blocks of `width` (MLP `intermediate`)."""

    width: int
    intermediate: int
    depth: int
    patches: int
    """Patches per image token (Qwen-VL's merger joins spatial_merge_size^2; a CLIP tower's projector 1)."""
    trains: bool
    """Its parameters get gradients: autograd keeps its activations (a frozen tower's forward keeps none)."""
    largest_image: int = 0
    """Image tokens of the largest image the processor makes (0: unknown): a row's image tokens unless told."""


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, read from config.json (see plan/shape.py)."""

    parameters: int
    """All parameters, tied weights once."""
    trainable: int
    """Parameters that get gradients and optimizer state (LoRA: adapters, plus a classifier head)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    largest_layer: int = 0
    """Parameters of the largest decoder layer (what ZeRO-3 / FSDP2 gathers at once); 0: parameters / layers."""
    fused_head: bool = False
    """The output layer can be fused with the log-softmax (algorithms.forward.FUSED_HEAD_MODELS)."""
    lean: frozenset = frozenset()
    """Which of the model's modules ('mlp', 'norm') keep fewer activations while it trains
    (models/lean_activations.py)."""
    vision: Optional[VisionShape] = None
    """A vision-language model's encoder (None: a text model)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        return self.largest_layer or self.parameters // max(1, self.num_layers)


@dataclass(frozen=True)
class Workload:
    """One device's share of a step, from the recipe (see plan/workload.py)."""

    algorithm: str
    sequences: int
    """Rows per micro-batch through the policy (DPO: 2 x pairs; GRPO: completions)."""
    sequence_length: int
    """Tokens of the longest row (a padded micro-batch's width; a packed row's length)."""
    tokens: int = 0
    """Tokens one micro-batch's forward holds (0: sequences x sequence_length, every row padded to full length). A
    padded micro-batch holds rows x its longest row; a packed one its rows' real tokens, laid in rows of the longest
    row's length (plan/workload.py counts them)."""
    real_tokens: int = 0
    """Of `tokens`, those of the data (not padding or packing filler); 0: all of them."""
    token_budget: Optional[int] = None
    """train.max_tokens_per_microbatch that cut the step into these micro-batches (None: rows cut it)."""
    mask_elements: int = 0
    """Entries of the 4-D attention mask the forward takes (train.shared_prefix: packed rows x width^2; 0: causal
    attention, no mask). SDPA turns the boolean mask into the compute dtype in every attention layer, and each layer
    keeps its copy for the backward (plan/workload.py counts the rows)."""
    sequence_parallel: int = 1
    """train.sequence_parallel_size: N ranks each hold 1/N of every sequence's tokens (DeepSpeed Ulysses)."""
    image_tokens: Optional[int] = None
    """A vision-language model's image tokens per row (of sequence_length; None: the largest image the processor
    makes, at most the row)."""
    weight_bytes: int = 4
    """Bytes per stored weight (model.dtype)."""
    compute_bytes: int = 4
    """Bytes per activation (2 under bf16/fp16 autocast or bf16 weights)."""
    mixed_precision: bool = False
    """train.mixed_precision is bf16/fp16 (DeepSpeed then keeps an fp32 master copy)."""
    accumulation: int = 1
    """gradient_accumulation_steps: above 1, gradients live through the later micro-batches' forwards."""
    foreach_optimizer: bool = True
    """torch AdamW's foreach step (its default on GPU when train.fused_optimizer is off; on CPU it steps one tensor
    at a time; the fused step makes no temporaries)."""
    gradient_checkpointing: bool = False
    frozen_copies: int = 0
    """Frozen full models kept besides the policy (DPO / GRPO reference, reward model)."""
    lm_head: bool = True
    """False for a sequence classifier (RM): no B x T x V logits."""
    logprobs_only: bool = False
    """The loss needs log-probs only (SFT, DPO, GRPO / PPO's surrogate): a fusable head then never makes the logits."""
    scored_tokens: int = 0
    """Tokens the fused output layer projects: GRPO / PPO score only the rows that predict a completion token
    (models/forward.policy_logprobs_entropy); 0: every token this rank holds."""
    eager_attention: bool = False
    """attn_implementation=eager materialises B x heads x T x T scores; sdpa / flash do not."""
    generation_sequences: int = 0
    """Sequences in one generate call (prompts per call x num_generations); 0: no generation."""
    generation_length: int = 0
    """Prompt + completion tokens of a generated sequence."""
    vllm_fraction: float = 0.0
    """Share of the GPU a colocated vLLM reserves (gpu_memory_utilization): its weights and KV cache; 0: none."""
    vllm_weight_bytes: int = 0
    """An in-process vLLM engine on CPU: bytes per weight of its own copy of the policy (0: no such engine)."""
    vllm_kv_cache_bytes: int = 0
    """An in-process vLLM engine on CPU: its KV cache (generation.vllm.kv_cache_gb, else its share of the RAM)."""
    frozen_weight_bytes: int = 0
    """Bytes per weight of the frozen copies (model.dtype as loaded; 0: weight_bytes). A 16-bit checkpoint trains
    float32 master weights (weight_bytes 4) beside a 16-bit reference."""
    frozen_parameters: int = 0
    """Frozen parameters of models of another size than the policy (a distillation teacher)."""
    trained_copies: int = 1
    """Models trained at the policy's size: 2 with PPO's critic (its weights, gradients and AdamW state)."""
    teacher_logits: bool = False
    """A local distillation teacher: the logits of its completion rows, which the loss keeps for backward
    (losses/distill.py), live beside the student's. Its output layer projects only those rows (Role.logits_at), and
    where a head cannot, its whole logits exist only during its no-grad forward, before the student's activations."""


@dataclass(frozen=True)
class Engine:
    name: str
    zero_stage: int = 0
    """0: DDP / one process; 1, 2, 3: DeepSpeed ZeRO; FSDP2 shards like stage 3."""
    fsdp: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    accelerate_config: Optional[str] = None
    """recipes/accelerate/<name>.yaml that launches it (None: torchrun)."""
    sequence_parallel: bool = True
    """Runs train.sequence_parallel_size > 1 (DDP and DeepSpeed ZeRO do; FSDP does not)."""

    @property
    def shards_parameters(self) -> bool:
        return self.fsdp or self.zero_stage == 3


# Fastest first: less sharding means fewer collectives, offload means PCIe traffic every step.
ENGINES: dict[str, Engine] = {
    "ddp": Engine("ddp"),
    "zero1": Engine("zero1", zero_stage=1, accelerate_config="zero1"),
    "zero2": Engine("zero2", zero_stage=2, accelerate_config="zero2"),
    "fsdp2": Engine("fsdp2", fsdp=True, accelerate_config="fsdp2", sequence_parallel=False),
    "zero3": Engine("zero3", zero_stage=3, accelerate_config="zero3"),
    "zero2_offload": Engine("zero2_offload", zero_stage=2, offload_optimizer=True, accelerate_config="zero2_offload"),
    "zero3_offload": Engine("zero3_offload", zero_stage=3, offload_optimizer=True, offload_param=True,
                            accelerate_config="zero3_offload"),
}


@dataclass(frozen=True)
class Breakdown:
    """Bytes per device, by what holds them. `peak_bytes` = persistent + the largest transient phase."""

    parameters: int
    gradients: int
    """The parameters' .grad (torch engines): from backward to the optimizer step."""
    gradient_buffers: int
    """Gradient storage that outlives a step: DeepSpeed's (partitioned) buffers, DDP's buckets."""
    optimizer: int
    frozen_copies: int
    activations: int
    logits: int
    gathered: int
    """ZeRO-3 / FSDP2: layers gathered for the forward / backward."""
    optimizer_step: int
    generation: int
    """KV cache + last-position logits + (ZeRO-3 / FSDP2) the whole model gathered for HF generate."""
    vllm: int
    cpu_bytes: int
    """CPU RAM per device for offloaded optimizer state / gradients / parameters."""
    gradients_in_forward: int = 0
    """The .grad bytes alive during a later micro-batch's forward (accumulation > 1), else 0."""
    autocast_copies: int = 0
    """torch autocast's 16-bit copies of fp32 weights, cached for the whole forward (DDP / one process)."""

    @property
    def persistent_bytes(self) -> int:
        return self.parameters + self.gradient_buffers + self.optimizer + self.frozen_copies + self.vllm

    @property
    def training_bytes(self) -> int:
        return self.activations + self.logits + self.gathered + self.gradients_in_forward + self.autocast_copies

    @property
    def peak_bytes(self) -> int:
        return self.persistent_bytes + max(self.training_bytes, self.gradients + self.optimizer_step, self.generation)

    def parts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def activation_elements_per_token(shape: ModelShape, gradient_checkpointing: bool) -> int:
    """Activation elements one token keeps for backward in one decoder layer (Llama / Qwen2 / Mistral blocks).

    Counted from what autograd saves: 2 RMSNorms (the normalised input and the weighted output, which the next
    projections save as their input: 2h each), q / k / v projections (2kv: their input is the first norm's output),
    rotary embedding (the rotated halves and the results: 2h + 2kv), the attention output and
    its contiguous copy before o_proj (2h), the residual sum (h), the MLP (gate, silu(gate), up, their product: 4I).
    models/lean_activations.py remakes silu(gate) and the product (2I fewer) and each norm's normalised input (2h
    fewer) in the backward where the model's classes are the ones it knows (`shape.lean`); it is off under
    checkpointing. With gradient checkpointing a layer keeps only its input (h).
    """
    h, kv, i = shape.hidden_size, shape.kv_size, shape.intermediate_size
    if gradient_checkpointing:
        return h
    return (9 * h + 4 * kv + 4 * i - (2 * i if "mlp" in shape.lean else 0)
            - (2 * h if "norm" in shape.lean else 0))


def micro_batch_tokens(w: Workload) -> int:
    """Tokens of one micro-batch's forward, over every rank of its sequence-parallel group."""
    return w.tokens or w.sequences * w.sequence_length


def local_tokens(w: Workload) -> int:
    """Tokens this rank holds: 1/N of the micro-batch's under sequence parallelism (rows padded to a multiple of N)."""
    return -(-micro_batch_tokens(w) // w.sequence_parallel)


def replicated_kv_elements(shape: ModelShape, sp: int, tokens: int) -> int:
    """Elements per layer that Ulysses adds on a rank beyond its 1/N share of `tokens`: with fewer key/value heads
    than ranks, DeepSpeed replicates them so that each rank attends with one whole head over the full sequence
    (UlyssesSPAttentionHF's kv_replication_factor), and the attention keeps that head's keys and values: 2 x d x T
    where the 1/N share counted 2 x kv / N x T."""
    return 2 * shape.head_dim * (max(sp, shape.num_kv_heads) - shape.num_kv_heads) * tokens // sp


def image_tokens_per_row(shape: ModelShape, w: Workload) -> int:
    """A row's image tokens as the estimate counts them (0 for a text model)."""
    if shape.vision is None:
        return 0
    told = w.image_tokens if w.image_tokens is not None else shape.vision.largest_image or w.sequence_length
    return min(told, w.sequence_length)


def vision_activation_bytes(shape: ModelShape, w: Workload) -> int:
    """The vision encoder's activations for one micro-batch: every row's image tokens x patches per token, each
    patch keeping a decoder layer's count (activation_elements_per_token, with a key / value per head) in every
    block of a tower that trains; under gradient checkpointing each block's input and one recomputed block; a
    frozen tower keeps nothing past the block running (one block's worth)."""
    v = shape.vision
    if v is None:
        return 0
    patches = w.sequences * image_tokens_per_row(shape, w) * v.patches
    block = 13 * v.width + 4 * v.intermediate
    if not v.trains:
        elements = block
    elif w.gradient_checkpointing:
        elements = v.depth * v.width + block
    else:
        elements = v.depth * block
    return patches * elements * w.compute_bytes


def activation_bytes(shape: ModelShape, w: Workload) -> int:
    """All layers' saved activations for one micro-batch (plus one recomputed layer under checkpointing), on one rank.

    Sequence parallelism (Ulysses) shards every token-wise tensor; the attention runs on the full sequence for 1/N of
    the heads, which is the same element count, except replicated key/value heads (replicated_kv_elements) and eager
    attention's scores, which stay quadratic in the full length (heads/N x T^2). A shared-prefix forward's 4-D mask is
    quadratic in its rows' width too (`Workload.mask_elements`)."""
    tokens, local, n = micro_batch_tokens(w), local_tokens(w), w.sequence_parallel
    per_token = activation_elements_per_token(shape, w.gradient_checkpointing)
    attention_layers = 1 if w.gradient_checkpointing else shape.num_layers  # recomputed: one layer at a time
    total = (per_token * local * shape.num_layers + 3 * shape.hidden_size * local  # + embeddings, final norm
             + attention_layers * replicated_kv_elements(shape, n, tokens)) * w.compute_bytes
    if w.gradient_checkpointing:  # the recomputed layer's forward runs without lean_activations
        plain = replace(shape, lean=frozenset())
        total += activation_elements_per_token(plain, False) * local * w.compute_bytes
    if w.eager_attention:  # softmax(QK^T) per row kept per layer, each rank for its heads over the whole row
        rows = -(-tokens // w.sequence_length)
        total += attention_layers * rows * (shape.num_heads // n) * w.sequence_length**2 * w.compute_bytes
    # a shared-prefix forward's boolean mask (1 B an entry), and the compute-dtype copy each attention layer keeps
    return total + w.mask_elements * (1 + attention_layers * w.compute_bytes)


def logits_bytes(shape: ModelShape, w: Workload) -> int:
    """The logits (kept for the log-softmax backward) and their gradient, plus float32 log-softmax work rows.

    Under sequence parallelism a loss of log-probs only scores each rank's own shard (fused: its chunks; else its
    shard's logits), but a loss that needs the logits (GRPO's entropy, distillation) gathers the whole rows' logits
    on every rank of the group (distributed/sequence_parallel.py: each computes the loss over whole rows): those are
    not sharded."""
    if not w.lm_head:
        return 0
    if w.logprobs_only and shape.fused_head:  # ops.linear_token_logprobs: float32 chunks of LINEAR_CHUNK rows
        scored = min(w.scored_tokens, local_tokens(w)) if w.scored_tokens else local_tokens(w)
        return 2 * min(scored, max(1, LINEAR_CHUNK // shape.vocab_size)) * shape.vocab_size * 4
    tokens = local_tokens(w) if w.logprobs_only else micro_batch_tokens(w)
    teacher = tokens * shape.vocab_size * w.compute_bytes if w.teacher_logits else 0  # its kept completion rows
    return (2 * tokens * shape.vocab_size * w.compute_bytes + 2 * min(tokens, LOGPROB_CHUNK) * shape.vocab_size * 4
            + teacher)


def generation_bytes(shape: ModelShape, w: Workload, engine: Engine, world_size: int, weight_bytes: int) -> int:
    """One HF generate call: keys and values of every layer at full length, last-position logits, gathered model."""
    if not w.generation_sequences:
        return 0
    kv_cache = 2 * shape.num_layers * shape.kv_size * w.generation_length * w.generation_sequences * w.compute_bytes
    logits = w.generation_sequences * shape.vocab_size * 4 * 2  # float32 scores + the sampling distribution
    whole = shape.parameters * weight_bytes  # ZeRO-3 / FSDP2: every rank holds it for the call, besides its own shard
    return kv_cache + logits + (whole - _share(whole, world_size) if engine.shards_parameters else 0)


def vllm_bytes(shape: ModelShape, w: Workload, gpu_bytes: int) -> int:
    """A colocated vLLM engine: on a GPU the share it reserves (weights and KV cache inside it); on CPU its own copy
    of the weights and its KV cache."""
    if gpu_bytes and w.vllm_fraction:
        return int(w.vllm_fraction * gpu_bytes)
    return shape.parameters * w.vllm_weight_bytes + w.vllm_kv_cache_bytes if w.vllm_weight_bytes else 0


def _share(total: int, world_size: int) -> int:
    return -(-total // world_size)


def estimate(shape: ModelShape, w: Workload, engine: Engine, world_size: int = 1, gpu_bytes: int = 0) -> Breakdown:
    """Peak memory per device of `w` under `engine` on `world_size` devices (see the module docstring).

    `gpu_bytes` (the device's memory) is needed only for a colocated vLLM's share."""
    p, t, n = shape.parameters, shape.trainable, world_size
    deepspeed = engine.zero_stage > 0
    # DeepSpeed under bf16/fp16 holds 16-bit weights and gradients and an fp32 master copy beside AdamW's moments
    weight_bytes = 2 if deepspeed and w.mixed_precision else w.weight_bytes
    master = 4 if deepspeed and weight_bytes < 4 else 0
    optimizer = w.trained_copies * t * ((8 + master) if deepspeed else 2 * weight_bytes)
    parameters = w.trained_copies * p * weight_bytes
    gradients = w.trained_copies * t * weight_bytes
    if engine.zero_stage >= 1 or engine.fsdp:
        optimizer = _share(optimizer, n)
    if engine.zero_stage >= 2 or engine.fsdp:
        gradients = _share(gradients, n)
    if engine.shards_parameters:
        parameters = _share(parameters, n)
    buffers = 0
    if deepspeed:  # DeepSpeed reduces .grad into its own buffers at once
        buffers, gradients = gradients, 0
    elif engine.name == "ddp" and n > 1:
        buffers = gradients  # DDP's flat buckets hold a second copy of the gradients
    cpu = 0
    if engine.offload_optimizer:
        cpu += optimizer + buffers
        optimizer, buffers = 0, 0
    if engine.offload_param:
        cpu += parameters
        parameters = 0
    frozen_bytes = w.frozen_copies * p * (w.frozen_weight_bytes or weight_bytes) + w.frozen_parameters * (
        w.frozen_weight_bytes or weight_bytes)
    frozen = _share(frozen_bytes, n) if engine.zero_stage == 3 else frozen_bytes  # prepare_frozen shards under ZeRO-3
    gathered = 2 * shape.layer_parameters * weight_bytes if engine.shards_parameters else 0
    optimizer_step = 0 if deepspeed or not w.foreach_optimizer else _share(t, n if engine.fsdp else 1) * 4
    return Breakdown(parameters=parameters, gradients=gradients, gradient_buffers=buffers, optimizer=optimizer,
                     frozen_copies=frozen, activations=activation_bytes(shape, w) + vision_activation_bytes(shape, w),
                     logits=logits_bytes(shape, w),
                     gathered=gathered, optimizer_step=optimizer_step, vllm=vllm_bytes(shape, w, gpu_bytes),
                     generation=generation_bytes(shape, w, engine, n, weight_bytes), cpu_bytes=cpu,
                     gradients_in_forward=gradients if w.accumulation > 1 else 0,
                     autocast_copies=2 * p if w.mixed_precision and weight_bytes == 4 and not engine.fsdp
                     and not deepspeed else 0)
