"""Mixture-of-experts models in the trainer: the load-balancing loss and routing replay, through transformers' own
MoE code.

    routing = moe_routing(model, aux_loss_coef=0.001)       # inert for a dense model
    with routing.recording() as record:                     # R2: the old policy's no-grad forward
        old_logprobs_BT = policy_logprobs(model, batch)
    batch = dataclasses.replace(batch, routed_experts_BTLK=record.experts_BTLK(batch))
    with routing.training(batch) as step:                   # the training forward AND its backward; replays the
                                                            # batch's routed_experts_BTLK when it has them
        loss, metrics = step.finish(*algorithm.loss(model, batch, normaliser), weight=count / normaliser)
        backend.backward(loss)

transformers' sparse MoE blocks (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, ...) call a router module that returns
(router_logits, top-k weights, top-k expert indices) and run the experts on those indices. A forward hook on every
router reads that triple, and in replay replaces it: the indices by the recorded ones, the weights by the current
router's softmax gathered at those experts (renormalised when the router renormalises its top-k). That is what
Megatron's router replay and verl's router_replay (R2 / R3) do: the experts are fixed, the gate weights keep their
gradient to the router. The hooks stay registered for the run and act only inside `recording` or `training`, which
spans the backward too, so a forward recomputed by gradient checkpointing is replayed the same way.

Under sequence parallelism (train.sequence_parallel_size) each rank's routers see its slice of every row. The router
logits and choices of the group are gathered into whole rows (`whole_rows`, with the per-token outputs' gather), so
the load-balancing loss, its metric and routing agreement are those of the unsharded rows on every rank, and the
loss's gradient summed over the group is the unsharded one; a recording is gathered the same way, and a replay
forces each rank's slice of it (`routed_tokens`).

Routing replay (Ma et al. 2025, "Stabilizing MoE RL by aligning training and inference routers"): a policy update
moves the router, so later optimiser steps on one generation batch (algo.num_iterations > 1) route tokens to other
experts than the policy that produced pi_old did; the importance ratio then compares two different sub-networks and
GRPO on MoE models collapses (Megatron-LM#4168). R2 replays the routing of the trainer's old-policy forward; R3 would
replay the sampler's (vLLM 0.32 can return it with enable_return_routed_experts; not wired here yet).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from posttrain.batch import Batch
from posttrain.distributed import sequence_parallel
from posttrain.distributed.wrappers import plain_class, unwrap_module
from posttrain.errors import UserError
from posttrain.losses.router import load_balancing_loss, routing_agreement
from posttrain.models.limits import model_config_file

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
"""config.json model_type of the transformers MoE models whose routers are in ROUTERS."""

ROUTERS = {
    "Qwen3MoeTopKRouter": lambda router: router.norm_topk_prob,
    "Qwen2MoeTopKRouter": lambda router: router.norm_topk_prob,
    "OlmoeTopKRouter": lambda router: router.norm_topk_prob,
    "MixtralTopKRouter": lambda router: True,
}
"""transformers router classes that pick experts as softmax -> top-k -> (renormalise), and whether this one
renormalises its top-k weights. Replay recomputes the weights the same way."""


def routers(model) -> list[torch.nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    return [m for m in unwrap_module(model).modules() if plain_class(m).__name__ in ROUTERS]


def sparse_block_classes(model) -> list[type]:
    """The classes of the modules that hold a router and its experts: ZeRO-3 gathers each as one unit (a leaf). Where
    experts are modules of their own (remote-code models, transformers 4's Qwen3-MoE), a rank whose tokens pick no
    token for some expert would skip its gather while the other ranks wait in it."""
    return list({plain_class(m) for m in unwrap_module(model).modules()
                 if any(plain_class(c).__name__ in ROUTERS for c in m.children())})


def moe_routing(model, aux_loss_coef: Optional[float] = 0.0) -> "Routing":
    """Hooks on the routers of `model` (register before the engine wraps it); inert for a dense model.
    aux_loss_coef None: the model config's own router_aux_loss_coef, as TRL takes it (0 where it has none)."""
    if aux_loss_coef is None:
        config = getattr(unwrap_module(model), "config", None)
        text_config = config.get_text_config() if config is not None else None
        aux_loss_coef = getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0
    return Routing(routers(model), aux_loss_coef)


def check_moe_options(recipe, routing_replay: bool) -> None:
    """MoE options on a dense model are refused before it loads (read from its config.json, when it is local or
    cached; otherwise Routing.require says it once the model is loaded)."""
    options = [name for name, on in (("model.router_aux_loss_coef", (recipe.model.router_aux_loss_coef or 0) > 0),
                                     ("algo.routing_replay", routing_replay)) if on]
    config_file = model_config_file(recipe.model.name_or_path, recipe.model.revision) if options else None
    if config_file is None:
        return
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        raise UserError(f"{' and '.join(options)}: the model must be a mixture-of-experts model "
                        f"({', '.join(MOE_MODEL_TYPES)}), but {recipe.model.name_or_path} is {model_type}; leave "
                        f"{' and '.join(options)} at the default")


def real_tokens_N(batch: Batch) -> torch.Tensor:
    """bool over the tokens as the routers see them (`batch.model_inputs()` flattened): data, not padding or filler."""
    if batch.attention_mask_BT is not None:
        return batch.pack(batch.attention_mask_BT).reshape(-1).bool()
    if batch.sequence_index_BT is not None:
        return (batch.sequence_index_BT >= 0).reshape(-1)
    return torch.ones(batch.input_ids_BT.numel(), dtype=torch.bool, device=batch.input_ids_BT.device)


def routed_tokens(batch: Batch, x_BTX: torch.Tensor) -> torch.Tensor:
    """A per-token [B, T, ...] tensor of `batch` laid out as this rank's routers see the tokens: packed
    (padding-free), this rank's slice of every row (sequence parallelism), or as it is."""
    sp = sequence_parallel.current()
    return batch.pack(x_BTX) if sp is None else sp.shard(x_BTX)


def whole_rows(x_LNX: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Per-token router values of every layer, [L, N, ...] over the tokens this rank's routers saw, -> [L, rows *
    width, ...] over the whole rows of `batch.model_inputs()` ([rows, width]). Under sequence parallelism the
    group's slices are gathered as per-token outputs are (sequence_parallel.gather: the same on every rank of the
    group, the backward keeps this rank's slice), so the load-balancing loss, its gradient summed over the group and
    the recorded experts are those of the unsharded forward; otherwise `x_LNX` as it is."""
    sp = sequence_parallel.current()
    if sp is None:
        return x_LNX
    return layers_first(sp.gather(rows_first(x_LNX, rows), width))


def rows_first(x_LNX: torch.Tensor, rows: int) -> torch.Tensor:
    """[L, rows * width, ...] as the routers flatten their tokens -> [rows, width, L, ...]."""
    return x_LNX.reshape(x_LNX.shape[0], rows, -1, *x_LNX.shape[2:]).movedim(0, 2)


def layers_first(x_BTLX: torch.Tensor) -> torch.Tensor:
    """[rows, width, L, ...] -> [L, rows * width, ...], the inverse of rows_first."""
    return x_BTLX.movedim(2, 0).flatten(1, 2)


@dataclass
class Recording:
    """The experts each router chose, per forward (a role may run a batch in several forwards)."""

    chosen: list[list[torch.Tensor]]
    """chosen[layer] = [indices_NK of each forward]."""

    def experts_BTLK(self, batch: Batch) -> torch.Tensor:
        """(B, T, L, K) int16: the experts chosen for every token of `batch`, aligned with input_ids_BT (0 at
        padding). The forwards saw `batch.model_inputs()` (padding-free: packed rows), or its rows in order, or
        (sequence parallelism) this rank's slice of them: the group's slices are gathered into whole rows."""
        rows, width = batch.model_inputs()["input_ids"].shape
        chosen_LNK = whole_rows(torch.stack([torch.cat(forwards) for forwards in self.chosen]), rows, width)
        return batch.unpack(rows_first(chosen_LNK, rows)).to(torch.int16)


@dataclass
class TrainingForward:
    """What the routers saw in one micro-batch's training forward (the first pass; a recomputation is not counted)."""

    routing: "Routing"
    batch: Batch
    forced: Optional[list[torch.Tensor]] = None
    """Replay: forced[layer] = indices_NK to route this rank's tokens with."""
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """logits[layer] = router_logits_NE of this rank's tokens."""
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    """Replay: chosen[layer] = the experts the router itself would have picked, indices_NK of this rank's tokens."""

    def finish(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], weight: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Adds coef x the load-balancing loss x weight (this micro-batch's share of the step's normaliser, so the
        step adds coef x their mean, as the policy loss is a mean) and the router metrics, both over whole rows."""
        metrics = dict(metrics)
        layers = sorted(self.logits)
        if not layers:
            return loss, metrics
        rows, width = self.batch.model_inputs()["input_ids"].shape
        mask_N = real_tokens_N(self.batch)
        logits_LNE = whole_rows(torch.stack([self.logits[i] for i in layers]), rows, width)
        aux = load_balancing_loss(logits_LNE, self.routing.top_k, mask_N)
        metrics["router_aux_loss"] = aux.detach()
        if self.routing.aux_loss_coef > 0:
            loss = loss + self.routing.aux_loss_coef * aux * weight
        if self.chosen:
            chosen_LNK = whole_rows(torch.stack([self.chosen[i] for i in layers]), rows, width)
            replayed_NLK = self.batch.pack(self.batch.routed_experts_BTLK.long()).flatten(0, 1)
            matches, choices = torch.stack([routing_agreement(chosen_LNK[i], replayed_NLK[:, layer], mask_N)
                                            for i, layer in enumerate(layers)]).sum(dim=0)
            metrics["routing_agreement"] = (matches / choices.clamp(min=1)).detach()
        return loss, metrics


class Routing:
    """The hooks on one model's routers and what they do now: nothing, record, or serve a training forward."""

    def __init__(self, found: list[torch.nn.Module], aux_loss_coef: float):
        self.aux_loss_coef = aux_loss_coef
        self.num_routers = len(found)
        self.top_k = found[0].top_k if found else 0
        self._renormalise = [ROUTERS[plain_class(r).__name__](r) for r in found]
        self._recording: Optional[Recording] = None
        self._training: Optional[TrainingForward] = None
        for layer, router in enumerate(found):
            router.register_forward_hook(self._hook(layer))

    def require(self, model, option: str) -> None:
        """A recipe asking for an MoE feature of a model without known routers is told so (after the model loads:
        only then is its architecture certain)."""
        if not self.num_routers:
            model_type = getattr(getattr(unwrap_module(model), "config", None), "model_type", type(model).__name__)
            raise UserError(f"{option} needs a mixture-of-experts model with a softmax top-k router "
                            f"({', '.join(ROUTERS)}); {model_type} has none: leave {option} at its default")

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        self._recording = Recording([[] for _ in self._renormalise])
        try:
            yield self._recording
        finally:
            self._recording = None

    @contextlib.contextmanager
    def training(self, batch: Batch) -> Iterator[TrainingForward]:
        """Around one micro-batch's forward and backward; a batch that carries recorded experts
        (routed_experts_BTLK) is routed with them."""
        forced = None
        if batch.routed_experts_BTLK is not None:
            forced = list(routed_tokens(batch, batch.routed_experts_BTLK.long()).flatten(0, 1).unbind(dim=1))
        self._training = TrainingForward(self, batch, forced)
        try:
            yield self._training
        finally:
            self._training = None

    def _hook(self, layer: int):
        renormalise = self._renormalise[layer]

        def hook(router, inputs, output):
            logits_NE, _, chosen_NK = output
            if self._recording is not None:
                self._recording.chosen[layer].append(chosen_NK.detach())
            step = self._training
            if step is None:
                return None
            if layer not in step.logits:  # the first pass, not a recomputation (gradient checkpointing)
                step.logits[layer] = logits_NE
                if step.forced is not None:
                    step.chosen[layer] = chosen_NK.detach()
            return None if step.forced is None else _replayed(output, step.forced[layer], renormalise)

        return hook


def _replayed(output, forced_NK: torch.Tensor, renormalise: bool):
    """The router's output with the recorded experts and the current router's weights over them."""
    logits_NE, weights_NK, _ = output
    if forced_NK.shape[0] != logits_NE.shape[0]:
        raise RuntimeError(f"routing replay: the router saw {logits_NE.shape[0]} tokens, the recording has "
                           f"{forced_NK.shape[0]}; the training forward must see the batch the old policy saw")
    forced_weights_NK = logits_NE.float().softmax(dim=-1).gather(1, forced_NK)
    if renormalise:
        forced_weights_NK = forced_weights_NK / forced_weights_NK.sum(dim=-1, keepdim=True)
    return logits_NE, forced_weights_NK.to(weights_NK.dtype), forced_NK


NO_ROUTING = Routing([], 0.0)
"""The routing of a role without MoE hooks (a dense model, a critic): every context does nothing."""
