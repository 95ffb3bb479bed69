"""THE training loop, shared by every algorithm. Read it top to bottom; each step is a few commented phases.

    for step in range(start, total):
        1. micro-batches of this rank for the step (offline data, or fresh rollouts)
        2. algorithm.prepare: what needs no gradient (reference / old log-probs)
        3. the global normaliser: loss units summed over micro-batches and ranks, once
        4. per trained role (policy; critic for PPO): forward + backward per micro-batch (gradient sync only on the
           last), then clip, optimiser step, LR schedule
        5. metrics reduced across ranks once, with the guard's flags (non-finite loss, stop signal); rank 0 logs
        6. eval and checkpoint when due (and when a stop signal was agreed, at the end of the generation batch:
           train/guard.py)

Because every micro-batch's loss is divided by the same global count (phase 3), 1 process x 4 accumulation steps,
2 processes x 2 and one micro-batch of 4 give the same update. Each trained role (algorithm.objectives) has its
own normaliser, optimiser and schedule; its loss and grad norm are logged as loss, grad_norm (the policy) and
loss/<role>, grad_norm/<role> (the others).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from posttrain.algorithms.base import Algorithm, Models
from posttrain.batch import Batch
from posttrain.config.schema import saves_final_checkpoint
from posttrain.data.collate import pad_id
from posttrain.models.shared_prefix import check_first_forward
from posttrain.train.guard import Guard
from posttrain.train.micro_batches import shape
from posttrain.train.state import TrainState
from posttrain.usercode import UserCodeError


@dataclass
class LoopContext:
    """Everything the loop uses, assembled once by run.py."""

    backend: Any
    algorithm: Algorithm
    models: Models
    source: Any
    total_steps: int
    logger: Any
    checkpointer: Any
    state: TrainState = field(default_factory=TrainState)
    evaluate: Optional[Callable[[], dict[str, float]]] = None
    memory_estimate_mb: Optional[float] = None
    """`posttrain plan`'s peak estimate, logged beside the measured peak_memory_mb."""
    guard: Optional[Guard] = None  # signals and non-finite steps (train/guard.py); run.py installs it
    shared_prefix: bool = False
    """train.shared_prefix as run.py resolved it: micro-batches compute their rows' shared prefixes once."""
    shared_prefix_checked: bool = False
    """The run's first step compared the shared forward with the plain one (models/shared_prefix.py)."""


def count_tokens(batch: Batch) -> int:
    if batch.filler:
        return 0
    if batch.attention_mask_BT is not None:
        return int(batch.attention_mask_BT.sum())
    if batch.sequence_index_BT is not None:  # packed rows: filler tokens are not data
        return int((batch.sequence_index_BT >= 0).sum())
    return int(batch.input_ids_BT.numel())


def completion_tokens(micro_batches: list[Batch], device) -> torch.Tensor:
    """This rank's tokens inside the completion masks: the tokens the step trains on (fillers train on none)."""
    return torch.stack([b.completion_mask_BT.sum() * (not b.filler) for b in micro_batches]).sum().float().to(device)


