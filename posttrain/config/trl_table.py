"""TRL's config fields that have no recipe key of their own, each with what it means here.

TRL 1.16's `SFTConfig`, `DPOConfig`, `GRPOConfig`, `RewardConfig`, `DistillationConfig` and trl.experimental's
`GKDConfig` (transformers' `TrainingArguments` included) and the script arguments of TRL's CLI (`ModelConfig`,
`ScriptArguments`, `GRPOScriptArguments`, `DatasetMixtureConfig`): every field is either translated
(`trl_compat.TRL_KEYS`), or listed here as

- IGNORED: accepted; it has no effect here, and a value other than TRL's default gets one line saying why;
- REFUSED: a value other than TRL's default stops the run (exit 2) with what to do instead.

Each entry is `key: (values that change nothing here, text)`: TRL's defaults (so a whole TRL config dump translates)
and any value that means what posttrain does anyway. tests/unit/test_trl_table.py walks TRL's own dataclasses field
by field against these tables.
"""

from __future__ import annotations

from typing import Any

NONE = (None,)
FALSE = (False, None)
TRUE = (True, None)
UPLOAD = ("posttrain never uploads; after the run: huggingface-cli upload <your-name/model> <output_dir>/final "
          "(final/ is a complete Hugging Face model folder)")
LAUNCH = ("the launch picks the engine, never the recipe: accelerate launch --config_file "
          "recipes/accelerate/zero3.yaml (ddp, zero1-3, offload, fsdp2: docs/distributed.md)")
VLLM_SERVER = ("posttrain's generation servers are `posttrain serve` (docs/generation.md), not trl vllm-serve: set "
               "generation.engine=server generation.servers=[http://HOST:PORT]")
NO_DATALOADER = "rows are tokenised before training and batched in the training process: there is no DataLoader"
DPO_VARIANT = "this DPO variant is not implemented here; algo.loss_type lists the losses there are (docs/algorithms.md)"
GRPO_VARIANT = "this GRPO variant is not implemented here (docs/algorithms.md lists what is)"
QUANTISED = "quantised (QLoRA) training is not available here; train LoRA on bf16 weights (model.dtype=bfloat16)"

