"""Whether a run computes shared prefixes once (`train.shared_prefix`), decided at start-up, and the first step's proof
that it is exact on the real model.

    on = resolve_shared_prefix(recipe, algorithm)        # UserError for `true` where it cannot be exact
    check_first_forward(model, batch)                    # the first step: shared vs plain log-probs, or stop

The layout (ops/shared_prefix.py) hands the model a 4-D boolean attention mask, which transformers passes as it is
to SDPA. It is exact (the same keys, values and positions for every token) only where the attention is full causal
attention over that mask: so not with sliding windows (the mask would let a token see past its window), mixture-of-
experts router losses (a shared token is routed once, not once per row, so the load-balancing loss would count other
tokens), sequence parallelism (Ulysses runs causal attention over whole rows), or an attention kernel that takes no
such mask (flash-attention, flex). Each architecture is also asked once, as data.packing asks (models/packing.py): a
narrow random model of its config scores a small batch shared and plain; they must agree.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch

from posttrain.errors import UserError, warn

SHARED_PREFIX_ATTENTION = ("sdpa",)
"""Attention kernels that take the layout's boolean 4-D mask as it is (eager would add it to the scores)."""
FIRST_STEP_ROWS = 4
"""Rows of the first shared micro-batch scored both ways at the start of a run."""


def blocker(recipe, config_dict: Optional[dict]) -> Optional[str]:
    """Why this run cannot compute shared prefixes exactly, in words (None: it can). `config_dict`: the policy's
    config.json (None: not readable here; the first step's check still runs)."""
    t, model = recipe.train, recipe.model
    if model.attn_implementation not in SHARED_PREFIX_ATTENTION:
        return (f"model.attn_implementation={model.attn_implementation} takes no custom attention mask (shared "
                f"prefixes need {' or '.join(SHARED_PREFIX_ATTENTION)})")
    if t.sequence_parallel_size > 1:
        return f"train.sequence_parallel_size={t.sequence_parallel_size} splits rows, not groups of rows"
    if (model.router_aux_loss_coef or 0) > 0:
        return "model.router_aux_loss_coef counts routed tokens, and a shared prefix's tokens are routed once"
    if config_dict is None:
        return None
    from posttrain.models.moe import MOE_MODEL_TYPES

    if isinstance(config_dict.get("vision_config"), dict):
        return (f"{config_dict.get('model_type')} is a vision-language model: its image features and 3-D rope "
                "positions are per row (not covered yet)")
    if config_dict.get("model_type") in MOE_MODEL_TYPES:
        return (f"{config_dict.get('model_type')} is a mixture of experts: its load-balancing loss counts routed "
                "tokens, and a shared prefix's tokens are routed once")
    if config_dict.get("sliding_window") and config_dict.get("use_sliding_window", True):
        return f"{config_dict.get('model_type')} attends through a sliding window, which the shared mask does not keep"
    if _probe(json.dumps(config_dict, sort_keys=True)) is False:
        return (f"a {config_dict.get('model_type')} model scores rows computed with a shared prefix differently from "
                "rows computed alone")
    return None


def why_not_shared(recipe) -> Optional[str]:
    """Why a run of this recipe computes every row on its own, in words (None: it computes shared prefixes once):
    train.shared_prefix=false, or the `blocker` of its model, read from the config.json the run loads. `posttrain
    plan` asks it too, so the plan counts the tokens the run forwards."""
    if recipe.train.shared_prefix is False:
        return "train.shared_prefix=false"
    from posttrain.models.limits import model_config_file

    config_file = model_config_file(recipe.model.name_or_path, getattr(recipe.model, "revision", None))
    return blocker(recipe, json.loads(config_file.read_text()) if config_file is not None else None)


def resolve_shared_prefix(recipe, algorithm) -> bool:
    """train.shared_prefix at start-up: true where it cannot be exact is a UserError naming why; auto is on unless
    something stands in the way (said once, in the log); false is off."""
    mode = recipe.train.shared_prefix
    if mode is False:
        return False
    why = why_not_shared(recipe)
    if why is None:
        return True
    if mode is True:
        raise UserError(f"train.shared_prefix=true: {why}. Set train.shared_prefix=auto (off where it cannot be "
                        "exact) or false")
    warn(f"train.shared_prefix=auto is off: {why}; every row is computed on its own")
    return False


