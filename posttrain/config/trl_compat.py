"""Coming from TRL: flat `SFTConfig` / `DPOConfig` / `GRPOConfig` / `RewardConfig` / `PPOConfig` keys, in a config file
or as `--key value` flags, translated to the recipe keys that mean the same thing (docs/trl.md has the table).

    posttrain sft --config trl_sft.yaml                 # model_name_or_path: ..., learning_rate: 2e-5, bf16: true
    posttrain grpo --config recipes/grpo.yaml --learning_rate 1e-6 --num_generations=4 --use_vllm
    posttrain sft --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name data.jsonl   # TRL's defaults (docs/trl.md)

Every field of TRL's configs is translated here (TRL_KEYS), or accepted with a line saying why it has no effect, or
refused with what to do instead (config/trl_table.py). A key that is none of these (a typo) is never dropped: every
such key is reported at once, each with the closest name, and the run stops (exit 2) before anything loads. Two keys
for one recipe key (max_length beside max_seq_length, a flag beside its key=value override, a flag given twice) are
refused naming both.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from typing import Any, Callable

import yaml

from posttrain.config.keys import recipe_keys, set_dotted
from posttrain.config.trl_flags import RECIPE_TOP_LEVEL
from posttrain.config.trl_defaults import COMMON_DEFAULTS, TRAINER_CONFIGS, TRL_DEFAULTS, TRL_VERSION
from posttrain.config.trl_rewards import REWARD_KEYS, rewards_from_trl
from posttrain.config.trl_table import IGNORED, REFUSED, changes_nothing
from posttrain.errors import UserError


class NoEffect(Exception):
    """A conversion's answer: the value is accepted and has no effect here, for the reason in the message."""


