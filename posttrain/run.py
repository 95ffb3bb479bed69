"""The composition root: recipe -> checks -> backend, models, data source, algorithm -> the loop -> export.

Order matters and is deliberate:
  1. everything that can be wrong with the user's input is checked (data parsed and tokenised, model path, output
     directory) before a model is loaded or anything is written;
  2. the backend (process group, DeepSpeed plugin) exists before models are made, so ZeRO-3 can partition them
     at construction;
  3. rank 0 writes; every rank trains.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.checkpoint import (UNIVERSAL_DIR, Checkpointer, check_compatible, export_final, resolve_resume,
                                  run_facts, to_universal)
from posttrain.checkpoint_files import tree_bytes, warn_low_disk
from posttrain.config.load import dump_yaml
from posttrain.config.schema import Recipe, total_steps
from posttrain.errors import UserError

RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "tensorboard", "checkpoints", "final", "final-critic", "report.html",
                 "curves.png",
                 "samples.jsonl", "ref_logprobs.safetensors", UNIVERSAL_DIR)


@dataclass
class RunResult:
    output_dir: Path
    final_dir: Optional[Path]
    steps: int
    metrics: list[dict[str, Any]]


def check_output_dir(recipe: Recipe) -> Optional[Path]:
    """Refuse to clobber a different run. Returns the checkpoint to resume from, if any."""
    out = Path(recipe.output_dir)
    t = recipe.train
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {out} is a file; choose a directory")
    check_writable(out)
    resume = resolve_resume(str(out), t.resume_from_checkpoint)
    if resume is not None or t.overwrite_output_dir or t.resume_from_checkpoint == "auto":
        return resume  # auto and no checkpoint yet (a run stopped before its first save): the run starts
    # config.yaml alone: it never trained; engines/: the logs of this run's Ray generation engines, started first
    from posttrain.rollout.server_process import LOG_DIR as ENGINE_LOGS

    if out.is_dir() and any(p.name not in ("config.yaml", ENGINE_LOGS) for p in out.iterdir()):
        has_run = (out / "config.yaml").exists()
        what = "already holds a run (config.yaml)" if has_run else "is not empty"
        raise UserError(
            f"output_dir {out} {what}; pass train.resume_from_checkpoint=auto to continue it, "
            "train.overwrite_output_dir=true to replace it, or choose another output_dir"
        )
    return None


def check_writable(out: Path) -> None:
    """output_dir (or the nearest folder above it that exists) must take new files; probed with a temporary file."""
    probe_in = next(p for p in (out, *out.parents) if p.exists())
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(f"{probe_in} is a file")
        fd, name = tempfile.mkstemp(prefix=".posttrain-probe-", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UserError(f"output_dir {out}: cannot write in {probe_in} ({e.strerror or e}); choose a writable "
                        "output_dir or fix its permissions") from None


def clear_previous_run(out: Path) -> None:
    """overwrite_output_dir: remove only what a posttrain run writes; the user's other files stay."""
    for name in RUN_ARTIFACTS:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def load_examples(recipe: Recipe, algorithm, tokenizer, which: str):
    """Rows -> tokenised examples for the algorithm's data kind; raises UserError naming the file/row."""
    from posttrain import data

    source = recipe.data.train if which == "train" else recipe.data.eval
    split = recipe.data.train_split if which == "train" else recipe.data.eval_split
    rows = data.load_rows(source, split, f"data.{which}")
    tokenize = {"sft": data.tokenize_sft, "preference": data.tokenize_preference, "prompt": data.tokenize_prompts}
    return tokenize[algorithm.data_kind](rows, tokenizer, recipe.data, f"data.{which}")


def make_collate(recipe: Recipe, algorithm, tokenizer):
    from posttrain import data

    pad_id = tokenizer.pad_token_id
    if algorithm.data_kind == "preference":
        return lambda examples: data.collate_preference(examples, pad_id)
    if recipe.data.packing:
        return lambda examples: data.collate_packed(examples, row_length=recipe.data.max_length, pad_id=pad_id)
    return lambda examples: data.collate_padded(examples, pad_id)


def load_policy(recipe: Recipe, algorithm):
    from posttrain.models import load

    if algorithm.model_kind == "seq_cls":
        model = load.load_sequence_classifier(recipe.model, recipe.train.gradient_checkpointing)
    else:
        model = load.load_causal_lm(recipe.model, recipe.train.gradient_checkpointing)
    if recipe.model.lora.enabled:
        model = load.apply_lora(model, recipe.model.lora, task=algorithm.model_kind)
    return model


