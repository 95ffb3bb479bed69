"""The HF engine: transformers `model.generate` on the policy model itself, in the training process.

    engine = HFEngine(model, tokenizer)                     # model: the unwrapped policy (accelerator.unwrap_model)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, temperature=0.7, seed=3))

Only the sampling knobs of `SamplingParams` shape the distribution: the model's own generation_config.json
(repetition penalty, min_new_tokens, ...) is overridden with neutral values, because the reported log-probs, and the
trainer's, are those of plain softmax(logits / temperature); anything else would make the samples off-policy.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable, Optional

import torch
from torch.nn.utils.rnn import pad_sequence

from posttrain.generation.base import Completions, GenerationEngine, SamplingParams, check_prompts
from posttrain.data.collate import pad_id
from posttrain.models.facts import stop_ids

# Logits processors transformers would otherwise pick up from the model's generation_config.json.
NEUTRAL_GENERATION = dict(num_beams=1, num_return_sequences=1, min_new_tokens=0, repetition_penalty=1.0,
                          encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0,
                          eta_cutoff=0.0, renormalize_logits=False, remove_invalid_values=False)


class HFEngine(GenerationEngine):
    """`GenerationEngine` over transformers generate. Shares the policy in-process: no weight copies, no sync.

    model: a causal LM (the unwrapped policy, or a separate copy). tokenizer: gives the stop ids (models.facts.stop_ids)
    and the pad id.
    gather: factory of a context manager entered around generation that gives the model its full parameters once for
    the whole call (ZeRO-3, FSDP2: `Backend.gathered_parameters`) instead of an all-gather per forward, or None.
    batch_size: prompts per `model.generate` call (None: all at once). collective: the model is sharded over the
    training ranks (the factory says so when there are several), so every rank must generate in step.
    """

    def __init__(self, model, tokenizer, gather: Optional[Callable[[], ContextManager]] = None,
                 batch_size: Optional[int] = None, collective: bool = False):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.model, self.tokenizer, self.gather, self.batch_size = model, tokenizer, gather, batch_size
        self.collective = collective
        self.vision = None  # take_images: each prompt's images -> batch.VisionInputs
        self.stop_ids = stop_ids(tokenizer)
        self.pad_id = pad_id(tokenizer)

    # --- GenerationEngine ---

    def take_images(self, vision) -> None:
        self.vision, self.takes_images = vision, True

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, images: Optional[list] = None
                 ) -> Completions:
        check_prompts(prompt_ids)
        if not prompt_ids:
            return Completions([], [], [])
        step = self.batch_size or len(prompt_ids)
        with self._generation_mode(), self._rng(params.seed):
            chunks = [self._generate_chunk(prompt_ids[start : start + step], params,
                                           images[start : start + step] if images is not None else None)
                      for start in range(0, len(prompt_ids), step)]
        return Completions([r for c in chunks for r in c.completion_ids], [r for c in chunks for r in c.logprobs],
                           [r for c in chunks for r in c.truncated])

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Copy each bucket's tensors into the model's parameters and buffers by name (nothing to copy when the engine
        wraps the policy itself, the usual case: the tensors are its parameters)."""
        targets = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in (pair for bucket in buckets for pair in bucket):
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"load_weights: the engine model has no parameter or buffer named '{name}'")
                if target.shape != tensor.shape:
                    raise ValueError(f"load_weights: '{name}' has shape {tuple(tensor.shape)}, "
                                     f"the engine model's is {tuple(target.shape)}")
                if target.data_ptr() == tensor.data_ptr() and target.device == tensor.device:
                    continue
                target.data.copy_(tensor.detach())

    # --- internals ---

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams,
                        images: Optional[list] = None) -> Completions:
        device = _device_of(self.model)
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts]  # left padded: every prompt ends in one column
        input_ids = pad_sequence(rows, batch_first=True, padding_value=self.pad_id, padding_side="left")
        attention_mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
        width = input_ids.shape[1]
        vision = self.vision(images) if images is not None else None  # the prompts' pixels, for the first forward
        extra = vision.to(device).model_inputs(input_ids.to(device)) if vision is not None else {}
        # under ZeRO-3 / FSDP transformers keeps the ranks stepping together until the last completion ends
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  generation_config=self._generation_config(params), **extra)
        new_BN = out.sequences[:, width:].cpu()
        # Raw logits, one (B, V) tensor per new token; processed `scores` would carry top-k/top-p masking.
        temperature = params.logprob_temperature
        logprobs_BN = torch.stack([torch.log_softmax(logits_BV.float() / temperature, dim=-1)
                                   .gather(-1, new_BN[:, n, None].to(logits_BV.device)).squeeze(-1).cpu()
                                   for n, logits_BV in enumerate(out.logits)], dim=1)
        ids, logprobs, truncated = [], [], []
        for row in range(new_BN.shape[0]):
            tokens = new_BN[row].tolist()
            stop = next((n + 1 for n, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
            ids.append(tokens[:stop])
            logprobs.append(logprobs_BN[row, :stop].tolist())
            truncated.append(bool(tokens) and tokens[stop - 1] not in self.stop_ids)  # ran out of tokens, no stop id
        return Completions(ids, logprobs, truncated)

    def _generation_config(self, params: SamplingParams):
        from transformers import GenerationConfig

        sampling = {}
        if not params.greedy:
            sampling = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            if getattr(getattr(self.model, "generation_config", None), "min_p", None) is not None:
                sampling["min_p"] = 0.0  # a model default would otherwise apply
        if self.vision is not None:  # an image placeholder in a completion would have no pixels to stand for
            sampling["suppress_tokens"] = [self.vision.image_token_id]
        return GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=not params.greedy, use_cache=True,
                                eos_token_id=list(self.stop_ids), pad_token_id=self.pad_id, return_dict_in_generate=True,
                                output_logits=True, **NEUTRAL_GENERATION, **sampling)

    @contextlib.contextmanager
    def _generation_mode(self):
        """eval() (no dropout, no gradient checkpointing), the KV cache on, and the caller's gather; all restored."""
        model = self.model
        was_training = model.training
        config = getattr(model, "config", None)
        use_cache = getattr(config, "use_cache", None)
        gather = self.gather() if self.gather is not None else contextlib.nullcontext()
        try:
            model.eval()
            if use_cache is False:
                config.use_cache = True  # gradient checkpointing turns it off for training
            with gather, torch.no_grad():
                yield
        finally:
            if use_cache is False:
                config.use_cache = False
            model.train(was_training)

    @contextlib.contextmanager
    def _rng(self, seed: Optional[int]):
        """Seed the global RNG for this call and put it back afterwards, so training randomness is unaffected."""
        if seed is None:
            yield
            return
        device = _device_of(self.model)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            yield


def _device_of(model) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device
