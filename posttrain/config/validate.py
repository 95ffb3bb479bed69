"""Range and consistency checks on a built recipe, run before anything heavy is loaded."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math
import os
from urllib.parse import urlsplit

from posttrain.config.schema import ALL_LINEAR, Recipe, partial_chunk, trackers
from posttrain.errors import UserError, overflows_float32

CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "train.export_dtype": ("auto", "float32", "bfloat16", "float16"),
    "train.lr_scheduler_type": ("constant", "linear", "cosine"), "train.mixed_precision": ("no", "bf16", "fp16"),
    "generation.engine": ("hf", "vllm"), "generation.placement": ("colocated", "node", "servers", "ray"),
    "generation.lora_sync": ("merged", "adapter"), "train.nonfinite": ("stop", "skip"),
    "generation.vllm.dtype": ("auto", "float32", "bfloat16", "float16"), "launcher": ("local", "ray"),
}
POSITIVE = (
    "train.per_device_train_batch_size", "train.sequence_parallel_size", "train.per_device_eval_batch_size", "train.gradient_accumulation_steps",
    "train.learning_rate", "train.logging_steps", "train.num_train_epochs", "data.max_length",
    "generation.max_completion_length", "train.ddp_timeout", "generation.sync_every", "generation.sync_bucket_mb",
    "generation.vllm.tensor_parallel_size", "generation.request_timeout_s", "generation.sync_timeout_s",
    "placement.cpus_per_worker", "placement.generation.tensor_parallel_size",
    "agent.tool_timeout", "agent.tool_max_output_chars", "agent.tool_workers", "agent.user_code_timeout",
)
POSITIVE_OR_NULL = ("agent.max_turns",)  # null: no limit of its own (agent.max_turns: the completion budget bounds it)
NON_NEGATIVE = ("train.weight_decay", "train.warmup_steps", "train.max_grad_norm", "train.save_steps", "train.eval_steps",
                "train.max_nonfinite_skips", "generation.request_retries", "placement.generation.num_engines")
PLACED_ROLES = ("policy", "reference", "critic", "reward_model", "teacher")  # algorithms.base.ROLE_NAMES; config stays torch-free
# train.report_to: each is the module posttrain/report/trackers.py imports to write to it, and its pip package
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # = trackers.TRACKERS (tests/unit/test_trackers.py)
# MLflow's database stores (its default since 3.x is sqlite:///mlflow.db) need SQLAlchemy and Alembic, which full
# mlflow brings and mlflow-skinny does not
MLFLOW_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def get(recipe: Recipe, dotted: str):
    return functools.reduce(getattr, dotted.split("."), recipe)


def check_finite(node, where: str = "") -> None:
    """Every number of the recipe, at any depth (algo and rewards included), is a number that float32 holds: NaN compares false with every bound (`max_grad_norm: .nan` silently turned clipping off), inf overflows
    deadlines and schedules, and 1e39 (finite as a Python float) is inf in the float32 tensors rewards, weights and
    losses are computed in (`--reward_weights 1e39` zeroed every advantage, rc 0). A reward's kwargs are its own: the
    built-ins check theirs (rewards/builtin.py)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            check_finite(getattr(node, f.name), f"{where}.{f.name}" if where else f.name)
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            check_finite(item, f"{where}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise UserError(f"{where} is {node}; give a finite number")
    elif isinstance(node, (int, float)) and not isinstance(node, bool) and overflows_float32(node):
        raise UserError(f"{where} is {node:.3g}, beyond the largest float32 (3.4e+38): it would be inf in the float32 "
                        "tensors it is computed in; give a smaller number")


def validate(recipe: Recipe) -> None:
    check_finite(recipe)
    for key, choices in CHOICES.items():
        if get(recipe, key) not in choices:
            raise UserError(f"{key} is {get(recipe, key)!r}; choose one of {', '.join(choices)}")
    for key in POSITIVE:
        if not get(recipe, key) > 0:
            raise UserError(f"{key} must be > 0, got {get(recipe, key)!r}")
    for key in POSITIVE_OR_NULL:
        if get(recipe, key) is not None and not get(recipe, key) > 0:
            raise UserError(f"{key} must be > 0, got {get(recipe, key)!r} (null: no limit of its own)")
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
    if t.shared_prefix not in (True, False, "auto"):
        raise UserError(f"train.shared_prefix is {t.shared_prefix!r}; choose auto, true or false")
    if t.max_tokens_per_microbatch is not None and t.max_tokens_per_microbatch <= 0:
        raise UserError(f"train.max_tokens_per_microbatch must be a number of tokens > 0, or null (micro-batches of "
                        f"per_device_train_batch_size rows), got {t.max_tokens_per_microbatch}")
    if t.export_dtype != "auto" and not t.save_final_model:
        raise UserError(f"train.export_dtype={t.export_dtype} is the dtype of final/, but train.save_final_model=false "
                        "writes no final/; drop one")
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
    check_placement(recipe)
    check_fp32_head(recipe)
    check_servers_listed(g)
    check_lora_sync(recipe)
    if g.max_staleness < 0:
        raise UserError(f"generation.max_staleness must be >= 0 (generation batches sampled ahead), got "
                        f"{g.max_staleness}")
    if g.max_staleness and g.engine == "hf":
        raise UserError(f"generation.max_staleness={g.max_staleness} (generation.async) samples the next batches while "
                        "this one trains, which needs an engine with its own copy of the weights: set "
                        "generation.engine=vllm, or generation.max_staleness=0")
    if g.max_staleness and g.vllm.enable_sleep_mode:
        raise UserError(f"generation.max_staleness={g.max_staleness} (generation.async) keeps the engine generating "
                        "during training, so generation.vllm.enable_sleep_mode (free its memory while training) "
                        "cannot apply; drop one")
    check_partial_rollouts(recipe)
    for i, r in enumerate(recipe.rewards):
        if not r.name:
            raise UserError(f"rewards[{i}].name is empty: name a built-in reward or an import path module:function")
        if r.on_error not in ("raise", "skip"):
            raise UserError(f"rewards[{i}].on_error must be raise or skip, got {r.on_error!r}")
        check_overlong_reaches(recipe, i)
    validate_placement(recipe.placement)
    check_trackers(t)
    check_pass_k(recipe)
    check_algo = getattr(recipe.algo, "validate", None)
    if check_algo is not None:
        check_algo(recipe)
    if recipe.model.lora.enabled and recipe.model.lora.r <= 0:
        raise UserError(f"model.lora.r must be > 0, got {recipe.model.lora.r}")
    targets = recipe.model.lora.target_modules
    if ALL_LINEAR in targets and len(targets) > 1:
        raise UserError(f"model.lora.target_modules {list(targets)}: {ALL_LINEAR} names every linear layer already; "
                        "give it alone or list module names")
    if recipe.model.router_aux_loss_coef is not None and recipe.model.router_aux_loss_coef < 0:
        raise UserError(f"model.router_aux_loss_coef must be >= 0, got {recipe.model.router_aux_loss_coef}")


def check_partial_rollouts(recipe: Recipe) -> None:
    """generation.partial_rollouts and its settings, before any model loads: it continues the batches sampled ahead
    across syncs, so it needs some (max_staleness >= 1, which the hf engine refuses: it samples with the policy
    itself, never synced); its settings cannot act without it."""
    g = recipe.generation
    settings = {"partial_chunk_tokens": g.partial_chunk_tokens, "partial_chunks_per_batch": g.partial_chunks_per_batch,
                "partial_max_versions": g.partial_max_versions or None}
    if not g.partial_rollouts:
        given = [f"generation.{k}={v}" for k, v in settings.items() if v is not None]
        if given:
            raise UserError(f"{given[0]} shapes partial rollouts, which are off: set generation.partial_rollouts=true, "
                            "or drop it")
        return
    if g.max_staleness < 1:
        raise UserError("generation.partial_rollouts=true continues generations sampled ahead of training across a "
                        "weight sync, and generation.max_staleness=0 samples none ahead: set "
                        "generation.max_staleness=1 (or more), or generation.partial_rollouts=false")
    if recipe.agent.enabled:
        raise UserError("generation.partial_rollouts=true is not built for multi-turn rollouts (agent.tools / "
                        "agent.environment): a trajectory's turns are sampled whole; set generation.partial_rollouts="
                        "false")
    for key in ("partial_chunk_tokens", "partial_chunks_per_batch"):
        if settings[key] is not None and settings[key] < 1:
            raise UserError(f"generation.{key} must be >= 1 (or null), got {settings[key]}")
    chunk, _ = partial_chunk(g)
    if chunk >= g.max_completion_length:
        raise UserError(f"generation.partial_chunk_tokens={chunk} samples every completion in one chunk "
                        f"(generation.max_completion_length={g.max_completion_length}), so none can continue across a "
                        "sync: lower it (or raise max_completion_length)")
    if g.partial_max_versions < 0:
        raise UserError(f"generation.partial_max_versions must be >= 0 (0: no cap), got {g.partial_max_versions}")


def check_overlong_reaches(recipe: Recipe, i: int) -> None:
    """An `overlong` reward whose penalty starts (kwargs.max_length - buffer tokens) at or beyond the longest
    completion generation makes (generation.max_completion_length) can never apply: refused. A multi-turn run's
    completions are bounded elsewhere (agent:), so it is not checked there."""
    r, cap = recipe.rewards[i], recipe.generation.max_completion_length
    max_length, buffer = r.kwargs.get("max_length"), r.kwargs.get("buffer")
    if r.name != "overlong" or recipe.agent.enabled or not all(type(v) is int for v in (max_length, buffer)):
        return  # the reward's own check names wrong kinds
    if max_length - buffer >= cap:
        raise UserError(f"rewards[{i}] overlong: its penalty starts past kwargs.max_length - kwargs.buffer = "
                        f"{max_length - buffer} tokens, but generation.max_completion_length={cap} ends every "
                        f"completion before that, so it can never apply; set kwargs.max_length={cap} (the cap it "
                        "is meant to approach)")


def check_pass_k(recipe: Recipe) -> None:
    """train.eval_pass_k: positive ks, enough samples for the largest, and sampling that is not greedy (n greedy
    completions are one completion n times)."""
    t = recipe.train
    if not t.eval_pass_k:
        if t.eval_pass_k_samples:
            raise UserError("train.eval_pass_k_samples is set but train.eval_pass_k is empty; list the ks, e.g. "
                            "train.eval_pass_k=[1,4,16]")
        return
    if any(k < 1 for k in t.eval_pass_k):
        raise UserError(f"train.eval_pass_k must list ks >= 1, got {list(t.eval_pass_k)}")
    if t.eval_pass_k_samples and t.eval_pass_k_samples < max(t.eval_pass_k):
        raise UserError(f"train.eval_pass_k_samples={t.eval_pass_k_samples} is below the largest k "
                        f"({max(t.eval_pass_k)}): pass@k needs n >= k samples per prompt; raise it or set 0 (= max k)")
    if recipe.generation.temperature == 0:
        raise UserError("train.eval_pass_k samples several completions per eval prompt, but generation.temperature "
                        "is 0 (greedy: every sample is the same); set generation.temperature > 0")


VLLM_MAX_LORA_RANK = 512  # the largest max_lora_rank vLLM accepts


def check_lora_sync(recipe: Recipe) -> None:
    """generation.lora_sync=adapter: a LoRA policy, generated by vLLM servers (the in-process engine and hf have no
    adapter to load: merged is their only way), a rank vLLM serves, a positive probe tolerance."""
    g, lora = recipe.generation, recipe.model.lora
    if g.lora_sync != "adapter":
        return
    if not lora.enabled:
        raise UserError("generation.lora_sync=adapter sends the LoRA adapters alone, but model.lora.enabled is false: "
                        "set model.lora.enabled=true, or generation.lora_sync=merged")
    if g.engine != "vllm" or g.placement == "colocated":
        raise UserError(f"generation.lora_sync=adapter needs vLLM servers (generation.placement=servers, node or ray), "
                        f"got engine={g.engine} placement={g.placement}, which takes merged weights only: set "
                        "generation.lora_sync=merged")
    if lora.r > VLLM_MAX_LORA_RANK:
        raise UserError(f"generation.lora_sync=adapter: model.lora.r={lora.r} is above vLLM's largest LoRA rank "
                        f"({VLLM_MAX_LORA_RANK}); lower it, or use generation.lora_sync=merged")
    if not g.lora_check_atol > 0:
        raise UserError(f"generation.lora_check_atol must be > 0, got {g.lora_check_atol}")


def check_fp32_head(recipe: Recipe) -> None:
    """model.lm_head_fp32 on both sides or not at all: the trainer and the in-process vLLM engine (or the policy
    itself, engine hf) can; a server's output layer is set where it starts, which posttrain cannot check."""
    g, model = recipe.generation, recipe.model
    if not model.lm_head_fp32:
        return
    if g.engine == "vllm" and g.placement != "colocated":
        raise UserError(f"model.lm_head_fp32 runs the output layer in float32 on the trainer and in the engine, but "
                        f"generation.placement={g.placement} generates on vLLM servers whose output layer is set where "
                        "they start (vllm serve --hf-overrides '{\"head_dtype\": \"float32\"}'), which posttrain "
                        "cannot check: use generation.placement=colocated, or model.lm_head_fp32=false")
    if model.lora.enabled and "lm_head" in model.lora.target_modules:
        raise UserError("model.lm_head_fp32 with lm_head in model.lora.target_modules: the adapter wraps the output "
                        "layer, which then is no plain float32 layer; remove lm_head from the targets, or set "
                        "model.lm_head_fp32=false")


def check_placement(recipe: Recipe) -> None:
    """generation.placement against the engine and the launcher: the one answer to where generation runs."""
    g, where = recipe.generation, recipe.generation.placement
    if g.engine == "hf" and where != "colocated":
        raise UserError(f"generation.placement={where} runs vLLM apart from the trainer, but generation.engine=hf "
                        "generates with the policy itself in each process: set generation.engine=vllm, or "
                        "generation.placement=colocated")
    if where == "node" and recipe.launcher == "ray":
        raise UserError("generation.placement=node starts an engine beside each node's first rank, which Ray "
                        "confines to that rank's GPUs; under launcher: ray use generation.placement=ray (engines with "
                        "GPUs of their own, placement.generation.num_engines; docs/ray.md)")
    if where == "ray" and recipe.launcher != "ray":
        raise UserError("generation.placement=ray starts the engines as Ray actors: launch with --ray (launcher: ray), "
                        "or use generation.placement=colocated, node or servers")
    if where == "ray" and recipe.placement.generation.num_engines < 1:
        raise UserError("generation.placement=ray needs placement.generation.num_engines >= 1 (how many vLLM engines "
                        "to start as Ray actors)")
    if recipe.train.sequence_parallel_size > 1 and recipe.launcher == "ray":
        raise UserError(f"train.sequence_parallel_size={recipe.train.sequence_parallel_size} with launcher: ray: roles "
                        "served by Ray actor groups run unsharded forwards; launch with torchrun or accelerate launch")
    if where != "ray" and recipe.placement.generation.num_engines and recipe.launcher == "ray":
        raise UserError(f"placement.generation.num_engines={recipe.placement.generation.num_engines} counts Ray "
                        f"engines, but generation.placement={where}: set generation.placement=ray, or drop it")


def check_servers_listed(g) -> None:
    """generation.servers: given exactly when placement=servers, each an http(s)://host:port URL, none twice."""
    if g.placement != "servers":
        if g.servers:
            raise UserError(f"generation.servers is set but generation.placement is {g.placement!r}; set "
                            "generation.placement=servers to generate on them, or drop generation.servers")
        return
    if not g.servers:
        raise UserError("generation.placement=servers needs generation.servers: a list of vLLM server URLs "
                        "(`posttrain serve`), e.g. generation.servers='[http://127.0.0.1:8000]'")
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
    """What a placement can get wrong without looking at a cluster (posttrain/launch/ray_placement.py checks
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


def check_trackers(train) -> None:
    """train.report_to: known names, none alone, and every named tracker installed (found, not imported)."""
    for name in train.report_to:
        if name not in (*TRACKERS, "none"):
            close = difflib.get_close_matches(str(name), list(TRACKERS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"train.report_to: unknown tracker {name!r}; {hint}choose from {', '.join(TRACKERS)}, "
                            "or none")
    if "none" in train.report_to and len(train.report_to) > 1:
        raise UserError(f"train.report_to is {list(train.report_to)}: 'none' means no tracker, so it cannot be "
                        "listed with others; drop 'none' or the others")
    for name in trackers(train):
        if importlib.util.find_spec(name) is None:
            raise UserError(f"train.report_to names {name}, but {name} is not installed; install it with `pip "
                            f"install {name}` (or `pip install 'posttrain[trackers]'` for all four), or drop {name} "
                            "from train.report_to")
        uri = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:")  # unset: sqlite:///<output_dir>/mlflow.db (trackers.py)
        database = uri.split(":", 1)[0].split("+", 1)[0] in MLFLOW_DATABASE_SCHEMES
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if name == "mlflow" and database and missing:
            raise UserError(f"train.report_to names mlflow, whose tracking store {uri!r} (MLFLOW_TRACKING_URI, or "
                            f"MLflow's default sqlite store) needs {' and '.join(missing)}: `pip install sqlalchemy "
                            "alembic` (full mlflow has them; mlflow-skinny does not), or set MLFLOW_TRACKING_URI to "
                            "a server (http://...)")