def run(command: str, recipe: Recipe, remote_roles: Optional[dict] = None) -> RunResult:
    """One run of `command`. remote_roles (launcher: ray): role -> distributed.ray_roles.RemoteRole for the roles
    served by actor groups apart from the policy (frozen replicas, the critic's group); those are not loaded here."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.algorithms.base import Models, Role
    from posttrain.distributed.backend import Backend
    from posttrain.logging import MetricsLogger, read_metrics, write_report
    from posttrain.models.load import check_model_source, count_parameters, load_tokenizer
    from posttrain.train.guard import Guard
    from posttrain.train.loop import LoopContext, evaluate, train
    from posttrain.train.optim import make_optimizer, make_scheduler
    from posttrain.train.sources import DatasetSource, eval_batches

    started = time.time()
    algorithm = ALGORITHMS[command][1](recipe)
    t = recipe.train

    # 1. the user's input, before anything heavy
    check_model_source(recipe.model)
    resume_from = check_output_dir(recipe)
    tokenizer = load_tokenizer(recipe.model)
    if recipe.generation.engine == "server":  # every server answers, takes the token, serves our vocabulary
        from posttrain.rollout.server import check_servers

        check_servers(recipe, tokenizer)
    from posttrain.agents import check_rollout

    check_rollout(recipe, tokenizer, command)  # tools import, the template shows them, the environment loads
    train_examples, train_stats = load_examples(recipe, algorithm, tokenizer, "train")
    eval_examples, eval_stats = (None, None)
    if recipe.data.eval:
        eval_examples, eval_stats = load_examples(recipe, algorithm, tokenizer, "eval")

    # 2. processes and engines; then models
    backend = Backend(recipe)
    facts = run_facts(backend, t)
    # a checkpoint this launch cannot continue exactly stops here, before any model
    universal = resume_from is not None and check_compatible(resume_from, facts)
    out = Path(recipe.output_dir)
    if universal:  # DeepSpeed on another process count: continue from the universal format
        resume_from = to_universal(backend, resume_from, out)
        backend.load_universal()
    if backend.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if t.overwrite_output_dir:
            clear_previous_run(out)
        (out / "config.yaml").write_text(dump_yaml(recipe))
    backend.barrier()
    seed_everything(recipe.seed)
    model = load_policy(recipe, algorithm)
    total_params, trainable_params = count_parameters(model)
    if backend.is_main:  # weights + AdamW's two moments, in float32 (or the size of the checkpoint resumed from)
        roles = 2 if algorithm.needs_critic else 1  # a critic is about the policy's size
        warn_low_disk(out, tree_bytes(resume_from) or roles * (4 * total_params + 8 * trainable_params))
    model, optimizer = backend.prepare(model, make_optimizer(model, t))
    # the Models record is the only owner of the reference, so an algorithm's setup may free it (precomputed
    # reference log-probs); eval_examples lets it precompute for the eval set too
    models = Models(policy=Role(model, trains=True, optimizer=optimizer), tokenizer=tokenizer,
                    eval_examples=eval_examples)
    remote = remote_roles or {}
    if algorithm.needs_reference and "reference" in remote:
        models.reference = Role(remote["reference"].model(), placement="ray")
    elif algorithm.needs_reference:
        from posttrain.models.reference import make_reference

        where = algorithm.placement("reference")
        models.reference = Role(backend.prepare_frozen(make_reference(recipe.model, algorithm.model_kind),
                                                       offload=where == "offload"), placement=where)
    for i, scorer in enumerate(algorithm.reward_models()):  # frozen like the reference: partitioned, offloadable
        where = "ray" if "reward_model" in remote else algorithm.placement("reward_model")
        if where == "ray":
            scorer.place(remote["reward_model"].model(f"reward_model:{i}"), backend.device)
        else:
            scorer.place(backend.prepare_frozen(scorer.load_model(), offload=where == "offload"), backend.device)
        models.reward_model = models.reward_model or Role(scorer.model, placement=where)
    if algorithm.needs_critic and "critic" in remote:  # trained by its own actor group (distributed/ray_roles.py)
        models.critic = Role(remote["critic"].model(), trains=True, placement="ray")
    elif algorithm.needs_critic:
        from posttrain.models.critic import load_critic

        critic = load_critic(algorithm.critic_source(), tokenizer.pad_token_id, t.gradient_checkpointing)
        critic, critic_optimizer = backend.prepare(critic, make_optimizer(critic, t, algorithm.critic_learning_rate()))
        models.critic = Role(critic, trains=True, optimizer=critic_optimizer)

    # 3. data source, schedule, state
    collate = make_collate(recipe, algorithm, tokenizer)
    source = algorithm.make_source(backend, models, train_examples)
    if source is None:
        source = DatasetSource(train_examples, collate, t.per_device_train_batch_size, t.gradient_accumulation_steps,
                               backend.world_size, backend.rank, t.dataloader_seed if t.dataloader_seed is not None else recipe.seed)
    steps = total_steps(t, source.micro_batches_per_epoch())
    for _, role in models.trained():
        role.scheduler = (role.model.remote_setup(steps) if role.placement == "ray"
                          else make_scheduler(role.optimizer, t, steps))
    checkpointer = Checkpointer(backend, str(out), t.save_total_limit, facts)
    from posttrain.train.state import TrainState

    state = TrainState()
    if resume_from is not None:
        state = checkpointer.load(resume_from, models, algorithm)
    algorithm.setup(backend, models, train_examples, collate, out)

    logger = MetricsLogger(str(out), steps, state.step, backend.is_main, tensorboard=t.tensorboard)
    summary = dict(
        command=command,
        parameters=f"{total_params / 1e6:.2f}M ({trainable_params / 1e6:.2f}M trainable)",
        rows=train_stats.get("rows"),
        tokens=train_stats.get("tokens"),
        truncated=train_stats.get("truncated", 0),
        dropped={k: v for k, v in train_stats.items() if k.startswith("dropped") and v} or 0,
        steps=steps,
        per_device_batch=t.per_device_train_batch_size,
        accumulation=t.gradient_accumulation_steps,
        global_batch=facts["global_batch"],
        **backend.describe(),
        resumed_from=str(resume_from) if resume_from else None,
    )
    # `posttrain plan`'s estimate, logged beside the measured peak_memory_mb so drift shows (docs/planning.md)
    from posttrain.plan import estimated_peak_mb

    summary["estimated_peak_memory_mb"] = estimated_peak_mb(command, recipe, backend.describe(),
                                                            (total_params, trainable_params))
    logger.info("posttrain " + " | ".join(f"{k}={v}" for k, v in summary.items() if v is not None))
    eval_fn = None
    if eval_examples is not None and algorithm.has_custom_eval():  # online algorithms: eval by generating
        eval_fn = lambda: algorithm.evaluate(backend, models, eval_examples)  # noqa: E731
    elif eval_examples is not None:
        batches = eval_batches(eval_examples, collate, t.per_device_eval_batch_size, backend.world_size, backend.rank)
        eval_fn = lambda: evaluate(backend, algorithm, models, batches)  # noqa: E731

    # 4. train, export, report
    ctx = LoopContext(backend=backend, algorithm=algorithm, models=models, source=source, total_steps=steps,
                      logger=logger, checkpointer=checkpointer, state=state, evaluate=eval_fn,
                      memory_estimate_mb=summary["estimated_peak_memory_mb"], guard=Guard(t, backend))
    with ctx.guard:  # SIGTERM / SIGINT: save at the next step boundary and exit 143 / 130
        state = train(ctx)
    if hasattr(source, "close"):  # engines with their own copy of the policy get the final one
        source.close(state.step)
    logger.close()
    final_dir = None
    if state.step >= steps and t.save_final_model:
        final_dir = export_final(backend, model, tokenizer, str(out))
        for name, role in models.trained():
            if name != "policy" and role.placement == "ray":
                role.model.remote_export(str(out), f"final-{name}")
            elif name != "policy":
                export_final(backend, role.model, tokenizer, str(out), name=f"final-{name}")
    if backend.is_main and t.report:
        report = write_report(out, f"posttrain {command}: {out.name}",
                              {**summary, "minutes": f"{(time.time() - started) / 60:.1f}"})
        logger.info(f"report: {report}")
    metrics = read_metrics(out) if backend.is_main else []
    if hasattr(source, "end"):  # no collective after this point: an in-process vLLM engine may tear down its groups
        source.end()
    backend.end()
    return RunResult(output_dir=out, final_dir=final_dir, steps=state.step, metrics=metrics)