@functools.lru_cache(maxsize=8)
def _probe(config_json: str) -> Optional[bool]:
    """Whether a narrow random model of this config scores a shared-prefix batch as it scores the rows alone (None:
    no such model can be built here)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.batch import Batch, share_prefixes
    from posttrain.models.forward import policy_logprobs
    from posttrain.models.packing import narrow

    try:
        config_dict = json.loads(config_json)
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        small = narrow(config)
        if small is None:
            return None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small, attn_implementation="sdpa", dtype=torch.float32).eval()
        prompt = list(range(3, 15))
        rows = [prompt + [20, 21, 22], prompt + [30, 31, 32, 33, 34], prompt[:10]]
        ids = torch.tensor([r + [0] * (17 - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (17 - len(r)) for r in rows])
        plain = Batch(ids, mask.bool(), attention_mask_BT=mask, num_sequences=3)
        with torch.no_grad():
            return logprobs_agree(policy_logprobs(model, plain), policy_logprobs(model, share_prefixes(plain)),
                                  mask.bool(), 1e-4)
    except Exception:  # noqa: BLE001 - a config this probe cannot build is not the user's error
        return None


def logprobs_agree(plain_BT: torch.Tensor, shared_BT: torch.Tensor, real_BT: torch.Tensor, atol: float) -> bool:
    """The two layouts' log-probs agree at every real token but each row's first (which nothing predicts)."""
    scored_BT = real_BT.clone()
    scored_BT[:, 0] = False
    return bool(torch.allclose(plain_BT[scored_BT].float(), shared_BT[scored_BT].float(), atol=atol, rtol=0))


def check_first_forward(model, batch, sequence_classifier: bool = False) -> float:
    """A run's first micro-batch: up to FIRST_STEP_ROWS rows that share a prefix, scored with it computed once and
    per row (no gradient, evaluation mode): they must agree within float rounding of the compute dtype, or the run
    stops here, naming the way out. Every rank runs the same two forwards whatever its rows (ZeRO-3's forwards are
    collectives). A sequence classifier (RM) is compared on its scores. Returns the largest difference."""
    from posttrain.batch import Batch, share_prefixes
    from posttrain.models.forward import policy_logprobs, sequence_scores

    found = share_prefixes(batch)
    group_B = found.prefix_group_B.tolist() if found.shares_prefix else list(range(batch.input_ids_BT.shape[0]))
    rows = [b for b, g in enumerate(group_B) if group_B.count(g) > 1][:FIRST_STEP_ROWS] or [0]
    plain = Batch(batch.input_ids_BT[rows], batch.completion_mask_BT[rows],
                  attention_mask_BT=batch.attention_mask_BT[rows], num_sequences=len(rows))
    shared = share_prefixes(plain)
    training = model.training
    model.eval()  # dropout would make the two forwards differ
    try:
        with torch.no_grad():
            if sequence_classifier:
                shared_BT, plain_BT = sequence_scores(model, shared)[:, None], sequence_scores(model, plain)[:, None]
            else:
                shared_BT, plain_BT = policy_logprobs(model, shared), policy_logprobs(model, plain)
    finally:
        model.train(training)
    real_BT = plain.attention_mask_BT.bool().clone()
    real_BT[:, 0] = False  # nothing predicts a row's first token
    if sequence_classifier:  # one score per row
        real_BT = torch.ones_like(shared_BT, dtype=torch.bool)
    diff = float((shared_BT - plain_BT)[real_BT].abs().max()) if real_BT.any() else 0.0
    low_precision = torch.is_autocast_enabled(plain.input_ids_BT.device.type) or any(
        p.dtype != torch.float32 for p in model.parameters())
    tolerance = 0.25 if low_precision else 1e-3  # 16-bit matmuls of other shapes round differently
    if not diff <= tolerance:
        what = "scores" if sequence_classifier else "log-probs"
        raise RuntimeError(f"train.shared_prefix: the first step scored {len(rows)} rows with their shared prefix "
                           f"computed once and computed per row, and their {what} differ by {diff:.3g} (more than "
                           f"{tolerance}): this model's attention does not keep the shared layout exact. Set "
                           "train.shared_prefix=false and report the model")
    return diff