def _flag(value_if_true: str) -> Callable[[Any], Any]:
    """A TRL boolean that selects a value here (bf16: true -> mixed_precision: bf16); false leaves the default."""
    def convert(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value_if_true if value else None
    return convert


def _strategy(what: str, key: str, no: str | int) -> Callable[[Any], Any]:
    """TRL's eval/save/logging_strategy: `steps` is how posttrain works (every `key` steps), `no` is the value `no`
    (an int), or has no effect (`no` says why), `epoch` and `best` do not exist here."""
    def convert(value: Any) -> Any:
        if value == "steps":
            return None
        if value == "no" or value is False:  # a YAML file's bare `no` is false
            if isinstance(no, int):
                return no
            raise NoEffect(no)
        raise ValueError(f"{value!r} is not available: {what} every train.{key} steps here (set it to the steps of "
                         "an epoch)")
    return convert


def _optim(value: Any) -> Any:
    """TRL's optim -> train.fused_optimizer: AdamW is the one optimiser here, fused or not."""
    choices = {"adamw_torch_fused": True, "adamw_torch": False}
    if value not in choices:
        raise ValueError(f"{value!r} is not available: the optimiser is AdamW (adamw_torch_fused, the default, or "
                         "adamw_torch; train.fused_optimizer)")
    return choices[value]


def _one_loss(value: Any) -> Any:
    """DPOConfig's loss_type is a list in TRL 1.x (several losses mixed by loss_weights); one at a time here."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{list(value)}: one loss at a time here (algo.loss_type; TRL's loss_weights mix several)")
        return value[0]
    return value


# TRL keys spelled as here, by recipe section (train: transformers' TrainingArguments)
SAME_NAMES = {
    "model": "attn_implementation trust_remote_code router_aux_loss_coef",
    "data": "max_length max_prompt_length packing completion_only_loss assistant_only_loss",
    "train": "per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps learning_rate "
             "weight_decay adam_beta1 adam_beta2 adam_epsilon lr_scheduler_type warmup_steps warmup_ratio max_steps "
             "num_train_epochs max_grad_norm gradient_checkpointing logging_steps eval_steps save_steps "
             "save_total_limit resume_from_checkpoint overwrite_output_dir ddp_timeout report_to",
    "generation": "max_completion_length temperature top_p top_k",
    "algo": "beta loss_type label_smoothing rpo_alpha simpo_gamma center_rewards_coefficient num_generations epsilon "
            "epsilon_high scale_rewards num_iterations importance_sampling_level mask_truncated_completions kl_coef "
            "kl_estimator gamma lam missing_eos_penalty vllm_importance_sampling_mode",
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
    "cast_lm_head_to_fp32": "model.lm_head_fp32",
    # data
    "dataset_name": "data.train", "dataset_train_split": "data.train_split", "dataset_test_split": "data.eval_split",
    "dataset_num_proc": "data.num_proc", "max_seq_length": "data.max_length", "padding_free": "data.packing",
    "dataset_text_field": "data.text_field",
    # run and optimiser (transformers' TrainingArguments)
    "bf16": "train.mixed_precision", "fp16": "train.mixed_precision", "data_seed": "train.dataloader_seed",
    "run_name": "train.run_name", "project": "train.project", "optim": "train.fused_optimizer",
    "eval_strategy": "train.eval_steps", "save_strategy": "train.save_steps", "logging_strategy": "train.logging_steps",
    # generation (GRPOConfig, PPOConfig)
    "response_length": "generation.max_completion_length", "generation_batch_size": "generation.batch_size",
    "use_vllm": "generation.engine", "vllm_gpu_memory_utilization": "generation.vllm.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "generation.vllm.tensor_parallel_size",
    "vllm_enable_sleep_mode": "generation.vllm.enable_sleep_mode",
    "vllm_max_model_length": "generation.vllm.max_model_len",
    # the algorithm's own knobs (DPOConfig, GRPOConfig, RewardConfig, PPOConfig)
    "vllm_importance_sampling_correction": "algo.vllm_is_correction",
    "vllm_importance_sampling_cap": "algo.vllm_is_cap", "precompute_ref_log_probs": "algo.precompute_ref_logprobs",
    "vllm_importance_sampling_clip_max": "algo.vllm_is_cap", "max_tool_calling_iterations": "agent.max_turns",
    "vllm_importance_sampling_clip_min": "algo.vllm_is_min",
    "cliprange": "algo.epsilon", "cliprange_value": "algo.value_clip", "num_ppo_epochs": "algo.ppo_epochs",
    "value_model_path": "algo.critic_model_name_or_path",
    # distillation (DistillationConfig; GKDConfig of trl.experimental.gkd: lmbda, max_new_tokens)
    "teacher_model_name_or_path": "algo.teacher_model_name_or_path",
    "teacher_model_revision": "algo.teacher_model_revision", "lmbda": "algo.lmbda",
    "max_new_tokens": "generation.max_completion_length",
}
# TRL values spelled otherwise here (a lone report_to: wandb needs none: a recipe's list key takes one string);
# scale_rewards is true/false in older TRL, group/batch/none in newer
CONVERSIONS: dict[str, Callable[[Any], Any]] = {
    "bf16": _flag("bf16"), "fp16": _flag("fp16"), "use_vllm": _flag("vllm"), "padding_free": _flag(True),
    "scale_rewards": lambda value: {True: "group", False: "none"}[value] if isinstance(value, bool) else value,
    "eval_strategy": _strategy("evaluate", "eval_steps", "evaluation runs exactly when data.eval is given: leave it "
                               "out for none"),
    "save_strategy": _strategy("save", "save_steps", 0),  # save_steps 0: no checkpoint, only final/ (and one when a
                                                          # run is stopped, so it can be continued)
    "logging_strategy": _strategy("log", "logging_steps", "metrics.jsonl gets a row every logging_steps steps"),
    "optim": _optim, "loss_type": _one_loss,
    "max_tool_calling_iterations": lambda value: value + 1 if isinstance(value, int) else value}  # + the answer turn
# Where a command has no such recipe key, these values mean what it does anyway (SFTConfig's loss_type: nll)
SAME_AS_HERE: dict[str, tuple[Any, ...]] = {"loss_type": ("nll",)}
# elsewhere TRL's None means "unset": the recipe's default stays (max_tool_calling_iterations None: no turn limit)
NONE_IS_A_VALUE = ("train.save_total_limit", "agent.max_turns")
NONE_MEANS = {"lora_target_modules": []}  # TRL's None: PEFT's modules for the architecture, the recipe's []
TRL_KEYS: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
    key: (path, CONVERSIONS.get(key)) for key, path in TRL_RENAMES.items()}  # key -> (recipe key, conversion)



@dataclasses.dataclass(frozen=True)
class AnyAlgo:
    """translate's stand-in for an algorithm config not imported yet (check_flags_early): every algo.* key passes."""


def check_flags_early(flags: dict[str, Any], command: str) -> None:
    """Refuse a command line's TRL flags for all that needs no algorithm's own keys (listing those imports torch):
    unknown and refused keys, bad values, two flags for one key. Quick, so a typo is refused in a second."""
    translate(flags, "command line", AnyAlgo, "--", command=command, quiet=True)


def translate(flat: dict[str, Any], where: str, algo_cls: type, shown: str = "", command: str = "",
              quiet: bool = False) -> list[tuple[str, str, Any]]:
    """TRL keys and their values -> [(TRL key, recipe key, value)]. Keys with no effect here get one note line each
    (none when `quiet`); every key refused, unknown, or landing on a recipe key another key also sets is reported at
    once, as `shown` + key (shown='--' for command-line flags)."""
    valid_keys = {k.path for k in recipe_keys(algo_cls)}
    if algo_cls is AnyAlgo:
        valid_keys |= {path for path, _ in TRL_KEYS.values() if path.startswith("algo.")}
    command = command or command_of(algo_cls)
    flat = dict(flat)
    rewards, problems = rewards_from_trl(flat, shown)  # reward_funcs, reward_weights, ... make one list together
    out, notes = ([("reward_funcs", "rewards", rewards)] if rewards is not None else []), []
    for key, value in flat.items():
        if key in IGNORED or key in REFUSED:
            harmless, text = IGNORED.get(key) or REFUSED[key]
            if not changes_nothing(value, harmless):
                if key in IGNORED:
                    notes.append(f"{shown}{key} has no effect here: {text}")
                else:
                    problems.append(f"{shown}{key}: {text}")
            continue
        if key not in TRL_KEYS:
            unknown = "neither a TRL key posttrain knows nor a recipe key"
            problems.append(f"{shown}{key}: {closest(key, valid_keys, shown) or unknown}")
            continue
        path, convert = TRL_KEYS[key]
        if key.startswith("vllm_") and flat.get("use_vllm") is False:
            continue  # TRL reads its vllm_* keys only with use_vllm (a whole TRL config holds them all)
        if path not in valid_keys:
            if not changes_nothing(value, SAME_AS_HERE.get(key, ())):
                problems.append(f"{shown}{key}: posttrain's {path}, which `posttrain {command}` does not take")
            continue
        if value is None and key in NONE_MEANS:
            value = NONE_MEANS[key]
        try:
            value = convert(value) if convert and value is not None else value
        except NoEffect as e:
            notes.append(f"{shown}{key} {'no' if value is False else value} has no effect here: {e}")
            continue
        except ValueError as e:
            problems.append(f"{shown}{key}: {e}")
            continue
        if value is not None or path in NONE_IS_A_VALUE:
            out.append((key, path, value))
    for i, (key, path, value) in enumerate(out):  # two TRL keys for one recipe key
        other = next(((k, v) for k, p, v in out[:i] if p == path and v != value), None)
        if other:
            problems.append(f"{shown}{other[0]} ({other[1]!r}) and {shown}{key} ({value!r}) both set {path}; keep one")
    if problems:
        raise UserError(f"{where}: {len(problems)} key{'s' if len(problems) > 1 else ''} refused:\n  "
                        + "\n  ".join(problems) + f"\n`posttrain {command} --help` lists every key; docs/trl.md "
                        "maps TRL's keys to posttrain's")
    for note in notes if not quiet else ():
        say(f"{where}: {note}")
    return [item for i, item in enumerate(out) if all(p != item[1] for _, p, _ in out[:i])]


def command_of(algo_cls: type) -> str:
    """GRPOAlgoConfig -> grpo: the command an algorithm's config belongs to."""
    return algo_cls.__name__.removesuffix("AlgoConfig").lower()


def flat_trl_keys(raw: dict) -> dict:
    """A recipe file's flat TRL keys: those that are not recipe sections (none in a posttrain recipe)."""
    return {k: v for k, v in raw.items()
            if k not in RECIPE_TOP_LEVEL or (k in ("model", "data", "train") and not isinstance(v, dict))}


def trl_defaults(command: str) -> dict[str, Any]:
    """TRL key -> TRL's default, where it differs from posttrain's, for `command` ({} where TRL has no trainer)."""
    return {**TRL_DEFAULTS[command], **COMMON_DEFAULTS} if command in TRL_DEFAULTS else {}


def trl_paths(flat: dict) -> set[str]:
    """The recipe keys TRL keys choose, whatever their values (bf16: false chooses train.mixed_precision)."""
    return {TRL_KEYS[key][0] for key in flat if key in TRL_KEYS} | {"rewards" for key in flat if key in REWARD_KEYS}


def eval_every_logging_step(flat: dict, raw: dict, where: str) -> None:
    """TRL's `eval_strategy steps` with eval_steps unset (or 0) evaluates every logging_steps (transformers'
    TrainingArguments.__post_init__): so here, when no key of the run sets train.eval_steps (a recipe's 0 included)."""
    from posttrain.config.schema import TrainConfig

    train = raw.get("train")
    if flat.get("eval_strategy") != "steps" or not isinstance(train if train is not None else {}, dict):
        return
    train = raw.setdefault("train", {})
    if train.get("eval_steps"):
        return
    train["eval_steps"] = train.get("logging_steps", TrainConfig.logging_steps)
    say(f"{where}: eval_strategy steps without eval_steps: evaluation every logging_steps "
        f"({train['eval_steps']}) steps, as in TRL")


def trl_default_settings(algo_cls: type, given_paths: set[str], use_vllm: bool) -> list[tuple[str, str, Any]]:
    """[(TRL key, recipe key, value)]: TRL's default for every recipe key a run given in TRL's words leaves out
    (`given_paths`: the recipe keys it sets) where TRL's differs from posttrain's. `use_vllm`: whether the run
    generates with vLLM (TRL reads its vllm_* defaults only then)."""
    defaults = trl_defaults(command_of(algo_cls))
    chosen = {key: value for key, value in defaults.items() if TRL_KEYS[key][0] not in given_paths}
    return [item for item in translate({**chosen, "use_vllm": use_vllm}, "TRL's defaults", algo_cls)
            if item[1] not in given_paths]


def trl_defaults_line(algo_cls: type, settings: list[tuple[str, str, Any]]) -> str:
    """The run header's line that says which settings came from TRL's defaults (TRL key=value -> recipe key)."""
    command = command_of(algo_cls)
    if command not in TRAINER_CONFIGS:
        return (f"posttrain: `posttrain {command}` has no TRL {TRL_VERSION} trainer: what this run in TRL's words "
                "leaves out keeps posttrain's defaults (docs/trl.md)")
    said = ", ".join(f"{key}={yaml_text(trl_defaults(command)[key])}" for key, _, _ in settings) or "none differ"
    return (f"posttrain: TRL {TRL_VERSION} {TRAINER_CONFIGS[command]} defaults for what this run in TRL's words leaves "
            f"out: {said} (docs/trl.md)")


def whose_defaults(algo_cls: type) -> str:
    """For the run's header: whose defaults filled what a run in TRL's words left out."""
    command = command_of(algo_cls)
    return f"TRL {TRL_VERSION} {TRAINER_CONFIGS[command]}" if command in TRAINER_CONFIGS else "posttrain"


def say_trl_defaults(algo_cls: type, settings: list[tuple[str, str, Any]], lora: bool) -> None:
    """The header line of trl_defaults_line on stdout, from rank 0 (before the run's own header); LoRA's settings
    only for a LoRA run (config.yaml has them all)."""
    if os.environ.get("RANK", "0") == "0":
        shown = [item for item in settings if lora or not item[1].startswith("model.lora.")]
        print(trl_defaults_line(algo_cls, shown), flush=True)


def say(message: str) -> None:
    """One note line on stderr, from rank 0 only (every rank reads the same config)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"posttrain: note: {message}", file=sys.stderr, flush=True)


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
    flat = flat_trl_keys(raw)
    if not flat:
        return raw
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items() if k not in flat}
    for key, path, value in translate(flat, where, algo_cls):
        section, _, leaf = path.rpartition(".")
        given = out.get(section, {}) if section else out
        if isinstance(given, dict) and leaf in given and given[leaf] != value:
            raise UserError(f"{where}: {key} ({value!r}) and {path} ({given[leaf]!r}) both set {path}; keep one")
        set_dotted(out, path, value, f"'{path}'")
    return out


def as_override(path: str, value: Any) -> str:
    """(train.learning_rate, 1e-4) -> 'train.learning_rate=0.0001', read back as the same value."""
    return f"{path}={yaml_text(value)}"


def yaml_text(value: Any) -> str:
    """A value as one line of YAML that reads back as the same value (1e-06, true, [a, b])."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()
