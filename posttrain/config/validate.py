"""Range and consistency checks on a built recipe, run before anything heavy is loaded."""

from __future__ import annotations

import dataclasses

from posttrain.config.schema import Recipe
from posttrain.errors import UserError

CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "train.lr_scheduler_type": ("constant", "linear", "cosine"),
    "train.mixed_precision": ("no", "bf16", "fp16"),
    "generation.engine": ("hf", "vllm", "server"),
    "train.nonfinite": ("stop", "skip"),
    "generation.vllm.placement": ("rank", "node"),
    "generation.vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "launcher": ("local", "ray"),
}
POSITIVE = (
    "train.per_device_train_batch_size",
    "train.per_device_eval_batch_size",
    "train.gradient_accumulation_steps",
    "train.learning_rate",
    "train.logging_steps",
    "train.num_train_epochs",
    "data.max_length",
    "generation.max_completion_length",
    "train.ddp_timeout",
    "generation.sync_every",
    "generation.sync_bucket_mb",
    "generation.vllm.tensor_parallel_size",
    "generation.request_timeout",
    "placement.cpus_per_worker",
    "placement.generation.tensor_parallel_size",
    "rollout.max_turns",
    "rollout.tool_timeout",
    "rollout.tool_max_output_chars",
    "rollout.tool_workers",
)
NON_NEGATIVE = ("train.weight_decay", "train.warmup_steps", "train.max_grad_norm", "train.save_steps", "train.eval_steps",
                "train.max_nonfinite_skips", "generation.request_retries", "placement.generation.num_engines")
PLACED_ROLES = ("policy", "reference", "critic", "reward_model")  # algorithms.base.ROLE_NAMES; config stays torch-free


def get(recipe: Recipe, dotted: str):
    value = recipe
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(recipe: Recipe) -> None:
    for key, choices in CHOICES.items():
        if get(recipe, key) not in choices:
            raise UserError(f"{key} is {get(recipe, key)!r}; choose one of {', '.join(choices)}")
    for key in POSITIVE:
        if not get(recipe, key) > 0:
            raise UserError(f"{key} must be > 0, got {get(recipe, key)!r}")
    for key in NON_NEGATIVE:
        if get(recipe, key) < 0:
            raise UserError(f"{key} must be >= 0, got {get(recipe, key)!r}")
    t = recipe.train
    if not 0.0 <= t.warmup_ratio < 1.0:
        raise UserError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    if t.max_steps == 0 or t.max_steps < -1:
        raise UserError(f"train.max_steps must be a positive number of steps or -1 (use num_train_epochs), got {t.max_steps}")
    if t.save_total_limit is not None and t.save_total_limit < 1:
        raise UserError(f"train.save_total_limit must be >= 1 or null, got {t.save_total_limit}")
    if t.resume_from_checkpoint is not None and t.overwrite_output_dir:
        raise UserError("train.resume_from_checkpoint and train.overwrite_output_dir conflict: resume keeps the run, overwrite discards it; pick one")
    if not recipe.data.train:
        raise UserError("data.train is empty: give a .jsonl/.json/.parquet/.csv file, a save_to_disk directory or a hub dataset name")
    if recipe.data.max_prompt_length is not None and recipe.data.max_prompt_length <= 0:
        raise UserError(f"data.max_prompt_length must be > 0 or null, got {recipe.data.max_prompt_length}")
    g = recipe.generation
    if g.temperature < 0 or not 0 < g.top_p <= 1 or g.top_k < 0:
        raise UserError(f"generation: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {g.temperature}, {g.top_p}, {g.top_k}")
    if not 0 < g.vllm.gpu_memory_utilization <= 1:
        raise UserError(f"generation.vllm.gpu_memory_utilization must be in (0, 1], got {g.vllm.gpu_memory_utilization}")
    check_servers_listed(g)
    if g.async_ and g.engine == "hf":
        raise UserError("generation.async samples the next batch while this one trains, which needs an engine with "
                        "its own copy of the weights: set generation.engine=vllm or server, or generation.async=false")
    if g.async_ and g.vllm.enable_sleep_mode:
        raise UserError("generation.async keeps the engine generating during training, so "
                        "generation.vllm.enable_sleep_mode (free its memory while training) cannot apply; drop one")
    if g.engine == "vllm" and g.vllm.placement == "node" and recipe.launcher == "ray":
        raise UserError("generation.vllm.placement=node starts an engine beside each node's first rank, which Ray "
                        "confines to that rank's GPUs; under launcher: ray, give engines GPUs of their own with "
                        "placement.generation.num_engines (docs/ray.md)")
    for i, r in enumerate(recipe.rewards):
        if not r.name:
            raise UserError(f"rewards[{i}].name is empty: name a built-in reward or an import path module:function")
        if r.on_error not in ("raise", "skip"):
            raise UserError(f"rewards[{i}].on_error must be raise or skip, got {r.on_error!r}")
    validate_placement(recipe.placement)
    check_algo = getattr(recipe.algo, "validate", None)
    if check_algo is not None:
        check_algo(recipe)
    if dataclasses.is_dataclass(recipe.model.lora) and recipe.model.lora.enabled and recipe.model.lora.r <= 0:
        raise UserError(f"model.lora.r must be > 0, got {recipe.model.lora.r}")


