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

from posttrain.config.schema import Recipe
from posttrain.errors import UserError


def _flag(value_if_true: str) -> Callable[[Any], Any]:
    """A TRL boolean that selects a value here (bf16: true -> mixed_precision: bf16); false leaves the default."""
    def convert(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value_if_true if value else None
    return convert


def _scale_rewards(value: Any) -> Any:
    """TRL's scale_rewards: true/false (older TRL) or group/batch/none (newer)."""
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


def _report_to(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# TRL key -> (recipe key, value conversion or None). Keys whose recipe key an algorithm lacks (num_generations for
# SFT) have no meaning for that algorithm and are reported as such.
TRL_KEYS: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
    # model (TRL's ModelConfig and the trainers' model_init_kwargs)
    "model_name_or_path": ("model.name_or_path", None),
    "model_revision": ("model.revision", None),
    "torch_dtype": ("model.dtype", None),
    "dtype": ("model.dtype", None),
    "attn_implementation": ("model.attn_implementation", None),
    "trust_remote_code": ("model.trust_remote_code", None),
    "chat_template_path": ("model.chat_template", None),
    "use_peft": ("model.lora.enabled", None),
    "lora_r": ("model.lora.r", None),
    "lora_alpha": ("model.lora.alpha", None),
    "lora_dropout": ("model.lora.dropout", None),
    "lora_target_modules": ("model.lora.target_modules", None),
    # data
    "dataset_name": ("data.train", None),
    "dataset_train_split": ("data.train_split", None),
    "dataset_test_split": ("data.eval_split", None),
    "dataset_num_proc": ("data.num_proc", None),
    "max_length": ("data.max_length", None),
    "max_seq_length": ("data.max_length", None),  # TRL < 0.20
    "max_prompt_length": ("data.max_prompt_length", None),
    "packing": ("data.packing", None),
    "padding_free": ("data.packing", None),
    "completion_only_loss": ("data.completion_only_loss", None),
    "assistant_only_loss": ("data.assistant_only_loss", None),
    # run and optimiser (transformers' TrainingArguments)
    "output_dir": ("output_dir", None),
    "seed": ("seed", None),
    "per_device_train_batch_size": ("train.per_device_train_batch_size", None),
    "per_device_eval_batch_size": ("train.per_device_eval_batch_size", None),
    "gradient_accumulation_steps": ("train.gradient_accumulation_steps", None),
    "learning_rate": ("train.learning_rate", None),
    "weight_decay": ("train.weight_decay", None),
    "adam_beta1": ("train.adam_beta1", None),
    "adam_beta2": ("train.adam_beta2", None),
    "adam_epsilon": ("train.adam_epsilon", None),
    "lr_scheduler_type": ("train.lr_scheduler_type", None),
    "warmup_steps": ("train.warmup_steps", None),
    "warmup_ratio": ("train.warmup_ratio", None),
    "max_steps": ("train.max_steps", None),
    "num_train_epochs": ("train.num_train_epochs", None),
    "max_grad_norm": ("train.max_grad_norm", None),
    "bf16": ("train.mixed_precision", _flag("bf16")),
    "fp16": ("train.mixed_precision", _flag("fp16")),
    "gradient_checkpointing": ("train.gradient_checkpointing", None),
    "logging_steps": ("train.logging_steps", None),
    "eval_steps": ("train.eval_steps", None),
    "save_steps": ("train.save_steps", None),
    "save_total_limit": ("train.save_total_limit", None),
    "resume_from_checkpoint": ("train.resume_from_checkpoint", None),
    "overwrite_output_dir": ("train.overwrite_output_dir", None),
    "data_seed": ("train.dataloader_seed", None),
    "ddp_timeout": ("train.ddp_timeout", None),
    "report_to": ("train.report_to", _report_to),
    # generation (GRPOConfig, PPOConfig)
    "max_completion_length": ("generation.max_completion_length", None),
    "response_length": ("generation.max_completion_length", None),  # PPOConfig
    "temperature": ("generation.temperature", None),
    "top_p": ("generation.top_p", None),
    "top_k": ("generation.top_k", None),
    "generation_batch_size": ("generation.batch_size", None),
    "use_vllm": ("generation.engine", _flag("vllm")),
    "vllm_gpu_memory_utilization": ("generation.vllm.gpu_memory_utilization", None),
    "vllm_tensor_parallel_size": ("generation.vllm.tensor_parallel_size", None),
    "vllm_enable_sleep_mode": ("generation.vllm.enable_sleep_mode", None),
    "vllm_max_model_length": ("generation.vllm.max_model_len", None),
    "vllm_importance_sampling_correction": ("algo.vllm_is_correction", None),
    "vllm_importance_sampling_cap": ("algo.vllm_is_cap", None),
    # the algorithm's own knobs (DPOConfig, GRPOConfig, RewardConfig, PPOConfig)
    "beta": ("algo.beta", None),
    "loss_type": ("algo.loss_type", None),
    "label_smoothing": ("algo.label_smoothing", None),
    "rpo_alpha": ("algo.rpo_alpha", None),
    "simpo_gamma": ("algo.simpo_gamma", None),
    "precompute_ref_log_probs": ("algo.precompute_ref_logprobs", None),
    "center_rewards_coefficient": ("algo.center_rewards_coefficient", None),
    "num_generations": ("algo.num_generations", None),
    "epsilon": ("algo.epsilon", None),
    "epsilon_high": ("algo.epsilon_high", None),
    "scale_rewards": ("algo.scale_rewards", _scale_rewards),
    "num_iterations": ("algo.num_iterations", None),
    "importance_sampling_level": ("algo.importance_sampling_level", None),
    "mask_truncated_completions": ("algo.mask_truncated_completions", None),
    "kl_coef": ("algo.kl_coef", None),
    "kl_estimator": ("algo.kl_estimator", None),
    "cliprange": ("algo.epsilon", None),
    "cliprange_value": ("algo.value_clip", None),
    "gamma": ("algo.gamma", None),
    "lam": ("algo.lam", None),
    "num_ppo_epochs": ("algo.ppo_epochs", None),
    "missing_eos_penalty": ("algo.missing_eos_penalty", None),
    "sft_model_path": ("model.name_or_path", None),
    "value_model_path": ("algo.critic_model_name_or_path", None),
}

RECIPE_TOP_LEVEL = tuple(f.metadata.get("key", f.name) for f in dataclasses.fields(Recipe))  # the recipe's sections


def translate(flat: dict[str, Any], where: str, algo_cls: type, shown: str = "") -> list[tuple[str, Any]]:
    """TRL keys and their values -> [(recipe key, value)]; every key without a meaning here is reported at once, as
    `shown` + key (shown='--' for command-line flags)."""
    from posttrain.config.keys import recipe_keys

    valid_keys = {k.path for k in recipe_keys(algo_cls)}
    command = command_of(algo_cls)
    out, problems = [], []
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


def flat_keys(raw: dict) -> dict:
    """The keys of a recipe file that are not recipe sections: TRL's flat keys (empty for a posttrain recipe)."""
    return {k: v for k, v in raw.items() if k not in RECIPE_TOP_LEVEL or (k in ("model", "data", "train")
                                                                           and not isinstance(v, dict))}


def nest(raw: dict, pairs: list[tuple[str, Any]]) -> dict:
    """A copy of `raw` with each (dotted key, value) set; a key the file also sets in its own section wins here."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for path, value in pairs:
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"'{path}': '{part}' is a value, not a section")
        node[leaf] = value
    return out


def from_trl_file(raw: dict, where: str, algo_cls: type) -> dict:
    """A recipe file's mapping with its flat TRL keys translated into sections (unchanged when there are none)."""
    flat = flat_keys(raw)
    if not flat:
        return raw
    rest = {k: v for k, v in raw.items() if k not in flat}
    return nest(rest, translate(flat, where, algo_cls))


def command_of(algo_cls: type) -> str:
    """GRPOAlgoConfig -> grpo (the command whose algo: section it is)."""
    return algo_cls.__name__.removesuffix("AlgoConfig").lower()


def split_trl_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """TRL-style `--key value`, `--key=value` and bare `--flag` (true) out of a command's arguments; the rest back.
    Values are read as YAML (1e-4, true, [a, b]), as in `key=value` overrides."""
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
        if "=" in arg:
            text = arg.split("=", 1)[1]
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and not looks_like_override(argv[i + 1]):
            text = argv[i + 1]
            i += 1
        else:
            text = "true"
        flags[name] = parse_value(text)
        i += 1
    return rest, flags


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
