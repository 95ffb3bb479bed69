"""The composition root: recipe -> checks -> backend, models, data source, algorithm -> the loop -> export.

Order matters and is deliberate:
  1. everything that can be wrong with the user's input is checked (data parsed and tokenised, model path, output
     directory) before a model is loaded or anything is written;
  2. the backend (process group, DeepSpeed plugin) exists before models are made, so ZeRO-3 can partition them
     at construction;
  3. rank 0 writes; every rank trains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

from transformers import set_seed

from posttrain import data
from posttrain.rundir import claim
from posttrain.agents import check_agent, opening_tools
from posttrain.algorithms import ALGORITHMS
from posttrain.rundir.checkpoint import Checkpointer, export_final, resume_path, run_facts
from posttrain.rundir.files import tree_bytes, warn_low_disk
from posttrain.config.load import dump_yaml
from posttrain.config.schema import Recipe, total_steps, trackers as tracker_names
from posttrain.data import eval_batches
from posttrain.distributed.backend import Backend
from posttrain.distributed.precision import export_dtype, trained_model_config, upcast_trainable
from posttrain.rundir.metrics import MetricsLogger, read_metrics
from posttrain.models import load
from posttrain.models.load import count_parameters, load_tokenizer
from posttrain.models.shared_prefix import resolve_shared_prefix
from posttrain.models.vision import is_vision_model, load_processor
from posttrain.plan import estimated_peak_mb
from posttrain.plan.preflight import check_recipe
from posttrain.roles import build_roles
from posttrain.generation.server import check_servers
from posttrain.online.evaluation import check_answer_columns, evaluate_online
from posttrain.errors import warn
from posttrain.train.guard import Guard
from posttrain.train.optim import warmup_trains_nothing
from posttrain.train.loop import LoopContext, evaluate, train
from posttrain.online.rollout_source import RolloutSource
from posttrain.online.distill_source import DistillSource
from posttrain.train.sources import DatasetSource, Source
from posttrain.train.state import TrainState
from posttrain.report.write import write_report
from posttrain.report.trackers import closing_status, open_trackers, tracked_run


@dataclass
class Launched:
    """What the launch wing started for this run before calling it (launch/ray_launcher.py): roles served by actor
    groups apart from the policy (role name -> a handle whose .as_role(key) is that role's Role) and the URLs of the
    generation engines it placed (generation.placement=ray)."""

    roles: dict = field(default_factory=dict)
    servers: tuple[str, ...] = ()


@dataclass
class RunResult:
    output_dir: Path
    final_dir: Optional[Path]
    steps: int
    metrics: list[dict[str, Any]]


def make_source(recipe: Recipe, backend, models, algorithm, examples, collate, servers, processor=None,
                shared_prefix: bool = False) -> Source:
    """The source of the loop's micro-batches, by algorithm.source_kind (processor: a vision-language model's)."""
    if algorithm.source_kind == "rollout":
        return RolloutSource(recipe, backend, models, algorithm, examples, algorithm.rewards, servers, processor,
                             shared_prefix)
    if algorithm.source_kind == "distill":
        return DistillSource(recipe, backend, models, examples, algorithm.config.lmbda, servers)
    return DatasetSource.from_recipe(recipe, backend, examples, collate)


def load_examples(recipe: Recipe, algorithm, tokenizer, which: str, processor=None):
    """Rows -> tokenised examples for the algorithm's data kind; raises UserError naming the file/row. processor: a
    vision-language model's, which reads the rows' images (data/images.py)."""
    source = getattr(recipe.data, which)
    rows = data.load_rows(source, getattr(recipe.data, f"{which}_split"), f"data.{which}",
                          held_out_from=recipe.data.train if which == "eval" else None)
    rows = data.rename_text_field(rows, recipe.data.text_field, f"data.{which}")
    images = data.RowImages.of(rows, processor, source, f"data.{which}")
    if algorithm.data_kind == "prompt":  # a multi-turn rollout's prompts show its tools: cut and counted here
        return data.tokenize_prompts(rows, tokenizer, recipe.data, f"data.{which}", opening_tools(recipe.agent),
                                     images=images)
    tokenize = {"sft": data.tokenize_sft, "preference": data.tokenize_preference}
    return tokenize[algorithm.data_kind](rows, tokenizer, recipe.data, f"data.{which}", images=images)


def make_collate(recipe: Recipe, algorithm, tokenizer, processor=None):
    """examples -> Batch for the algorithm's data kind; with a processor, the rows' images ride along (a preference
    pair's chosen and rejected rows share theirs)."""
    pad_id = tokenizer.pad_token_id
    if algorithm.data_kind == "preference":
        collate = partial(data.collate_preference, pad_id=pad_id)
    elif recipe.data.packing and recipe.train.max_tokens_per_microbatch is None:  # else padding-free, regrouped
        collate = partial(data.collate_packed, row_length=recipe.data.max_length, pad_id=pad_id)
    else:
        collate = partial(data.collate_padded, pad_id=pad_id)
    if processor is None:
        return collate
    copies = 2 if algorithm.data_kind == "preference" else 1
    return lambda examples: data.with_images(collate(examples), [e.get("images", []) for e in examples] * copies,
                                             processor)


def load_policy(recipe: Recipe, algorithm):
    load_model = load.load_sequence_classifier if algorithm.model_kind == "seq_cls" else load.load_causal_lm
    model = load_model(trained_model_config(recipe.model, recipe.train), recipe.train.gradient_checkpointing)
    if recipe.model.lora.enabled:
        model = upcast_trainable(load.apply_lora(model, recipe.model.lora, task=algorithm.model_kind), recipe.model,
                                 recipe.train)
    return model


def run(command: str, recipe: Recipe, launched: Optional[Launched] = None,
        header: Optional[dict[str, Any]] = None) -> RunResult:
    """One run of `command`. `launched`: what the launch wing started for it (launcher: ray): roles served apart
    (those are not loaded here) and generation engines. `header`: facts about the recipe the run's header line (and
    summary, report) adds, such as whose defaults filled it. How it ended goes into output_dir's marker, so that a run
    that failed before its first checkpoint can be rerun in place (posttrain/rundir/claim.py)."""
    try:
        result = run_attempt(command, recipe, launched, header)
    except BaseException as error:
        claim.end_attempt(Path(recipe.output_dir), error)
        raise
    claim.end_attempt(Path(recipe.output_dir), final_step=result.steps if result.final_dir else None)
    return result


def run_attempt(command: str, recipe: Recipe, launched: Optional[Launched] = None,
                header: Optional[dict[str, Any]] = None) -> RunResult:
    started = time.time()
    algorithm = ALGORITHMS[command][1](recipe)
    t = recipe.train

    # 1. the user's input, before anything heavy
    algorithm.preflight()  # its rewards, teacher, critic
    check_recipe(recipe, algorithm)  # the recipe's shapes, as `posttrain plan` checks them (plan/preflight.py)
    shared_prefix = resolve_shared_prefix(recipe, algorithm)  # train.shared_prefix: true where it cannot be exact
    resume_from = claim.check_output_dir(recipe, command)
    tokenizer = load_tokenizer(recipe.model)
    processor = load_processor(recipe.model, tokenizer) if is_vision_model(recipe.model) else None
    launched = launched or Launched()
    servers = launched.servers or recipe.generation.servers
    if servers:  # every server answers, takes the token, serves our vocabulary
        check_servers(recipe, tokenizer, servers)
    check_agent(recipe, tokenizer, command)  # tools import, the template shows them, the environment loads
    train_examples, train_stats = load_examples(recipe, algorithm, tokenizer, "train", processor)
    eval_examples = load_examples(recipe, algorithm, tokenizer, "eval", processor)[0] if recipe.data.eval else None
    check_answer_columns(recipe, algorithm, train_examples, eval_examples)  # dynamic sampling's accuracy, pass@k
    algorithm.check_data(train_examples, eval_examples)  # the columns the rewards read by name (a judge's template)

    # 2. processes and engines; then models
    backend = Backend(recipe)
    facts = run_facts(backend, t)
    out = Path(recipe.output_dir)
    if resume_from is not None:  # a checkpoint this launch cannot continue exactly stops here, before any model
        resume_from = resume_path(backend, resume_from, facts, out)
    if backend.is_main:
        replaced = claim.begin_run(out, t.overwrite_output_dir, command)  # the marker; overwrite: old files aside
        (out / "config.yaml").write_text(dump_yaml(recipe))
        claim.end_overwrite(replaced)
    backend.barrier()
    set_seed(recipe.seed)  # Python's, numpy's and torch's generators
    model = load_policy(recipe, algorithm)
    total_params, trainable_params = count_parameters(model)
    if backend.is_main:  # weights + AdamW's two moments, in float32 (or the size of the checkpoint resumed from)
        roles = algorithm.models_needed().trained  # a critic is about the policy's size
        warn_low_disk(out, tree_bytes(resume_from) or roles * (4 * total_params + 8 * trainable_params))
    models = build_roles(recipe, algorithm, backend, tokenizer, model, eval_examples, launched.roles)

    # 3. data source, schedule, state
    collate = make_collate(recipe, algorithm, tokenizer, processor)
    source = make_source(recipe, backend, models, algorithm, train_examples, collate, servers, processor,
                         shared_prefix)
    steps = total_steps(t, source.micro_batches_per_epoch())
    if warmup_trains_nothing(t, steps):  # warn() speaks from rank 0 only
        warn(warmup_trains_nothing(t, steps))
    for _, role in models.trained():
        role.start_schedule(steps)
    checkpointer = Checkpointer(backend, str(out), t.save_total_limit, facts, source)
    state = TrainState()
    if resume_from is not None:
        state = checkpointer.load(resume_from, models, algorithm)
    algorithm.setup(backend, models, train_examples, collate, out)

    summary = run_summary(command, recipe, backend, facts, train_stats, steps, (total_params, trainable_params),
                          resume_from)
    summary.update(header or {})
    trackers = []
    if backend.is_main:
        trackers = open_trackers(tracker_names(t), tracked_run(recipe, command, state.step, summary))
    logger = MetricsLogger(str(out), steps, state.step, backend.is_main, trackers, algorithm.headline_metrics)
    logger.info("posttrain " + " | ".join(f"{k}={v}" for k, v in summary.items() if v is not None))
    eval_fn = make_evaluation(recipe, backend, algorithm, models, source, tokenizer, eval_examples, collate)

    # 4. train, export, report
    ctx = LoopContext(backend=backend, algorithm=algorithm, models=models, source=source, total_steps=steps,
                      logger=logger, checkpointer=checkpointer, state=state, evaluate=eval_fn,
                      memory_estimate_mb=summary["estimated_peak_memory_mb"], guard=Guard(t, backend),
                      shared_prefix=shared_prefix)
    try:
        with ctx.guard:  # SIGTERM / SIGINT: save at the next step boundary and exit 143 / 130
            state = train(ctx)
        source.close(state.step)  # engines that outlive the run get the final policy
    except BaseException as e:  # the trackers record the run as failed (or killed), not as running forever
        source.abandon()  # no work queued ahead runs on (generation batches sampled ahead)
        logger.close(closing_status(e))
        raise
    logger.close()
    final_dir = None
    if state.step >= steps and t.save_final_model:
        final_dir = export_final(backend, models.policy.model, processor or tokenizer, str(out),
                                 dtype=export_dtype(t, backend.precision))
        for name, role in models.trained():
            if name != "policy":
                role.export(str(out), f"final-{name}", tokenizer)
    if backend.is_main and t.report:
        report = write_report(out, {**summary, "minutes": round((time.time() - started) / 60, 2)})
        logger.info(f"report: {report}")
    metrics = read_metrics(out) if backend.is_main else []
    source.end()  # no collective after this point: an in-process vLLM engine may tear down its groups
    backend.end()
    return RunResult(output_dir=out, final_dir=final_dir, steps=state.step, metrics=metrics)


def run_summary(command: str, recipe: Recipe, backend, facts: dict, train_stats: dict, steps: int,
                parameters: tuple[int, int], resume_from) -> dict:
    """The run header (logged once, in summary.json and the report) with `posttrain plan`'s memory estimate, logged
    beside the measured peak_memory_mb so drift shows (docs/planning.md)."""
    t = recipe.train
    total_params, trainable_params = parameters
    dropped = {key: count for key, count in train_stats.items() if key.startswith("dropped") and count}
    summary = {
        "command": command,
        "parameters": f"{total_params / 1e6:.2f}M ({trainable_params / 1e6:.2f}M trainable)",
        "rows": train_stats.get("rows"),
        "tokens": train_stats.get("tokens"),
        "truncated": train_stats.get("truncated", 0),
        "dropped": dropped or 0,
        "steps": steps,
        "per_device_batch": t.per_device_train_batch_size,
        "accumulation": t.gradient_accumulation_steps,
        "global_batch": facts["global_batch"],
        **backend.describe(),
        "sequence_parallel": t.sequence_parallel_size if t.sequence_parallel_size > 1 else None,
        "resumed_from": str(resume_from) if resume_from else None,
    }
    summary["estimated_peak_memory_mb"] = estimated_peak_mb(command, recipe, backend.describe(), parameters)
    return summary


def make_evaluation(recipe: Recipe, backend, algorithm, models, source, tokenizer, eval_examples, collate):
    """The run's eval function, or None without eval data: online algorithms evaluate by generating, wherever
    generation runs; offline ones by their loss over the eval batches."""
    if eval_examples is None:
        return None
    if algorithm.source_kind == "rollout":
        return partial(evaluate_online, backend, source, tokenizer, eval_examples, algorithm.rewards, recipe)
    batches = eval_batches(eval_examples, collate, recipe.train.per_device_eval_batch_size, backend.data_world_size,
                           backend.data_rank)
    return partial(evaluate, backend, algorithm, models, batches)
