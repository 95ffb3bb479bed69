"""Recipe spellings of earlier releases, read as today's keys before the recipe is built (so old recipes keep working).

    generation.engine: server                  -> generation.engine: vllm, generation.placement: servers
    generation.vllm.placement: rank | node     -> generation.placement: colocated | node
    generation.request_timeout                 -> generation.request_timeout_s (a whole-request deadline)
    generation.async: true | false             -> generation.max_staleness: 1 | 0 (batches sampled ahead)
    placement.generation.num_engines: N > 0    -> generation.placement: ray (N engines as Ray actors; launcher: ray,
                                                  the only launcher that reads placement.*)
    rollout: {tools, environment, ...}         -> agent: {...} (the multi-turn agent loop; "rollout" now means the
                                                  online batch only)

Each rewrite is said once (rank 0) so the user can move the recipe over. A spelling that contradicts the new key
given beside it is exit 2 naming both.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from posttrain.errors import UserError

VLLM_PLACEMENTS = {"rank": "colocated", "node": "node"}


def _set_placement(generation: dict, value: str, old: str) -> None:
    given = generation.get("placement")
    if given is not None and given != value:
        raise UserError(f"{old} means generation.placement={value}, but generation.placement={given} is given too: "
                        f"drop {old} (generation.placement is the one answer to where generation runs)")
    generation["placement"] = value


def _upgrade_async(generation: dict) -> str:
    """generation.async (one batch sampled ahead, or none) -> generation.max_staleness."""
    old = generation.pop("async")
    if not isinstance(old, bool):
        raise UserError(f"generation.async must be true or false, got {old!r} (it is now generation.max_staleness: "
                        "the number of generation batches sampled ahead)")
    given = generation.get("max_staleness")
    if given is not None and given != int(old):
        raise UserError(f"generation.async={str(old).lower()} means generation.max_staleness={int(old)}, but "
                        f"generation.max_staleness={given} is given too: drop generation.async")
    generation["max_staleness"] = int(old)
    return f"generation.async={str(old).lower()} is now generation.max_staleness={int(old)}"


def _upgrade_rollout_section(raw: dict) -> str:
    """The agent loop's section, once named `rollout:` -> `agent:`."""
    old = raw.pop("rollout")
    given = raw.get("agent")
    if given is not None and given != old:
        raise UserError("the recipe has both rollout: and agent: (rollout: is the old name of agent:, the multi-turn "
                        "agent loop's section); keep agent: alone")
    raw["agent"] = old
    return "the rollout: section is now agent: (the multi-turn agent loop)"


def upgrade(raw: dict[str, Any], say: bool = True) -> list[str]:
    """Rewrite earlier spellings in `raw` (the recipe mapping, overrides applied) in place; returns what was
    rewritten, one line each (printed on rank 0 when `say`)."""
    notes = []
    generation = raw.get("generation")
    if isinstance(generation, dict):
        if generation.get("engine") == "server":
            _set_placement(generation, "servers", "generation.engine=server")
            generation["engine"] = "vllm"
            notes.append("generation.engine=server is now generation.engine=vllm with generation.placement=servers")
        if "request_timeout" in generation:
            if "request_timeout_s" in generation:
                raise UserError("generation.request_timeout and generation.request_timeout_s are both given: keep "
                                "generation.request_timeout_s")
            generation["request_timeout_s"] = generation.pop("request_timeout")
            notes.append("generation.request_timeout is now generation.request_timeout_s")
        if "async" in generation:
            notes.append(_upgrade_async(generation))
        vllm = generation.get("vllm")
        if isinstance(vllm, dict) and "placement" in vllm:
            old = vllm.pop("placement")
            if old not in VLLM_PLACEMENTS:
                raise UserError(f"generation.vllm.placement is {old!r} (now generation.placement: colocated, node, "
                                "servers or ray); set generation.placement instead")
            _set_placement(generation, VLLM_PLACEMENTS[old], f"generation.vllm.placement={old}")
            notes.append(f"generation.vllm.placement={old} is now generation.placement={VLLM_PLACEMENTS[old]}")
    if "rollout" in raw:
        notes.append(_upgrade_rollout_section(raw))
    placement = raw.get("placement")
    engines = placement.get("generation", {}) if isinstance(placement, dict) else {}
    count = engines.get("num_engines") if isinstance(engines, dict) else None
    if isinstance(count, int) and not isinstance(count, bool) and count > 0 and raw.get("launcher") == "ray":
        generation = raw.setdefault("generation", {}) if isinstance(raw.get("generation", {}), dict) else {}
        if "placement" not in generation:
            generation["placement"] = "ray"
            if generation.get("engine", "hf") == "hf":
                generation["engine"] = "vllm"
            notes.append("placement.generation.num_engines > 0 now goes with generation.placement=ray")
    if say and notes and os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"posttrain: note: {note} (the recipe is read that way)", file=sys.stderr, flush=True)
    return notes