IGNORED: dict[str, tuple[tuple[Any, ...], str]] = {
    # transformers' TrainingArguments
    "average_tokens_across_devices": (TRUE, "the loss is always normalised by the global token count"),
    "bf16_full_eval": (FALSE, "evaluation runs in the training precision (train.mixed_precision)"),
    "fp16_full_eval": (FALSE, "evaluation runs in the training precision (train.mixed_precision)"),
    "tf32": (NONE, "posttrain leaves torch's matmul precision as it is"),
    "gradient_checkpointing_kwargs": (NONE, "gradient checkpointing here is non-reentrant, its only setting"),
    "torch_compile": (FALSE, "torch.compile is not applied; the output layer and log-softmax are fused instead"),
    "torch_compile_backend": (NONE, "torch.compile is not applied"),
    "torch_compile_mode": (NONE, "torch.compile is not applied"),
    "use_liger_kernel": (FALSE, "the fused output layer + log-softmax (Liger's main saving) is always on here: the "
                         "(B, T, V) logits are never made (posttrain/ops/logprobs.py)"),
    "liger_kernel_config": (NONE, "the fused output layer is always on and takes no settings"),
    "use_cache": (FALSE + (True,), "the KV cache is used for generation and never in training forwards"),
    "torch_empty_cache_steps": (NONE, "the CUDA cache is left to PyTorch's allocator"),
    "logging_first_step": (FALSE, "rows are logged every train.logging_steps (1 logs step 1); eval runs at step 0"),
    "log_on_each_node": (TRUE, "rank 0 logs for every node"),
    "logging_nan_inf_filter": (TRUE, "a non-finite loss stops the run (or is skipped: train.nonfinite), logged null"),
    "include_num_input_tokens_seen": (("no", False, None), "metrics.jsonl always logs num_tokens"),
    "log_level": (("passive",), "posttrain prints its own lines; set TRANSFORMERS_VERBOSITY for transformers'"),
    "log_level_replica": (("warning", "passive"), "only rank 0 prints"),
    "disable_tqdm": (NONE, "the progress bar shows on a terminal and becomes one line per log row in a file"),
    "trackio_space_id": (NONE, "trackio logs locally here (train.report_to: trackio)"),
    "trackio_bucket_id": (NONE, "trackio logs locally here (train.report_to: trackio)"),
    "trackio_static_space_id": (NONE, "trackio logs locally here (train.report_to: trackio)"),
    "eval_delay": ((0, None), "evaluation runs at step 0 and every train.eval_steps"),
    "prediction_loss_only": (FALSE, "evaluation logs the loss and the algorithm's own metrics"),
    "eval_on_start": (FALSE + (True,), "evaluation always runs at step 0 when data.eval is given"),
    "eval_do_concat_batches": (TRUE, "evaluation metrics are reduced per batch, never concatenated"),
    "eval_use_gather_object": (FALSE, "evaluation metrics are reduced across ranks with one all-reduce"),
    "eval_accumulation_steps": (NONE, "evaluation metrics are reduced per batch, never accumulated on the GPU"),
    "include_for_metrics": (((), [], None), "there are no compute_metrics callbacks here"),
    "batch_eval_metrics": (FALSE, "there are no compute_metrics callbacks here"),
    "save_only_model": (FALSE, "checkpoints always hold the optimiser and RNG state, so a resume is exact; final/ "
                        "holds only the model"),
    "save_on_each_node": (FALSE, "rank 0 writes every file"),
    "enable_jit_checkpoint": (FALSE, "SIGTERM and SIGINT always save a checkpoint at the next step boundary"),
    "hub_token": (NONE, UPLOAD),
    "hub_private_repo": (NONE, UPLOAD),
    "hub_model_id": (NONE, UPLOAD),
    "hub_strategy": (("every_save",), UPLOAD),
    "hub_always_push": (FALSE, UPLOAD),
    "hub_revision": (NONE, UPLOAD),
    "push_to_hub": (FALSE, UPLOAD),
    "metric_for_best_model": (NONE, "final/ is the last step's model; metrics.jsonl has every eval to pick a "
                              "checkpoints/step-N by"),
    "greater_is_better": (NONE, "final/ is the last step's model (see metric_for_best_model)"),
    "ignore_data_skip": (FALSE, "a resume restores the data position exactly, without replaying batches"),
    "restore_callback_states_from_checkpoint": (FALSE, "there are no callbacks; a resume restores the whole state"),
    "full_determinism": (FALSE, "runs are seeded (seed, data_seed) and a resume continues exactly; deterministic "
                         "CUDA kernels are not forced"),
    "dataloader_drop_last": (FALSE, NO_DATALOADER),
    "dataloader_num_workers": ((0, None), NO_DATALOADER),
    "dataloader_pin_memory": (TRUE, NO_DATALOADER),
    "dataloader_persistent_workers": (FALSE, NO_DATALOADER),
    "dataloader_prefetch_factor": (NONE, NO_DATALOADER),
    "dataloader_multiprocessing_context": (NONE, NO_DATALOADER),
    "dataloader_in_order": (TRUE, NO_DATALOADER),
    "remove_unused_columns": ((True, False, None), "other columns are kept: rewards get them (GRPO), other "
                              "algorithms ignore them"),
    "label_names": (NONE, "each algorithm knows the columns it reads (docs/data.md)"),
    "length_column_name": (("length",), "there is no group_by_length sampling here"),
    "ddp_find_unused_parameters": (NONE, "DDP is set up by the backend; every trained parameter gets a gradient"),
    "ddp_bucket_cap_mb": (NONE, "DDP's defaults are kept"),
    "ddp_broadcast_buffers": (NONE, "DDP's defaults are kept"),
    "ddp_static_graph": (NONE, "DDP's defaults are kept"),
    "ddp_backend": (NONE, "nccl on GPUs, gloo on CPUs, chosen by the backend"),
    "debug": (("", None, []), "use posttrain doctor to check a cluster before a launch"),
    "skip_memory_metrics": (TRUE, "peak_memory_mb is always logged"),
    "do_train": (FALSE + (True,), "posttrain <algorithm> always trains"),
    "do_eval": (FALSE + (True,), "evaluation runs exactly when data.eval is given"),
    "do_predict": (FALSE, "posttrain has no predict phase"),
    "local_rank": ((-1, None), "the launcher (torchrun, accelerate launch) sets each process's rank"),
    # TRL's trainer configs
    "shuffle_dataset": ((True, False, None), "training data is always shuffled, seeded by data_seed (or seed)"),
    "pad_to_multiple_of": (("auto", None), "micro-batches are packed or padded to their longest row"),
    "eval_packing": (NONE, "evaluation batches like training (data.packing)"),
    "packing_strategy": (("bfd", None), "data.packing packs rows in data order, each attending only to itself"),
    "disable_dropout": (FALSE, "the model's own dropout is kept (0 in the Llama, Qwen, Mistral and Gemma configs)"),
    "precompute_ref_batch_size": (NONE, "precomputed reference log-probs use train.per_device_eval_batch_size"),
    "ref_model_mixup_alpha": ((0.6,), "sync_ref_model is not implemented here"),
    "ref_model_sync_steps": ((512,), "sync_ref_model is not implemented here"),
    "ds3_gather_for_generation": (TRUE, "weight sync gathers ZeRO-3 parameters a bucket at a time "
                                  "(generation.sync_bucket_mb)"),
    "vllm_model_impl": (("vllm",), "vLLM's own model code is used"),
    "log_completions": (FALSE, "samples.jsonl holds algo.log_samples prompt groups at every logging step"),
    "log_multimodal": (TRUE, "posttrain trains text models"),
    "num_completions_to_print": (NONE, "samples.jsonl holds algo.log_samples prompt groups at every logging step"),
    "log_unique_prompts": (FALSE, "samples.jsonl holds algo.log_samples prompt groups at every logging step"),
    "use_transformers_continuous_batching": (FALSE, "generation.engine=hf batches with generate(); vllm is the "
                                             "fast engine"),
    "transformers_continuous_batching_config": (NONE, "generation.engine=hf batches with generate()"),
    "use_transformers_paged": (FALSE, "generation.engine=hf batches with generate(); vllm is the fast engine"),
    # the script arguments of TRL's CLI
    "ignore_bias_buffers": (FALSE, "DDP does not broadcast buffers here"),
}

REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    # transformers' TrainingArguments
    "lr_scheduler_kwargs": ((None, {}), "the schedules here (constant, linear, cosine: train.lr_scheduler_type) take "
                            "no arguments"),
    "optim_args": (NONE, "the optimiser is AdamW (train.adam_beta1, adam_beta2, adam_epsilon, weight_decay)"),
    "optim_target_modules": (NONE, "the optimiser is AdamW on every trained parameter"),
    "label_smoothing_factor": ((0, 0.0, None), "SFT trains on the plain token NLL; DPO's label smoothing is "
                               "algo.label_smoothing"),
    "neftune_noise_alpha": (NONE, "NEFTune embedding noise is not implemented here"),
    "auto_find_batch_size": (FALSE, "`posttrain plan --config <recipe>` estimates the memory of a batch size on each "
                             "engine before a launch"),
    "load_best_model_at_end": (FALSE, "final/ is the last step's model: pick a checkpoints/step-N by the evals in "
                               "metrics.jsonl (save_total_limit: null keeps them all)"),
    "use_cpu": (FALSE, "posttrain runs on the GPUs it sees: CUDA_VISIBLE_DEVICES= posttrain ... runs on the CPU"),
    "accelerator_config": ((None, {}), LAUNCH),
    "parallelism_config": (NONE, LAUNCH),
    "fsdp": ((None, "", []), LAUNCH),
    "fsdp_config": ((None, {}), LAUNCH),
    "deepspeed": (NONE, LAUNCH),
    "train_sampling_strategy": (("random",), "the data order is a seeded shuffle (data_seed)"),
    # TRL's trainer configs
    "model_init_kwargs": ((None, {}), "set model.dtype, model.attn_implementation, model.revision and "
                          "model.trust_remote_code as recipe keys"),
    "dataset_kwargs": ((None, {}), "the data is read and tokenised as its format says (docs/data.md)"),
    "eos_token": (NONE, "the tokenizer's own end-of-sequence token is used; change it with a tokenizer of your own "
                  "(model.tokenizer_name_or_path) or model.chat_template"),
    "pad_token": (NONE, "padding never reaches the loss here (packed, masked batches); the tokenizer's pad token, "
                  "else its eos, is used"),
    "truncation_mode": (("keep_start", None), "rows longer than data.max_length keep their start (prompts of "
                        "prompt-only data keep their end)"),
    "activation_offloading": (FALSE, "activation offloading is not implemented: train.gradient_checkpointing=true "
                              "saves activation memory"),
    "loss_weights": (NONE, "one algo.loss_type at a time here (plus algo.rpo_alpha's SFT term)"),
    "ld_alpha": (NONE, DPO_VARIANT),
    "f_divergence_type": (("reverse_kl",), DPO_VARIANT),
    "f_alpha_divergence_coef": ((0.5,), DPO_VARIANT),
    "use_weighting": (FALSE, DPO_VARIANT),
    "discopop_tau": ((0.05,), DPO_VARIANT),
    "sync_ref_model": (FALSE, "the reference model stays the starting model (TR-DPO's sync is not implemented)"),
    "num_generations_eval": (NONE, "evaluation generates one completion per held-out prompt"),
    "steps_per_generation": (NONE, "generation.batch_size sets how many prompts one generation round takes; "
                             "algo.num_iterations reuses a batch for more optimiser steps"),
    "min_p": (NONE, "sampling here takes generation.temperature, top_p and top_k"),
    "generation_kwargs": ((None, {}), "sampling here takes generation.temperature, top_p, top_k and "
                          "max_completion_length"),
    "chat_template_kwargs": ((None, {}), "the chat template is rendered with its defaults; set model.chat_template "
                             "for another template"),
    "repetition_penalty": ((1.0, None), "sampling here takes generation.temperature, top_p and top_k"),
    "cache_implementation": (NONE, "generation.engine=hf uses transformers' default cache"),
    "vllm_mode": (("colocate",), VLLM_SERVER + " (use_vllm alone: vLLM in the training process)"),
    "vllm_structured_outputs_regex": (NONE, "structured outputs are not available here"),
    "vllm_server_base_url": (NONE, VLLM_SERVER),
    "vllm_server_host": (("0.0.0.0",), VLLM_SERVER),
    "vllm_server_port": ((8000,), VLLM_SERVER),
    "vllm_server_timeout": ((240, 240.0), VLLM_SERVER + "; generation.request_timeout_s bounds each request"),
    "vllm_group_port": ((51216,), VLLM_SERVER),
    "delta": (NONE, GRPO_VARIANT),
    "sapo_temperature_neg": ((1.05,), GRPO_VARIANT),
    "sapo_temperature_pos": ((1.0,), GRPO_VARIANT),
    "vespo_k_pos": ((2.0,), GRPO_VARIANT),
    "vespo_lambda_pos": ((3.0,), GRPO_VARIANT),
    "vespo_k_neg": ((3.0,), GRPO_VARIANT),
    "vespo_lambda_neg": ((2.0,), GRPO_VARIANT),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are weighted and summed, then normalised per "
                                    "group (algo.scale_rewards)"),
    "top_entropy_quantile": ((1.0,), GRPO_VARIANT),
    "entropy_coef": ((0.0, 0), GRPO_VARIANT),
    "use_adaptive_entropy": (FALSE, GRPO_VARIANT),
    "entropy_coef_min": ((0.0, 0), GRPO_VARIANT),
    "entropy_coef_max": ((1.0,), GRPO_VARIANT),
    "entropy_coef_delta": ((0.005,), GRPO_VARIANT),
    "entropy_target": ((0.2,), GRPO_VARIANT),
    "off_policy_mask_threshold": (NONE, GRPO_VARIANT + "; algo.vllm_is_correction weights stale samples"),
    "use_bias_correction_kl": (TRUE, "the KL term here is algo.beta's k3 estimator (docs/algorithms.md)"),
    "log_completions_hub_repo": (NONE, UPLOAD),
    "teacher_model_init_kwargs": ((None, {}), "the teacher loads as the student does (model.dtype, "
                                  "model.attn_implementation, model.trust_remote_code); algo.teacher_model_revision "
                                  "picks its revision"),
    "seq_kd": (FALSE, "sequence-level KD (training on the teacher's own generations) is not implemented here: "
               "sample the teacher's completions into a dataset and train on it with posttrain sft, or distill on "
               "the student's own samples with algo.lmbda"),
    # TRL's ModelConfig
    "lora_target_parameters": (NONE, "LoRA here targets modules: model.lora.target_modules"),
    "lora_modules_to_save": (NONE, "LoRA here trains only the adapters"),
    "lora_task_type": (("CAUSAL_LM", "SEQ_CLS"), "the task type follows the command (SEQ_CLS for posttrain rm)"),
    "use_rslora": (FALSE, "rank-stabilised LoRA is not available here"),
    "use_dora": (FALSE, "DoRA is not available here"),
    "load_in_8bit": (FALSE, QUANTISED),
    "load_in_4bit": (FALSE, QUANTISED),
    "bnb_4bit_quant_type": (("nf4",), QUANTISED),
    "use_bnb_nested_quant": (FALSE, QUANTISED),
    "bnb_4bit_quant_storage": (NONE, QUANTISED),
    # the script arguments of TRL's CLI
    "dataset_config": (NONE, "hub dataset configurations are not read here: save one with datasets.load_dataset("
                       "name, config).save_to_disk(DIR) and pass data.train=DIR"),
    "dataset_streaming": (FALSE, "streaming is not available: rows are tokenised before training (data.num_proc)"),
    "datasets": (((), [], None), "one dataset per run here: data.train (mix several into one file first)"),
    "streaming": (FALSE, "streaming is not available: rows are tokenised before training (data.num_proc)"),
    "test_split_size": (NONE, "split the data yourself and pass data.eval"),
}


def changes_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    """`value` is one of `harmless` (True is not 1, 1.0 is 1: YAML may read either)."""
    return any(value == h and isinstance(value, bool) == isinstance(h, bool) for h in harmless)