def train(ctx: LoopContext) -> TrainState:
    backend, algorithm, models, state = ctx.backend, ctx.algorithm, ctx.models, ctx.state
    t = backend.recipe.train
    for _, role in models.trained():
        role.train()
    guard = ctx.guard or Guard(t, backend)
    window, window_steps, window_tokens, window_start = {}, 0, 0, time.perf_counter()
    steps_this_run = 0
    if ctx.evaluate is not None and state.step == 0:
        ctx.logger.log(0, ctx.evaluate())  # the starting point, so the report shows how far eval moved
        models.policy.train()

    while state.step < ctx.total_steps:
        step_start = time.perf_counter()

        # 1-2. this rank's micro-batches for the step, with what needs no gradient
        micro_batches = prepared_micro_batches(ctx, state.step)

        # 3. one global normaliser per trained role for the whole step: its loss units (tokens, sequences or pairs)
        #    counted over this rank's micro-batches, then summed over ranks in one all-reduce
        objectives = algorithm.objectives(state.step, models)
        trained = [(name, role) for name, role in models.trained() if name in objectives]
        normalisers, trained_tokens = step_normalisers(backend, [objectives[name] for name, _ in trained],
                                                       micro_batches)

        # 4. per role: forward + backward, gradients synced on the last micro-batch only; clip, step, schedule
        losses, grad_norms, update_seconds, metric_sums = {}, {}, {}, {}
        for (name, role), normaliser in zip(trained, normalisers):
            update_start = time.perf_counter()
            losses[name], grad_norms[name], metrics = role.update(state.step, objectives[name], micro_batches,
                                                                  normaliser, guard.skip)
            for key, value in metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value
            update_seconds[name] = time.perf_counter() - update_start
        state.step += 1
        steps_this_run += 1

        # 5. reduce once across ranks: [tokens, *losses, *metrics means, *guard flags]
        tokens = sum(count_tokens(b) for b in micro_batches)
        # tokens one forward of the step's micro-batches computes, and without shared prefixes (logged as
        # tokens/forwarded and shared_prefix/saved_fraction: a sharing that silently stopped shows here)
        forwarded = [float(sum(b.forwarded_tokens(shared) for b in micro_batches)) for shared in (True, False)]
        keys = sorted(metric_sums)
        trained_on = sum(not b.filler for b in micro_batches)
        local = torch.stack([torch.tensor(float(n), device=backend.device) for n in [tokens, *forwarded]]
                            + list(losses.values())
                            + [metric_sums[k].to(backend.device) / trained_on for k in keys])
        # a sequence-parallel group's ranks hold the same rows and losses: counted once (data_weight 1 or 0)
        local = local * backend.data_weight
        # + [a loss not finite, signal]: agreed in this reduce
        local = torch.cat([local, guard.local_flags(torch.stack(list(losses.values())).sum())])
        reduced = backend.all_reduce_sum(local)
        guard.check_step(state, reduced[-2:], sum(grad_norms.values()))  # NaN when any role's norm is
        global_tokens = int(reduced[0])
        state.tokens_seen += global_tokens
        samples = sum(b.num_pairs or b.num_sequences for b in micro_batches if not b.filler)
        state.samples_seen += samples * backend.data_world_size
        step_metrics = {"tokens/forwarded": float(reduced[1]) / backend.data_world_size,
                        "shared_prefix/saved_fraction": 1.0 - float(reduced[1]) / max(float(reduced[2]), 1.0)}
        for name, value in zip(losses, reduced[3 : 3 + len(losses)]):
            suffix = "" if name == "policy" else f"/{name}"
            step_metrics.update({f"loss{suffix}": float(value), f"grad_norm{suffix}": grad_norms[name],
                                 f"time/update/{name}": update_seconds[name]})
        step_metrics.update({k: float(v) / backend.data_world_size
                             for k, v in zip(keys, reduced[3 + len(losses) : -2])})
        step_metrics["trained_tokens"] = float(trained_tokens)  # 0: every token masked (rundir/health.py says so)
        step_metrics.update(source_metrics(step_metrics, ctx.source.last_metrics))
        for key, value in step_metrics.items():
            window[key] = window.get(key, 0.0) + value
        window_steps += 1
        window_tokens += global_tokens
        state.elapsed_seconds += time.perf_counter() - step_start

        if state.step % t.logging_steps == 0 or state.step == ctx.total_steps:
            tokens_per_second = window_tokens / max(time.perf_counter() - window_start, 1e-9)
            ctx.logger.log(state.step, logged_record(ctx, {k: v / window_steps for k, v in window.items()},
                                                     tokens_per_second))
            window, window_steps, window_tokens, window_start = {}, 0, 0, time.perf_counter()
        else:
            ctx.logger.progress(state.step, step_metrics.get("loss", 0.0))

        if trained_tokens == 0:  # the loss is 0 and no weight moves: say so rather than log a quiet loss=0
            hint = ctx.source.nothing_trained_hint()
            ctx.logger.info(f"step {state.step}: every completion token was masked out, so this step trained nothing"
                            + (f": {hint}" if hint else ""))

        # 6. eval and checkpoint when due
        last = state.step == ctx.total_steps
        if ctx.evaluate is not None and ((t.eval_steps and state.step % t.eval_steps == 0) or last):
            ctx.logger.log(state.step, ctx.evaluate())
            models.policy.train()
        stop_early = t.max_steps_per_run is not None and steps_this_run >= t.max_steps_per_run and not last
        # a stop signal acts where a checkpoint resumes exactly: at the end of a generation batch (PPO / GRPO reuse
        # one for algorithm.steps_per_rollout steps, and a resume inside it would sample it again)
        stop = guard.stop_signal and (state.step % algorithm.steps_per_rollout == 0 or last)
        due = (t.save_steps and state.step % t.save_steps == 0) or (last and saves_final_checkpoint(t))
        if due or stop_early or stop:
            saved = ctx.checkpointer.save(state, models, algorithm)
        if stop:
            guard.stopped(state.step, saved)
        if stop_early:
            break
    return state


