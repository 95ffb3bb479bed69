"""Adapter-only weight sync (`generation.lora_sync: adapter`): only the LoRA tensors travel, vLLM serves them.

    names = AdapterNames()                       # trainer: one run's names, a new one per sync
    name = names.next()                          # "posttrain-3f9a0c1d-1", "...-2", ...
    write_adapter(adapter_root(), name, tensors, config)        # server worker: safetensors + adapter_config.json
    gap = probe_gap(server_logprobs_K, trainer_logprobs_K)      # after the sync: compare, stop when > the tolerance

Why files: vLLM 0.32 loads a LoRA adapter only from a directory (`LoRARequest.lora_path`), so the tensors travel
over the same four-phase weight transfer as a full sync and each server worker writes them to its machine's
`adapter_root`, where the server's LoRA resolver (posttrain.generation.vllm_weight_transfer) finds them by name; a new
name per sync, as vLLM caches adapters by name. Delivery is checked after every sync, never assumed
(`check_delivery`; verl #7495). The whole story: docs/generation.md, "LoRA: `generation.lora_sync`".
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from posttrain.batch import Batch
from posttrain.errors import RunStopped

PREFIX = "posttrain-"
ROOT_ENV = "POSTTRAIN_ADAPTER_DIR"  # where a server's workers write adapters (default: the temp directory)
KEEP = 2  # adapter versions of a run kept on a server: the current one and the one an async batch may still sample
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank
PROBE_PROMPT = "posttrain adapter probe: the quick brown fox jumps over the lazy dog. Count: one, two,"
PROBE_TOKENS = 4


class AdapterNames:
    """The adapter names of one run: `posttrain-<run key>-<sync count>`, the run key random so a server that outlives
    a run never mixes it up with the next run's adapters."""

    def __init__(self, run_key: str = ""):
        self.run_key = run_key or secrets.token_hex(4)
        self.count = 0
        self.current: str = ""  # "" until the first sync

    def next(self) -> str:
        self.count += 1
        self.current = f"{PREFIX}{self.run_key}-{self.count}"
        return self.current


def parse_name(name: str) -> tuple[str, int]:
    """(run key, sync count) of an adapter name; ValueError for a name that is not one of ours."""
    if not name.startswith(PREFIX):
        raise ValueError(f"{name!r} is not a posttrain adapter name")
    run_key, _, count = name[len(PREFIX):].rpartition("-")
    if not run_key or not count.isdigit() or "/" in run_key or ".." in run_key:
        raise ValueError(f"{name!r} is not a posttrain adapter name")
    return run_key, int(count)


def max_lora_rank(r: int) -> int:
    """vLLM's --max-lora-rank for an adapter of rank r: the smallest of its choices that holds r."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")


def adapter_root() -> Path:
    """Where this machine's server workers write adapters, and where its resolver looks: $POSTTRAIN_ADAPTER_DIR, or
    a per-user directory in the temp directory (the same for the api_server and its workers)."""
    return Path(os.environ.get(ROOT_ENV) or Path(tempfile.gettempdir()) / f"posttrain-adapters-{os.getuid()}")


def adapter_config(peft_model) -> dict:
    """The trained adapter's peft config as adapter_config.json holds it (JSON-safe: sets become sorted lists)."""
    config = peft_model.peft_config[peft_model.active_adapter].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def write_adapter(root: Path, name: str, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`root/name/` with adapter_model.safetensors and adapter_config.json, written under a temporary name and
    renamed (a reader never sees half an adapter); older adapters of the same run beyond the last KEEP are removed."""
    run_key, count = parse_name(name)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial / "adapter_model.safetensors"))
    (partial / "adapter_config.json").write_text(json.dumps(config, indent=1))
    try:  # a directory cannot be renamed onto a full one
        os.rename(partial, final)
    except OSError:  # another worker of the same server wrote the same bytes first
        shutil.rmtree(partial, ignore_errors=True)
    for old in root.glob(f"{PREFIX}{run_key}-*"):
        try:
            if parse_name(old.name)[1] <= count - KEEP:
                shutil.rmtree(old, ignore_errors=True)
        except ValueError:
            continue
    return final


def probe_gap(server_logprobs_K: torch.Tensor, trainer_logprobs_K: torch.Tensor) -> float:
    """Largest absolute difference between a server's sampled-token log-probs and the trainer's teacher-forced
    log-probs of the same tokens (both log_softmax(logits) at temperature 1); inf when the counts differ or either
    is not finite."""
    if server_logprobs_K.shape != trainer_logprobs_K.shape or server_logprobs_K.numel() == 0:
        return float("inf")
    gap_K = (server_logprobs_K.double() - trainer_logprobs_K.double()).abs()
    return float(gap_K.max()) if torch.isfinite(gap_K).all() else float("inf")


@dataclass(frozen=True)
class DeliveryProbe:
    """What one server sampled with the adapter just synced: the probe prompt and its tokens, their log-probs."""

    server: str
    """The server's URL."""
    adapter: str
    """The adapter name it served."""
    prompt_ids: list[int]
    """The probe prompt's token ids."""
    completion_ids: list[int]
    """The tokens it sampled."""
    logprobs: list[float]
    """Their log-probs (temperature 1)."""


def check_delivery(probes: list[DeliveryProbe], policy, device, atol: float, version) -> None:
    """Every rank (the policy's forward is a collective under ZeRO-3 / FSDP2), after an adapter sync: the trainer's
    teacher-forced log-probs of each server's probe tokens (the LoRA policy, which computes what the merged final/
    does) against the server's own; RunStopped naming the server, the adapter and the version when they differ by
    more than `atol` (generation.lora_check_atol)."""
    if not probes:
        return
    policy.train(False)  # no dropout: the server samples without it
    try:
        for probe in probes:
            input_ids_BT = torch.tensor([probe.prompt_ids + probe.completion_ids], device=device)
            batch = Batch(input_ids_BT=input_ids_BT, completion_mask_BT=torch.ones_like(input_ids_BT, dtype=torch.bool),
                          attention_mask_BT=torch.ones_like(input_ids_BT), num_sequences=1)
            with torch.no_grad():
                trainer_K = policy.logprobs(batch)[0, len(probe.prompt_ids):].float().cpu()
            gap = probe_gap(torch.tensor(probe.logprobs, dtype=torch.float32), trainer_K)
            if not gap <= atol:
                raise RunStopped(
                    f"generation server {probe.server} serves adapter {probe.adapter} (policy version {version}) with "
                    f"log-probs up to {gap:.3g} away from the trainer's on a probe of {len(probe.logprobs)} tokens "
                    f"(generation.lora_check_atol={atol:g}): the adapter did not arrive intact, is not the one "
                    "served, or sits on other base weights than the policy's (a server that took another run's "
                    "syncs: restart it). Check the server's log; generation.lora_sync=merged sends full weights")
    finally:
        policy.train(True)
