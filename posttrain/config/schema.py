"""The recipe: frozen, typed dataclasses that YAML mirrors one to one.

Every field has a default and a one-line docstring (the string literal under it). Derived values are functions
(`global_batch_size`, ...), never fields mutated later. `posttrain.config.load` turns YAML + `key.sub=value`
overrides into a `Recipe` and rejects unknown keys with the closest valid name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


ALL_LINEAR = "all-linear"  # PEFT's and TRL's model.lora.target_modules for every linear layer but the output one


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (peft) instead of all weights."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """LoRA scaling numerator (lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters; [all-linear]: every linear layer but the output layer (PEFT's shorthand); []:
    PEFT's choice for the architecture (q_proj and v_proj for Llama and Qwen: TRL's default)."""


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = "tiny/"
    """Hub id or local directory of the model to train."""
    tokenizer_name_or_path: Optional[str] = None
    """Tokenizer location when it differs from the model's."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit)."""
    dtype: str = "float32"
    """Weights dtype when loading: float32, bfloat16, float16 or auto."""
    attn_implementation: str = "sdpa"
    """Attention kernel: sdpa, eager, flash_attention_2, ..."""
    trust_remote_code: bool = False
    """Run code shipped with the model repository (off unless you trust it)."""
    chat_template: Optional[str] = None
    """Jinja chat template (or path to a .jinja file) overriding the tokenizer's."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (model.lora.*)."""
    lm_head_fp32: bool = False
    """The output layer in float32 (TRL's cast_lm_head_to_fp32; ScaleRL): the trainer keeps its weight in float32 and
    projects float32 hidden states outside autocast, and the in-process vLLM engine computes its logits in float32
    (vLLM's head_dtype), so both score the sampled tokens alike. Refused where a side cannot (vLLM servers)."""
    router_aux_loss_coef: Optional[float] = None
    """Mixture-of-experts models: weight of the load-balancing loss added to the policy loss (TRL's and transformers'
    name); null: the model config's own (Qwen3-MoE: 0.001; none for a dense model); 0: off (still logged)."""
    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision encoder's weights as loaded (OpenRLHF's freeze_visual_encoder); the
    projector trains unless model.freeze_projector is also set (docs/vision.md)."""
    freeze_projector: bool = False
    """Vision-language models: keep the projector (the layers mapping image features into the language model, Qwen-VL's
    merger) as loaded."""


@dataclass(frozen=True)
class DataConfig:
    train: str = ""
    """Training data: a .jsonl/.json/.parquet/.csv file, a save_to_disk directory, or a hub dataset name."""
    eval: Optional[str] = None
    """Optional held-out data in the same forms."""
    train_split: str = "train"
    """Split to read from a hub dataset or DatasetDict directory."""
    eval_split: str = "test"
    """Split to read for eval from a hub dataset or DatasetDict directory."""
    text_field: str = "text"
    """The column that holds language-modeling text (TRL's dataset_text_field), read as `text`."""
    max_length: int = 512
    """Longest tokenized sequence (prompt + completion); longer rows are truncated and counted."""
    max_prompt_length: Optional[int] = None
    """Longest prompt for prompt-only data (GRPO); longer prompts are truncated from the left."""
    packing: bool = False
    """Padding-free packing (TRL's padding_free), every algorithm: forwards run on the real tokens concatenated,
    position ids restarting per sequence so attention stays inside each; the update is the same as padded."""
    completion_only_loss: bool = True
    """Prompt-completion data: train only on completion tokens."""
    assistant_only_loss: bool = True
    """Conversational data: train only on assistant turns."""
    num_proc: Optional[int] = None
    """Worker processes for tokenisation (None: in-process)."""


@dataclass(frozen=True)
class TrainConfig:
    per_device_train_batch_size: int = 8
    """Sequences (or pairs, or prompts x generations) per device per micro-batch."""
    per_device_eval_batch_size: int = 8
    """Sequences per device per eval batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimiser step."""
    max_tokens_per_microbatch: Optional[int] = None
    """Token budget of a micro-batch (verl's ppo_max_token_len_per_gpu): each rank's rows of a step (the global batch
    per_device_train_batch_size x gradient_accumulation_steps x world) are regrouped into as few micro-batches of at
    most this many real tokens as fit, whole rows / preference pairs each; the update is the same as without it.
    None: micro-batches of per_device_train_batch_size rows."""
    shared_prefix: Union[bool, str] = "auto"
    """Compute the tokens rows share at their start (a prompt's G completions, a preference pair's prompt) once per
    micro-batch, not once per row: a packed row [prefix | each row's own tokens] under an attention mask that keeps
    every row's view of its tokens (ops/shared_prefix.py); the same log-probs, losses and update. auto: on where it is
    exact (sdpa attention, no sliding window, MoE router loss or sequence parallelism; said once when off); true: on,
    refused where it cannot be exact; false: off. Logged as tokens/forwarded and shared_prefix/saved_fraction."""
    sequence_parallel_size: int = 1
    """Sequence parallelism (DeepSpeed Ulysses / ALST): each row is split into this many contiguous slices, one per
    rank of a group of consecutive ranks that train on the same rows, so one sequence's activations are spread over
    them; the world must divide by it, and the model's attention heads (kv heads, or the other way round) too. SFT,
    GRPO, PPO and distill; 1: off. The update equals that of 1."""
    learning_rate: float = 1.0e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1.0e-8
    """AdamW epsilon."""
    fused_optimizer: bool = True
    """AdamW's fused kernel (torch, CPU and CUDA): one kernel per step instead of a loop over tensors (3.5x faster
    on CPU for 21M parameters) and no foreach temporaries; equal to the unfused step within float rounding."""
    lr_scheduler_type: str = "linear"
    """Schedule after warmup: constant, linear or cosine."""
    warmup_steps: int = 0
    """Linear warmup steps (overrides warmup_ratio when > 0)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of total steps."""
    max_steps: int = -1
    """Optimiser steps to run; -1 derives them from num_train_epochs."""
    num_train_epochs: float = 1.0
    """Passes over the training data when max_steps is -1."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: str = "no"
    """Autocast precision: 'no', bf16 or fp16 (a bfloat16 / float16 model.dtype picks its own when 'no')."""
    master_weights: bool = True
    """With a 16-bit model.dtype (or auto on a 16-bit checkpoint): train float32 master weights and AdamW state under
    16-bit autocast, as mixed precision does. false: pure bf16 / fp16 training (LLaMA-Factory's pure_bf16): half the
    memory of weights, gradients and optimiser state, but an update below ~1/256 of a weight is rounded away."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    logging_steps: int = 10
    """Log metrics every this many optimiser steps."""
    eval_steps: int = 0
    """Evaluate every this many steps when an eval set is given (0: only at the end)."""
    eval_pass_k: tuple[int, ...] = ()
    """Online runs: log the unbiased pass@k (eval/pass_at_<k>) of each k, from sampled completions per eval prompt."""
    eval_pass_k_samples: int = 0
    """Completions sampled per eval prompt for eval_pass_k, >= max(eval_pass_k) (0: max(eval_pass_k))."""
    save_steps: int = 0
    """Checkpoint every this many steps (0: none, apart from save_final_checkpoint=true and the stops of
    max_steps_per_run or a signal)."""
    save_final_checkpoint: Optional[bool] = None
    """Checkpoint the last step too (to extend or resume the run later); None: when save_steps > 0, as a save
    strategy does in transformers' Trainer, and never with save_steps 0 (final/ alone)."""
    save_total_limit: Optional[int] = 2
    """Keep only the newest this many checkpoints (None keeps all)."""
    save_final_model: bool = True
    """Export the trained model to output_dir/final as a Hugging Face directory."""
    export_dtype: str = "auto"
    """Weights dtype of final/: auto (the dtype the model was loaded in: model.dtype, auto read from the checkpoint),
    float32, bfloat16 or float16."""
    resume_from_checkpoint: Optional[str] = None
    """auto (newest checkpoint in output_dir) or a checkpoint path."""
    resume_strict: bool = True
    """Resume only what can be continued exactly: a checkpoint with a manifest and readable RNG state (false: accept
    a checkpoint without manifest.json or with unreadable RNG files, with a warning; the run is then not exact)."""
    overwrite_output_dir: bool = False
    """Replace the run in output_dir: its own files only (config, metrics, checkpoints, final, ...), the rest stays."""
    dataloader_seed: Optional[int] = None
    """Seed of the data order (defaults to the recipe seed)."""
    ddp_timeout: int = 1800
    """Seconds a collective may wait before the run fails instead of hanging."""
    report: bool = True
    """Write report.html with plotted curves at the end."""
    report_to: tuple[str, ...] = ("tensorboard",)
    """Experiment trackers that get the run name, the resolved recipe and every logged metric (rank 0): any of
    tensorboard, wandb, mlflow, trackio; none (or []) for none. Each is imported only when named."""
    tensorboard: Optional[bool] = None
    """Kept for older recipes: true adds tensorboard to report_to, false takes it out (None: report_to decides)."""
    run_name: Optional[str] = None
    """The run's name in the trackers (None: the output_dir's folder name)."""
    project: Optional[str] = None
    """W&B project, MLflow experiment and trackio project (None: WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME or
    TRACKIO_PROJECT where set, else posttrain)."""
    max_steps_per_run: Optional[int] = None
    """Stop (after saving a checkpoint) once this many steps ran in this process; for preemptible jobs and tests."""
    nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: stop the run (nothing of it is saved) or skip its update
    (DeepSpeed steps inside backward, so there it always stops)."""
    max_nonfinite_skips: int = 10
    """With nonfinite=skip: stop once this many steps of the run have been skipped."""


@dataclass(frozen=True)
class VLLMConfig:
    """What users tune on a vLLM engine the run starts (generation.engine: vllm; placement colocated, node or ray)."""

    gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory vLLM may take (weights + KV cache); training keeps the rest."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the engine serves (None: prompt and completion limits of the recipe, or 2048)."""
    enforce_eager: bool = True
    """No CUDA graphs: faster start, less memory; turn off for long runs on a GPU."""
    dtype: str = "auto"
    """Engine weights dtype: auto (float32 on a CPU, where bf16 is 3-5x slower; the model's dtype on a GPU), float32, bfloat16, float16."""
    enable_sleep_mode: bool = False
    """Free the engine's GPU memory while training (GPU only; a no-op on a CPU)."""
    kv_cache_gb: Optional[int] = None
    """CPU only: whole GiB for the KV cache (VLLM_CPU_KVCACHE_SPACE; None: vLLM's default)."""
    enable_prefix_caching: Optional[bool] = None
    """Reuse the keys and values of prompt blocks computed before (vLLM's prefix caching), emptied at every weight
    sync. None: off in-process; vLLM's default in a server the run starts (on on a GPU, off on a CPU)."""


@dataclass(frozen=True)
class GenerationConfig:
    engine: str = "hf"
    """Generation engine: hf (transformers generate on the policy itself) or vllm."""
    placement: str = "colocated"
    """Where generation runs, the one answer: colocated (an engine in every training process; hf always is), node
    (one vLLM engine per node, started by its first rank, shared by its ranks), servers (the vLLM servers listed in
    generation.servers: `posttrain serve` or a stock vLLM server, any nodes) or ray (placement.generation.num_engines
    vLLM engines as Ray actors, launcher: ray). Earlier spellings (engine: server, vllm.placement: node,
    placement.generation.num_engines alone) are read as these."""
    max_completion_length: int = 64
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: off)."""
    batch_size: Optional[int] = None
    """Prompts per generate call (None: all of the step's prompts at once)."""
    sync_every: int = 1
    """Optimiser steps between weight syncs to a vllm / server engine (1: before every generation)."""
    sync_bucket_mb: int = 256
    """MiB of full parameters gathered and sent per bucket during a weight sync."""
    max_staleness: int = 0
    """Generation batches sampled ahead while training goes on (vllm, server; 0: none), each by the policy current
    when it was submitted, so at most this many batches older (policy_lag logs it, algo.vllm_is_correction weights
    it); checkpoints carry them. The earlier `generation.async: true` is 1."""
    partial_rollouts: bool = False
    """With max_staleness >= 1: batches ahead are sampled in chunks of tokens and a weight sync lands between chunks;
    a completion still running then goes on under the new weights from its tokens so far, each token stamped with
    the version that sampled it (docs/generation.md)."""
    partial_chunk_tokens: Optional[int] = None
    """partial_rollouts: new tokens per completion per engine call (None: a quarter of max_completion_length)."""
    partial_chunks_per_batch: Optional[int] = None
    """partial_rollouts: chunk rounds the engine samples ahead per generation batch trained, a fixed pace that makes a
    run reproducible (None: enough for one whole batch, max_completion_length / partial_chunk_tokens rounded up)."""
    partial_max_versions: int = 0
    """partial_rollouts: most policy versions one completion may span; one that would span more stops where it is,
    is left out of the loss and counted in partial/dropped (0: no cap)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """In-process vLLM engine settings (generation.vllm.*)."""
    servers: tuple[str, ...] = ()
    """placement=servers: URLs of the vLLM servers (http://host:port); a prompt's samples go to one server."""
    request_timeout_s: float = 300.0
    """Servers (placement servers, node, ray): seconds one HTTP request (a completion, a control call) may take,
    start to end."""
    sync_timeout_s: float = 600.0
    """Servers (placement servers, node, ray): seconds each phase of a weight sync (open, send, load) may take."""
    request_retries: int = 2
    """Servers: further tries of a failed completion request before the run stops naming the server."""
    lora_sync: str = "merged"
    """With model.lora: merged (the adapters folded into full weights before each sync) or adapter (servers only:
    only the adapter tensors travel, and the LoRA-enabled server serves them under a new name per sync)."""
    lora_check_atol: float = 0.05
    """lora_sync=adapter: most a probe's log-prob from a server may differ from the trainer's after a sync."""


@dataclass(frozen=True)
class RewardConfig:
    name: str = ""
    """Built-in reward (exact_match, format, length_penalty, overlong, judge, reward_model, math_accuracy,
    think_answer_format, reasoning_gym), an import path
    ('module.function', 'module:function', 'file.py:function') or a reward model directory / hub id (docs/rewards.md)."""
    weight: float = 1.0
    """Weight of this reward in the total."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments passed to the reward function."""
    timeout: float = 60.0
    """Seconds the function may take per batch."""
    on_error: str = "raise"
    """raise: stop the run naming the function and sample; skip: give the sample reward 0 and count it."""


@dataclass(frozen=True)
class AgentConfig:
    """The multi-turn agent loop: tools and / or an environment (GRPO; docs/agents.md). Off while both are empty."""

    tools: tuple[str, ...] = ()
    """Functions the model may call: 'package.module:function' or 'path/to/file.py:function' (type hints and a
    docstring with Args give their JSON schema)."""
    tool_parser: str = "auto"
    """How tool calls are read from the model's turn: auto (from the chat template), hermes, llama3, or your own
    'module:function' taking the text and returning [{'name', 'arguments'}]."""
    environment: Optional[str] = None
    """A class 'module:Class' with reset(row) -> messages and step(assistant_message) -> (messages, reward, done),
    one instance per sample."""
    max_turns: Optional[int] = 4
    """Most model turns per trajectory (>= 1); null: no limit of its own (TRL's unset max_tool_calling_iterations): a
    trajectory ends when a turn calls no tool, or when generation.max_completion_length is used up (every turn takes at
    least one of its tokens, so there are at most that many turns)."""
    max_turn_tokens: Optional[int] = None
    """Most new tokens per model turn (None: what is left of generation.max_completion_length); a turn cut there is
    closed with the template's end-of-turn token, which is not trained, and counted in turns/cut."""
    tool_timeout: float = 10.0
    """Seconds one tool call may run before its process is killed and the model reads a timeout error."""
    tool_max_output_chars: int = 2000
    """Longest tool output the model reads; longer output is cut."""
    tool_workers: int = 4
    """Tool calls run at once (one process each)."""
    user_code_timeout: float = 60.0
    """Seconds the environment's constructor, reset or step, or a custom tool_parser, may take on one sample before
    the run stops naming it (exit 1) instead of hanging."""

    @property
    def enabled(self) -> bool:
        """Whether generation is multi-turn: tools or an environment are named."""
        return bool(self.tools) or self.environment is not None


@dataclass(frozen=True)
class RolePlacement:
    """Where one role's workers go under `launcher: ray` (OpenRLHF's --actor_num_nodes / --actor_num_gpus_per_node)."""

    num_nodes: Optional[int] = None
    """Nodes the role's workers span (None: the policy's; for the policy, every node with a GPU)."""
    num_gpus_per_node: Optional[int] = None
    """Workers per node, one GPU each (None: the policy's; for the policy, the GPUs of the smallest node)."""
    gpu_fraction: Optional[float] = None
    """Share of its GPU each worker takes; below 1 only for colocated roles (None: 1 / roles sharing the GPU)."""


@dataclass(frozen=True)
class EnginePlacement:
    """Generation engines as their own Ray actors (OpenRLHF's --vllm_num_engines, --vllm_tensor_parallel_size)."""

    num_engines: int = 0
    """generation.placement=ray: how many engines, apart from the training workers (>= 1 there)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans (all on one node)."""


@dataclass(frozen=True)
class PlacementConfig:
    """How roles and engines are spread over a Ray cluster; read only when `launcher: ray` (docs/ray.md)."""

    address: Optional[str] = None
    """Ray cluster to join (`ray start --head` prints it); None: RAY_ADDRESS, else a one-machine cluster for this run."""
    gpu_resource: str = "auto"
    """Ray resource a worker's GPU is counted in: auto (GPU if the cluster has any, else CPU-only workers), GPU,
    a custom name (CPU nodes standing in for GPUs) or none (CPU only)."""
    cpus_per_worker: int = 1
    """CPUs reserved for each worker."""
    policy: RolePlacement = field(default_factory=RolePlacement)
    """The policy's workers (placement.policy.*)."""
    reference: RolePlacement = field(default_factory=RolePlacement)
    """The reference model's workers (placement.reference.*)."""
    critic: RolePlacement = field(default_factory=RolePlacement)
    """The critic's workers (placement.critic.*)."""
    reward_model: RolePlacement = field(default_factory=RolePlacement)
    """The reward model's workers (placement.reward_model.*)."""
    teacher: RolePlacement = field(default_factory=RolePlacement)
    """A distillation teacher's workers (placement.teacher.*)."""
    colocate: Optional[tuple[tuple[str, ...], ...]] = None
    """Groups of roles sharing GPUs, e.g. [[policy, reference], [critic, reward_model]] (None: all with the policy)."""
    generation: EnginePlacement = field(default_factory=EnginePlacement)
    """Generation engines (placement.generation.*)."""


@dataclass(frozen=True)
class SFTAlgoConfig:
    """Supervised fine-tuning: cross-entropy over the loss mask. No knobs of its own yet."""


@dataclass(frozen=True)
class Recipe:
    output_dir: str = "runs/run"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/, report."""
    seed: int = 42
    """Seed for weights init (where random), data order, dropout and sampling."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and tokenisation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimiser, batch, schedule, precision, checkpoints, logging."""
    algo: Any = field(default_factory=SFTAlgoConfig)
    """The algorithm's own knobs; its type depends on the command (sft, rm, dpo, grpo)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling for online algorithms."""
    rewards: tuple[RewardConfig, ...] = ()
    """Reward functions for online algorithms."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The multi-turn agent loop: tools, environment, turns (agent.*; the old name rollout.* is still read)."""
    launcher: str = "local"
    """local: the processes torchrun / accelerate launch started (or one); ray: Ray actors placed by `placement`."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Roles and engines across GPUs and nodes under launcher: ray (placement.*)."""


def total_steps(train: TrainConfig, micro_batches_per_epoch: int) -> int:
    """Optimiser steps of the run: max_steps, or epochs x ceil(micro-batches per epoch / accumulation)."""
    if train.max_steps > 0:
        return train.max_steps
    steps_per_epoch = max(1, -(-micro_batches_per_epoch // train.gradient_accumulation_steps))
    return max(1, int(round(train.num_train_epochs * steps_per_epoch)))


def saves_final_checkpoint(train: TrainConfig) -> bool:
    """Whether the last step is checkpointed: train.save_final_checkpoint, None meaning save_steps > 0."""
    return train.save_steps > 0 if train.save_final_checkpoint is None else train.save_final_checkpoint


def trackers(train: TrainConfig) -> tuple[str, ...]:
    """The trackers a run writes to: report_to without 'none' and repeats, with the old train.tensorboard applied."""
    names = [n for n in dict.fromkeys(train.report_to) if n != "none"]
    if train.tensorboard is True and "tensorboard" not in names:
        names.append("tensorboard")
    return tuple(n for n in names if not (n == "tensorboard" and train.tensorboard is False))


def global_batch_size(train: TrainConfig, world_size: int) -> int:
    """Sequences per optimiser step across all processes."""
    return train.per_device_train_batch_size * train.gradient_accumulation_steps * world_size


def partial_chunk(generation: GenerationConfig) -> tuple[int, int]:
    """generation.partial_rollouts: (new tokens per completion per engine call, chunk rounds sampled ahead per
    generation batch trained), their None defaults resolved: a quarter of max_completion_length, and enough rounds
    for one whole batch."""
    tokens = generation.partial_chunk_tokens or max(1, generation.max_completion_length // 4)
    return tokens, generation.partial_chunks_per_batch or -(-generation.max_completion_length // tokens)