def prepared_micro_batches(ctx: LoopContext, step: int) -> list[Batch]:
    """This rank's micro-batches of `step` on its device (padding-free and within the token budget when the recipe
    asks), each through algorithm.prepare once: the forwards that need no gradient (reference, old policy, rewards),
    here, or in a source that prepares its own (Source.prepares_batches)."""
    backend, models = ctx.backend, ctx.models
    micro_batches = shape(ctx.source.step_batches(step), backend.recipe, pad_id(models.tokenizer),
                          lambda count: max(backend.all_gather_object(count)), ctx.shared_prefix)
    micro_batches = [b.to(backend.device) for b in micro_batches]
    first = micro_batches[0]  # packed rows (data.packing's collate) have no rows to share: nothing to check there
    if ctx.shared_prefix and not ctx.shared_prefix_checked and first.attention_mask_BT is not None:
        # once a run, on every rank (ZeRO-3's forwards are collective)
        with backend.autocast():
            diff = check_first_forward(models.policy.model, first, ctx.algorithm.model_kind == "seq_cls")
        ctx.logger.info(f"train.shared_prefix: the first step's shared and plain forwards agree (max diff {diff:.2g})")
        ctx.shared_prefix_checked = True
    if ctx.source.prepares_batches:
        return micro_batches
    with torch.no_grad(), backend.autocast():
        return [ctx.algorithm.prepare(b, models) for b in micro_batches]


def step_normalisers(backend, objectives: list, micro_batches: list[Batch]) -> tuple[torch.Tensor, int]:
    """Phase 3: each trained role's loss units (tokens, sequences or pairs) counted over this rank's micro-batches,
    then summed over ranks in one all-reduce, with the completion tokens trained on. Returns (normaliser per
    objective, global trained tokens). A filler micro-batch (a rank with fewer rows under a token budget) counts
    none."""
    local_counts = [sum(objective.count(b).float().to(backend.device) * (not b.filler) for b in micro_batches)
                    for objective in objectives]
    local_counts.append(completion_tokens(micro_batches, backend.device))
    counts = backend.data_all_reduce_sum(torch.stack(local_counts))
    return counts[:-1].clamp(min=1.0), int(counts[-1])


def source_metrics(step_metrics: dict[str, float], source: dict[str, float]) -> dict[str, float]:
    """The source's figures for the step, which never share a name with the loss's: one that does is a reward
    function's log_metric (the source passes those on) and would replace the algorithm's figure (entropy, kl)."""
    clash = sorted(set(step_metrics) & set(source))
    if clash:
        raise UserCodeError(f"the metric {clash[0]!r} is the trainer's ({sorted(step_metrics)}) and is also logged "
                            "by the step's source: a reward function's log_metric? give yours a name of its own")
    return source


