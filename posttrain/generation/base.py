"""The generation-engine interface: prompt token ids in, completion token ids and their log-probs out.

Online algorithms (GRPO, PPO) sample completions from the current policy, score them and train on them. The loop only
ever talks to a `GenerationEngine`, so where the sampling happens is a launch-time choice (generation/engines.py: hf on
the policy itself, vLLM in-process, one vLLM engine per node, vLLM servers).

    engine = make_engine(recipe, backend, policy, tokenizer)
    out = engine.generate([tokenizer("What is 2 + 3?")["input_ids"]], SamplingParams(max_new_tokens=64, seed=step))
    out.completion_ids[0], out.logprobs[0], out.truncated[0]

Log-probs contract: `logprobs[i][t]` is log_softmax(logits / temperature)[completion_ids[i][t]] of the model's raw
logits (temperature 1 when sampling greedily), which is what the trainer computes with
`posttrain.ops.logprobs.token_logprobs(logits, ids, temperature)`. Top-k/top-p shape what is sampled, not the
log-probs, exactly as in the trainer's forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

from posttrain.errors import UserError

if TYPE_CHECKING:
    import torch

    from posttrain.config.schema import GenerationConfig


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: off)."""
    seed: Optional[int] = None
    """Seed of the sampling RNG for this call (None: the global RNG as it stands). Same seed, same completions."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are computed at: the sampling temperature, or 1.0 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0

    @classmethod
    def from_config(cls, cfg: "GenerationConfig", seed: Optional[int] = None) -> "SamplingParams":
        """The recipe's `generation.*` section as sampling parameters."""
        return cls(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, seed)


def check_prompts(prompt_ids: list[list[int]]) -> None:
    """What every engine's `generate` checks first: each prompt has at least one token."""
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")


def vllm_sampling(params: SamplingParams, stops: tuple[int, ...], row: int, never: Optional[int] = None) -> dict:
    """vLLM's sampling parameters for row `row` of a call (in-process engine and servers alike): a seeded call gives
    row i the seed `seed + i`, so a sample depends neither on the rest of the batch nor on the server that drew it.
    `never`: a token never to sample (a VLM's image placeholder), biased by -100 (vLLM's floor: e^-100 ~ 4e-44)."""
    return dict(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                **({} if params.seed is None else {"seed": (params.seed + row) % 2**63}),
                **({} if never is None else {"logit_bias": {never: -100.0}}),
                logprobs=0,  # the sampled token's own log-prob
                ignore_eos=True,  # our stop ids (`stop_ids`) end a completion, as in the HF engine
                stop_token_ids=list(stops), detokenize=False)


def vllm_truncated(finish_reason: str, tokens: list[int], stops: tuple[int, ...]) -> bool:
    """A vLLM completion hit max_tokens without ending on a stop id."""
    return finish_reason == "length" and (not tokens or tokens[-1] not in stops)


@dataclass(frozen=True)
class Completions:
    """One completion per prompt, in prompt order."""

    completion_ids: list[list[int]]
    """New tokens only, no padding; ends with a stop id (`stop_ids`) when the model produced one."""
    logprobs: list[list[float]]
    """log_softmax(logits / temperature) of each completion token (temperature 1 when greedy); same lengths."""
    truncated: list[bool]
    """True when the completion hit max_new_tokens without a stop id."""

    def __post_init__(self):
        if not len(self.completion_ids) == len(self.logprobs) == len(self.truncated):
            raise ValueError(f"Completions: {len(self.completion_ids)} completions, {len(self.logprobs)} log-prob "
                             f"lists, {len(self.truncated)} truncated flags; they must match")
        for i, (ids, lps) in enumerate(zip(self.completion_ids, self.logprobs)):
            if len(ids) != len(lps):
                raise ValueError(f"Completions: completion {i} has {len(ids)} tokens but {len(lps)} log-probs")

    def __len__(self) -> int:
        return len(self.completion_ids)


class GenerationEngine:
    """What every engine answers (hf, vllm in-process, the node engine, servers). Capabilities are declared here with
    their defaults, and each engine says its own: callers ask, they never probe."""

    holds_copy: bool = False
    """It samples from its own copy of the weights, which the trainer syncs (vllm, servers); hf uses the policy."""
    shared: bool = False
    """Every rank's requests go to the same engine: no rank generates before the syncing rank's sync has landed."""
    outlives_run: bool = False
    """It goes on after the run (servers of one's own): it gets the final policy."""
    version: Optional[int] = None
    """The policy version (optimiser step) its weights are from; None: its start-up weights. Read freely; changed
    only by `set_version`, which may call out (servers)."""
    adapter_only: bool = False
    """Its syncs carry the LoRA adapter alone (generation.lora_sync=adapter, servers), each checked by a probe."""
    collective: bool = False
    """Its generate is a collective over the training ranks (hf under ZeRO-3 / FSDP2 gathers the parameters): every
    rank must make the same calls, even one with nothing left to generate."""
    takes_images: bool = False
    """Its generate takes each prompt's images (`images=`), after `take_images` (hf, vllm, servers)."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        """Sample one completion per prompt (prompts are unpadded token-id lists, any lengths). An engine that
        `takes_images` also takes `images=`: each prompt's images (data.images.ImageRef lists), whose placeholder
        tokens the prompt ids already hold widened."""
        raise NotImplementedError

    def take_images(self, vision) -> None:
        """Generate from prompts with images from now on; `vision(images per prompt)` gives their pixel tensors
        (batch.VisionInputs) and `vision.image_token_id` is the placeholder token never to sample
        (data.images.ImageEncoder)."""
        raise UserError(f"the {type(self).__name__} cannot generate from images yet; use generation.engine=hf "
                        "(generation.placement=colocated) or a vLLM engine for a vision-language model")

    def load_weights(self, buckets: Iterable[list[tuple[str, "torch.Tensor"]]]) -> None:
        """Make the engine sample from these weights: the backend's buckets (`Backend.weight_buckets`: lists of
        (name, full tensor), names as the plain transformers model has them), taken as they come, one sync."""
        raise NotImplementedError

    def set_version(self, step: int) -> None:
        """After a sync: the policy version (optimiser step) its weights now hold. Servers stamp it on every server
        (one call each), so a completion sampled with other weights is caught."""
        self.version = step

    def send_adapters(self, config: dict, run_key: str) -> None:
        """Sync the LoRA adapter alone from now on (generation.lora_sync=adapter): `config` is its
        adapter_config.json, `run_key` the run's part of every adapter name (the same on every rank)."""
        raise UserError(f"generation.lora_sync=adapter: the {type(self).__name__} cannot load an adapter alone; "
                        "use generation.lora_sync=merged, or a vLLM server placement (node, servers, ray)")

    def delivery_probes(self) -> list:
        """After an adapter-only sync, on a syncing rank: what each of its servers sampled with the new adapter
        (posttrain.generation.adapter_sync.DeliveryProbe), for every rank to check; [] elsewhere."""
        return []

    def prefix_cache_hits(self) -> Optional[tuple[int, int]]:
        """(prompt tokens read from its prefix cache, prompt tokens) since the last call; None: it keeps no prefix
        cache it can count (off, or a server)."""
        return None

    def sleep(self) -> None:
        """Release what the engine holds on the accelerator between generations (KV cache, weights)."""

    def wake(self) -> None:
        """Take back what `sleep` released, before the next `generate`."""

    def close(self) -> None:
        """After the run's final sync: let go of what it holds for syncing (a sync group)."""

    def end(self) -> None:
        """After the run's last collective: tear down a runtime of its own in this process (vLLM's)."""
