"""Coming from TRL: flat `SFTConfig` / `DPOConfig` / `GRPOConfig` / `RewardConfig` / `PPOConfig` keys, in a config file
or as `--key value` flags, translated to the recipe keys that mean the same thing (docs/trl.md has the table).

    posttrain sft --config trl_sft.yaml                 # model_name_or_path: ..., learning_rate: 2e-5, bf16: true
    posttrain grpo --config recipes/grpo.yaml --learning_rate 1e-6 --num_generations=4 --use_vllm

A key with no meaning here is never dropped: every such key is reported at once, each with the closest name, and the
run stops (exit 2) before anything loads.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable

import yaml

from posttrain.config.keys import recipe_key, recipe_keys, set_dotted
from posttrain.config.schema import Recipe
from posttrain.config.trl_rewards import LIST_KEYS, rewards_from_trl
from posttrain.errors import UserError


def _flag(value_if_true: str) -> Callable[[Any], Any]:
    """A TRL boolean that selects a value here (bf16: true -> mixed_precision: bf16); false leaves the default."""
    def convert(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value_if_true if value else None
    return convert


# TRL keys spelled as here, by recipe section (train: transformers' TrainingArguments)
SAME_NAMES = {
    "model": "attn_implementation trust_remote_code",
    "data": "max_length max_prompt_length packing completion_only_loss assistant_only_loss",
    "train": "per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps learning_rate "
             "weight_decay adam_beta1 adam_beta2 adam_epsilon lr_scheduler_type warmup_steps warmup_ratio max_steps "
             "num_train_epochs max_grad_norm gradient_checkpointing logging_steps eval_steps save_steps "
             "save_total_limit resume_from_checkpoint overwrite_output_dir ddp_timeout report_to",
    "generation": "max_completion_length temperature top_p top_k",
    "algo": "beta loss_type label_smoothing rpo_alpha simpo_gamma center_rewards_coefficient num_generations epsilon "
            "epsilon_high scale_rewards num_iterations importance_sampling_level mask_truncated_completions kl_coef "
            "kl_estimator gamma lam missing_eos_penalty",
}
# TRL key -> recipe key. A key whose recipe key an algorithm lacks (num_generations for SFT) has no meaning for
# that algorithm and is reported as such. max_seq_length is TRL < 0.20's max_length; response_length is PPOConfig's.
TRL_RENAMES: dict[str, str] = {
    **{key: f"{section}.{key}" for section, keys in SAME_NAMES.items() for key in keys.split()},
    "output_dir": "output_dir", "seed": "seed",
    # model (TRL's ModelConfig and the trainers' model_init_kwargs)
    "model_name_or_path": "model.name_or_path", "model_revision": "model.revision", "torch_dtype": "model.dtype",
    "dtype": "model.dtype", "chat_template_path": "model.chat_template", "use_peft": "model.lora.enabled",
    "lora_r": "model.lora.r", "lora_alpha": "model.lora.alpha", "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules", "sft_model_path": "model.name_or_path",
    # data
    "dataset_name": "data.train", "dataset_train_split": "data.train_split", "dataset_test_split": "data.eval_split",
    "dataset_num_proc": "data.num_proc", "max_seq_length": "data.max_length", "padding_free": "data.packing",
    # run and optimiser (transformers' TrainingArguments)
    "bf16": "train.mixed_precision", "fp16": "train.mixed_precision", "data_seed": "train.dataloader_seed",
    # generation (GRPOConfig, PPOConfig)
    "response_length": "generation.max_completion_length", "generation_batch_size": "generation.batch_size",
    "use_vllm": "generation.engine", "vllm_gpu_memory_utilization": "generation.vllm.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "generation.vllm.tensor_parallel_size",
    "vllm_enable_sleep_mode": "generation.vllm.enable_sleep_mode",
    "vllm_max_model_length": "generation.vllm.max_model_len",
    # the algorithm's own knobs (DPOConfig, GRPOConfig, RewardConfig, PPOConfig)
    "vllm_importance_sampling_correction": "algo.vllm_is_correction",
    "vllm_importance_sampling_cap": "algo.vllm_is_cap", "precompute_ref_log_probs": "algo.precompute_ref_logprobs",
    "cliprange": "algo.epsilon", "cliprange_value": "algo.value_clip", "num_ppo_epochs": "algo.ppo_epochs",
    "value_model_path": "algo.critic_model_name_or_path",
}
# TRL values spelled otherwise here (a lone report_to: wandb needs none: a recipe's list key takes one string);
# scale_rewards is true/false in older TRL, group/batch/none in newer
CONVERSIONS: dict[str, Callable[[Any], Any]] = {
    "bf16": _flag("bf16"), "fp16": _flag("fp16"), "use_vllm": _flag("vllm"),
    "scale_rewards": lambda value: {True: "group", False: "none"}[value] if isinstance(value, bool) else value}
TRL_KEYS: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
    key: (path, CONVERSIONS.get(key)) for key, path in TRL_RENAMES.items()}  # key -> (recipe key, conversion)

RECIPE_TOP_LEVEL = tuple(recipe_key(f) for f in dataclasses.fields(Recipe))  # the recipe's sections


def translate(flat: dict[str, Any], where: str, algo_cls: type, shown: str = "") -> list[tuple[str, Any]]:
    """TRL keys and their values -> [(recipe key, value)]; every key without a meaning here is reported at once, as
    `shown` + key (shown='--' for command-line flags)."""
    valid_keys = {k.path for k in recipe_keys(algo_cls)}
    command = algo_cls.__name__.removesuffix("AlgoConfig").lower()  # GRPOAlgoConfig -> grpo
    flat = dict(flat)
    rewards, problems = rewards_from_trl(flat, shown)  # reward_funcs, reward_weights, ... make one list together
    if problems:
        raise UserError(f"{where}: " + "\n  ".join(problems))
    out = [("rewards", rewards)] if rewards is not None else []
    for key, value in flat.items():
        if key not in TRL_KEYS:
            unknown = "neither a TRL key posttrain knows nor a recipe key"
            problems.append(f"{shown}{key}: {closest(key, valid_keys, shown) or unknown}")
            continue
        path, convert = TRL_KEYS[key]
        if path not in valid_keys:
            problems.append(f"{shown}{key}: posttrain's {path}, which `posttrain {command}` does not take")
            continue
        try:
            value = convert(value) if convert else value
        except ValueError as e:
            problems.append(f"{shown}{key}: {e}")
            continue
        if value is not None:
            out.append((path, value))
    if problems:
        raise UserError(f"{where}: {len(problems)} key{'s' if len(problems) > 1 else ''} with no meaning here:\n  "
                        + "\n  ".join(problems) + f"\n`posttrain {command} --help` lists every key; docs/trl.md "
                        "maps TRL's keys to posttrain's")
    return out


def closest(key: str, valid_keys: set[str], shown: str = "") -> str:
    """'did you mean X?' with the nearest TRL key (as `shown` + key) or recipe key (matched on the whole dotted key
    or its last part), or ''."""
    candidates = {k.rsplit(".", 1)[-1]: k for k in sorted(valid_keys)}
    candidates.update({k: shown + k for k in TRL_KEYS if TRL_KEYS[k][0] in valid_keys})
    candidates.update({k: k for k in valid_keys})
    match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{candidates[match[0]]}'?" if match else ""


def from_trl_file(raw: dict, where: str, algo_cls: type) -> dict:
    """A recipe file's mapping with its flat TRL keys (those that are not recipe sections; none in a posttrain recipe)
    translated into sections (unchanged when there are none); a key the file also sets in its own section takes the
    TRL key's value."""
    flat = {k: v for k, v in raw.items()
            if k not in RECIPE_TOP_LEVEL or (k in ("model", "data", "train") and not isinstance(v, dict))}
    if not flat:
        return raw
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items() if k not in flat}
    for path, value in translate(flat, where, algo_cls):
        set_dotted(out, path, value, f"'{path}'")
    return out