def logged_record(ctx: LoopContext, means: dict[str, float], tokens_per_second: float) -> dict[str, float]:
    """The logging window's means plus what is read once per log line: learning rates, throughput and the peak
    memory of every rank (CUDA peak on GPU, peak RSS on CPU), beside the planner's estimate."""
    backend, models, state = ctx.backend, ctx.models, ctx.state
    peak_mb = [b / 2**20 for b in backend.all_gather_object(backend.peak_memory_bytes())]
    record = dict(means)
    record.update({f"learning_rate/{name}": role.learning_rate()
                   for name, role in models.trained() if name != "policy"})
    record.update(step=state.step, learning_rate=models.policy.learning_rate(), tokens_per_second=tokens_per_second,
                  num_tokens=state.tokens_seen, peak_memory_mb=max(peak_mb))
    if ctx.memory_estimate_mb is not None:
        record["estimated_peak_memory_mb"] = ctx.memory_estimate_mb
    if len(peak_mb) > 1:  # per rank: where the memory goes
        record.update({f"peak_memory_mb/rank{r}": mb for r, mb in enumerate(peak_mb)})
    return record


def update_role(backend, role, objective, micro_batches: list[Batch], normaliser: torch.Tensor,
                skip_nonfinite: bool) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Phase 4 for one trained role: forward + backward per micro-batch (gradients synced on the last only), clip,
    optimiser step, LR schedule. Returns this rank's loss (summed over micro-batches), the global grad norm and the
    objective's metrics summed over micro-batches. A local role's `update` (posttrain/roles.py) is this; a role trained
    in a Ray actor group of its own runs it there."""
    loss_sum = torch.zeros((), device=backend.device)
    metric_sums: dict[str, torch.Tensor] = {}
    for k, batch in enumerate(micro_batches):
        # routing: an MoE model's load-balancing loss and routing replay, over the forward AND the backward
        last = k == len(micro_batches) - 1
        with backend.accumulate(role.model, last=last), role.routing.training(batch) as routing:
            with backend.autocast():
                loss, metrics = routing.finish(*objective.loss(role.model, batch, normaliser),
                                               weight=objective.count(batch) / normaliser)
            if batch.filler:  # runs for the collectives only (train/micro_batches.py)
                loss, metrics = loss * 0.0, {}
            backend.backward(loss, role.model)
        loss_sum += loss.detach().float()
        for key, value in metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value.detach().float()
    grad_norm = float(backend.step(role.model, role.optimizer, skip_nonfinite=skip_nonfinite))
    role.scheduler.step()
    return loss_sum, grad_norm, metric_sums


def evaluate(backend, algorithm: Algorithm, models: Models, batches: list[tuple[Batch, float]]) -> dict[str, float]:
    """Mean loss per unit over the whole eval set (all ranks) and the algorithm's metrics averaged over batches."""
    model, objective = models.policy.model, algorithm.objectives(0, models)["policy"]  # offline: one objective
    models.policy.train(False)
    total = torch.zeros(2, device=backend.device)
    metric_sums: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for batch, weight in batches:
            with backend.autocast():
                batch = algorithm.prepare(batch.to(backend.device), models, training=False)
                loss_sum, metrics = objective.loss(model, batch, torch.ones((), device=backend.device))
            count = objective.count(batch).float()
            total += torch.stack([loss_sum.detach().float() * weight, count.to(backend.device) * weight])
            for key, value in metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value.detach().float() * weight
    keys = sorted(metric_sums)
    stacked = torch.stack([metric_sums[k] for k in keys]) if keys else torch.zeros(0, device=backend.device)
    local = torch.cat([total, stacked, torch.tensor([float(sum(w for _, w in batches))], device=backend.device)])
    reduced = backend.all_reduce_sum(local)
    out = {"eval/loss": float(reduced[0] / reduced[1].clamp(min=1))}
    out.update({f"eval/{k}": float(v / reduced[-1].clamp(min=1)) for k, v in zip(keys, reduced[2:-1])})
    return out