def check_servers_listed(g) -> None:
    """generation.servers: given exactly when engine=server, each an http(s)://host:port URL, none twice."""
    from urllib.parse import urlsplit

    if g.engine != "server":
        if g.servers:
            raise UserError(f"generation.servers is set but generation.engine is {g.engine!r}; set "
                            "generation.engine=server to generate on them, or drop generation.servers")
        return
    if not g.servers:
        raise UserError("generation.engine=server needs generation.servers: a list of `posttrain serve` URLs, "
                        "e.g. generation.servers='[http://127.0.0.1:8000]'")
    for i, url in enumerate(g.servers):
        parts = urlsplit(str(url))
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path not in ("", "/"):
            raise UserError(f"generation.servers[{i}] = {url!r} is not a server URL; write http://host:port (the "
                            "address `posttrain serve` prints)")
    if len(set(g.servers)) != len(g.servers):
        raise UserError(f"generation.servers lists a server twice: {list(g.servers)}")


def validate_placement(placement) -> None:
    """What a placement can get wrong without looking at a cluster (posttrain/distributed/ray_placement.py checks
    it against one)."""
    for role in PLACED_ROLES:
        spec = getattr(placement, role)
        for key in ("num_nodes", "num_gpus_per_node"):
            if getattr(spec, key) is not None and getattr(spec, key) < 1:
                raise UserError(f"placement.{role}.{key} must be >= 1 or null, got {getattr(spec, key)}")
        if spec.gpu_fraction is not None and not 0 < spec.gpu_fraction <= 1:
            raise UserError(f"placement.{role}.gpu_fraction must be in (0, 1], got {spec.gpu_fraction}")
    seen: dict[str, int] = {}
    for i, group in enumerate(placement.colocate or ()):
        if len(group) < 2:
            raise UserError(f"placement.colocate[{i}] is {list(group)}: each group lists 2 or more roles, "
                            "e.g. colocate: [[policy, reference], [critic, reward_model]]")
        for role in group:
            if role not in PLACED_ROLES:
                raise UserError(f"placement.colocate[{i}]: unknown role {role!r}; roles: {', '.join(PLACED_ROLES)}")
            if role in seen:
                raise UserError(f"placement.colocate: {role} is in groups {seen[role]} and {i}; a role shares GPUs "
                                "with one group only")
            seen[role] = i
        fractions = [getattr(placement, role).gpu_fraction for role in group]
        if all(f is not None for f in fractions) and sum(fractions) > 1 + 1e-9:
            raise UserError(f"placement.colocate[{i}] {list(group)}: gpu_fraction adds up to {sum(fractions):g} > 1")
    alone = [r for r in PLACED_ROLES if r not in seen and placement.colocate is not None]
    for role in alone:
        fraction = getattr(placement, role).gpu_fraction
        if fraction is not None and fraction < 1:
            raise UserError(f"placement.{role}.gpu_fraction is {fraction} but {role} shares its GPUs with no role; "
                            f"name it in placement.colocate or drop gpu_fraction")