def split_trl_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """TRL-style `--key value`, `--key=value`, `--key v1 v2 ...` (a list) and bare `--flag` (true) out of a command's
    arguments; the rest back. Values are read as YAML (1e-4, true, [a, b]), as in `key=value` overrides."""
    rest, flags, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if not arg.startswith("--") or name in ("config", "ray", "help") or arg == "--":
            rest.append(arg)
            if arg == "--config" and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
            i += 1
            continue
        texts = [arg.split("=", 1)[1]] if "=" in arg else []
        while "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--") \
                and not looks_like_override(argv[i + 1]):  # every value up to the next flag (TRL's nargs='+')
            texts.append(argv[i + 1])
            i += 1
        values = [parse_value(text) for text in texts or ["true"]]
        value = values[0] if len(values) == 1 else values
        if name in LIST_KEYS and name in flags:  # --reward_funcs a --reward_funcs b: both
            value = _as_list(flags[name]) + _as_list(value)
        flags[name] = value
        i += 1
    return rest, flags


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


def looks_like_override(arg: str) -> bool:
    """train.max_steps=20 (a recipe override), as opposed to a flag's value."""
    key = arg.split("=", 1)[0]
    return "=" in arg and (key.split(".")[0] in RECIPE_TOP_LEVEL)


def parse_value(text: str) -> Any:
    """A flag's text as YAML reads it, except that 1e-6 is a number (YAML 1.1 wants 1.0e-6)."""
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def as_override(path: str, value: Any) -> str:
    """(train.learning_rate, 1e-4) -> 'train.learning_rate=0.0001', read back as the same value."""
    return f"{path}={yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix('...').strip()}"
