"""The server engine (`generation.placement: servers`, `node`, `ray`): vLLM servers on any nodes, started with
`posttrain serve` or as a stock `python -m vllm.entrypoints.openai.api_server` with posttrain's weight-transfer
backend (docs/generation.md).

    posttrain serve --model tiny/ --port 8000                      # on each generation GPU / node; prints its URL
    export POSTTRAIN_SERVER_TOKEN=...                              # the same token on both sides
    posttrain grpo --config recipes/grpo_server.yaml generation.servers='[http://gpu7:8000, http://gpu8:8000]'

Each completion is one request to vLLM's token-in / token-out `/inference/v1/generate` (a vision-language policy's
prompt with one placeholder per image and the images as PNG data URLs in `content_parts`: the server widens them), up
to 64 in flight at once, a prompt's group of samples on one server (`assign`); a request still failing after
generation.request_retries stops the run naming the server, and no request of that batch goes out after it
(http.request_all). A weight sync drives vLLM's weight-transfer API (`load_weights`) and stamps the policy version on
every server; a completion stamped with another version (a server that restarted, a sync that did not land) stops the
run. `check_servers` checks every server at start-up, before any model is loaded.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Iterable, Optional
from urllib.parse import urlsplit

from posttrain.distributed.sync_group import local_address_towards
from posttrain.errors import RunStopped, UserError
from posttrain.generation.adapter_sync import PROBE_PROMPT, PROBE_TOKENS, AdapterNames, DeliveryProbe, max_lora_rank
from posttrain.generation.base import Completions, GenerationEngine, SamplingParams, check_prompts, vllm_sampling, vllm_truncated
from posttrain.models.facts import stop_ids, longest_sequence
from posttrain.generation.http import (TOKEN_ENV, BadAnswer, ServerUnavailable, call, call_with_retries,  # noqa: F401
                                    completion_bytes, read_completion, request_all)
from posttrain.generation.weight_transfer import GlooTrainerEngine, GlooTrainerInitInfo, ServersClient

TOKENIZER_PROBE = "posttrain vocabulary probe: What is 12 + 7? Answer: 19."


class ServerEngine(GenerationEngine):
    """`GenerationEngine` over vLLM servers (`posttrain serve`, or stock ones with the gloo-posttrain backend).
    generation: the recipe's `generation.*`; tokenizer: gives the stop ids (models.facts.stop_ids); sends_weights: this process is the trainer
    rank that pushes weight syncs (the others only take part in gathering them); servers, token: other servers than
    generation.servers, another token than the one in POSTTRAIN_SERVER_TOKEN (the engine of a node,
    generation/vllm_node.py); vocab_size: bounds the token ids a server may return (default: the policy's config)."""

    holds_copy = True  # the servers' weights are synced from the trainer
    shared = True  # every rank's requests go to the same servers: all ranks wait until a sync has landed
    outlives_run = True  # the servers go on after the run: they get the final policy

    def __init__(self, generation, tokenizer, sends_weights: bool, servers=None, token: Optional[str] = None,
                 vocab_size: Optional[int] = None):
        self.stop_ids = stop_ids(tokenizer)
        self.servers = list(servers or generation.servers)
        self.token = token
        self.vocab_size = vocab_size if vocab_size is not None else model_vocabulary(tokenizer)
        self.timeout = float(generation.request_timeout_s)
        self.sync_timeout = float(generation.sync_timeout_s)
        self.retries = int(generation.request_retries)
        self.sends_weights = sends_weights
        self.version = None  # the policy version the servers hold; None: their start-up weights
        self._transfer = None  # the weight-transfer engine (rank 0 only), opened at the first sync
        self.tokenizer = tokenizer
        self._adapter_config: Optional[dict] = None  # lora_sync=adapter: the adapter's adapter_config.json
        self._names = None  # lora_sync=adapter: the run's adapter names (AdapterNames)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="posttrain-server")
        self.vision = None  # take_images: data.images.ImageEncoder

    # --- GenerationEngine ---

    def take_images(self, vision) -> None:
        self.vision, self.takes_images = vision, True

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, images: Optional[list] = None
                 ) -> Completions:
        check_prompts(prompt_ids)
        servers = self.assign(prompt_ids, len(self.servers))
        rows = request_all(self._pool, lambda row, abandon: self._generate_one(
            self.servers[servers[row]], prompt_ids[row], params, row, images[row] if images is not None else (),
            abandon), list(range(len(prompt_ids))))
        return Completions([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    @staticmethod
    def assign(prompt_ids: list[list[int]], n_servers: int) -> list[int]:
        """The server of each row: consecutive equal prompts (a prompt's group of samples) stay together, and the
        groups are split into `n_servers` contiguous runs of about equal size."""
        group_B = list(accumulate(int(i > 0 and ids != prompt_ids[i - 1]) for i, ids in enumerate(prompt_ids)))
        return [g * n_servers // (group_B[-1] + 1) for g in group_B]

    def _generate_one(self, url: str, ids: list[int], params: SamplingParams, row: int, refs=(),
                      abandon: Optional[threading.Event] = None):
        adapter = {"model": self._names.current} if self._names and self._names.current else {}
        never = self.vision.image_token_id if self.vision is not None else None
        body = {"token_ids": list(ids), **adapter, "sampling_params": vllm_sampling(params, self.stop_ids, row, never),
                **(image_parts(self.vision, ids, refs) if refs else {})}
        answer = call_with_retries(
            url, "/inference/v1/generate", body, timeout=self.timeout, token=self.token, retries=self.retries,
            max_bytes=completion_bytes(params.max_new_tokens), abandon=abandon,
            failed=lambda e, tries: f"{self.name(url)} failed: {e} ({tries} tries, generation.request_timeout_s="
                                    f"{self.timeout:g} each). Check that it is running (posttrain serve ...) and "
                                    "reachable; checkpoints already saved are complete: continue with "
                                    "train.resume_from_checkpoint=auto")
        try:
            tokens, logprobs, finish, versions = read_completion(answer, params.max_new_tokens, self.vocab_size)
        except BadAnswer as e:
            raise RunStopped(f"{self.name(url)} sent a wrong answer to /inference/v1/generate: {e}. Is it a vLLM "
                             "server serving the policy (posttrain serve ...)?", shared=False) from None
        expected = str(self.version) if self.version is not None else None
        if expected is not None and versions - {expected}:
            raise RunStopped(f"{self.name(url)} sampled with weights of version {sorted(versions)}, not the "
                             f"policy of step {expected} synced to it: did it restart? Restart the run "
                             f"(train.resume_from_checkpoint=auto) so every server gets the weights again",
                             shared=False)
        return tokens, logprobs, vllm_truncated(finish, tokens, self.stop_ids)

    def name(self, url: str) -> str:
        """How errors name a server."""
        return f"generation server {url}"

    def set_version(self, step: int) -> None:
        """The policy version the servers now hold; rank 0 stamps it on every server (vLLM tags each completion)."""
        self.version = step
        if self.sends_weights:
            for url in self.servers:
                self._rpc(url, "/update_weight_version", {"new_version": str(step)}, phase="version")

    def load_weights(self, buckets: Iterable) -> None:
        """Rank 0: one sync through vLLM's weight-transfer API (posttrain.generation.weight_transfer): start, update
        (the backend's buckets broadcast as they come while every server loads them), finish; the transfer group is
        opened at the first sync. Other ranks: iterate (a ZeRO-3 / FSDP2 gather is a collective)."""
        if self._names is not None:  # every rank: its requests name the adapter of this sync
            self._names.next()
        if not self.sends_weights:
            for _ in buckets:
                pass
            return
        if self._transfer is None:
            self._transfer = self._open_transfer()
        self._transfer.source = buckets
        adapter = {} if self._names is None else {"adapter_name": self._names.current,
                                                   "adapter_config": self._adapter_config}
        self._transfer.send_weights(adapter)
        for url in self.servers:
            self._reset_prefix_cache(url)
        if self.vision is not None:
            self._reset_image_caches()

    def _reset_prefix_cache(self, url: str) -> None:
        """After a sync: prefixes the server cached hold keys and values of the old weights, which a later prompt
        sharing their first blocks would reuse (vLLM's prefix caching: on by default on a GPU). vLLM answers
        success false while a request holds blocks (another rank still generating), and the stale blocks then stay:
        the run stops rather than sample from them."""
        answer = self._rpc(url, "/reset_prefix_cache", {}, phase="finish")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RunStopped(f"{self.name(url)} could not reset its prefix cache after a weight sync (a request still "
                             "held cache blocks), so it would serve keys and values of the old weights; start it "
                             "with --no-enable-prefix-caching (posttrain serve ... -- --no-enable-prefix-caching)",
                             shared=False)

    def _reset_image_caches(self) -> None:
        """After a sync: each server's encoder cache holds image embeddings computed with the old vision weights, its
        multi-modal cache the processed inputs of past prompts; both are emptied (vLLM's dev routes)."""
        for url in self.servers:
            for path in ("/reset_encoder_cache", "/reset_mm_cache"):
                self._rpc(url, path, {}, phase="finish")

    # --- lora_sync=adapter ---

    def send_adapters(self, config: dict, run_key: str) -> None:
        self.adapter_only = True
        self._adapter_config = config
        self._names = AdapterNames(run_key)

    def delivery_probes(self) -> list:
        """Rank 0, after an adapter sync: each server's sample of the probe prompt with the new adapter
        (adapter_sync.DeliveryProbe); [] on the other ranks and without lora_sync=adapter."""
        if self._names is None or not self.sends_weights:
            return []
        ids = self.tokenizer(PROBE_PROMPT, add_special_tokens=False)["input_ids"]
        params = SamplingParams(max_new_tokens=PROBE_TOKENS, temperature=1.0, top_p=1.0, top_k=0, seed=0)
        probes = []
        for url in self.servers:
            try:
                tokens, logprobs, _ = self._generate_one(url, ids, params, 0)
            except RunStopped as e:
                raise RunStopped(f"adapter {self._names.current} (policy version {self.version}) was not delivered "
                                 f"to {self.name(url)}: a request naming it failed ({e}). Is the server LoRA-enabled "
                                 "(posttrain serve ... -- --enable-lora --max-lora-rank R)?", shared=False) from None
            probes.append(DeliveryProbe(url, self._names.current, list(ids), tokens, logprobs))
        return probes

    def _open_transfer(self):
        """The init phase: trainer rank 0 hosts the group's store on its address towards the first server (or
        POSTTRAIN_SYNC_ADDR); every worker of every server joins as ranks 1.."""
        client = ServersClient(self.servers, self.token, self.timeout, self.sync_timeout, self.name)
        world = 1 + client.world_size()
        server_host = urlsplit(self.servers[0]).hostname or "127.0.0.1"
        addr = os.environ.get("POSTTRAIN_SYNC_ADDR") or local_address_towards(server_host)
        return GlooTrainerEngine.trainer_init(GlooTrainerInitInfo(addr, world, self.sync_timeout), client=client)

    def _rpc(self, url: str, path: str, body: dict, phase: str = "control", timeout: Optional[float] = None):
        """A control call (no retry: it is not idempotent) that must end within `timeout` (default
        generation.request_timeout_s); a failure stops the run naming the server and the phase of the sync."""
        try:
            return call(url, path, body, timeout=timeout or self.timeout, token=self.token)
        except ServerUnavailable as e:
            raise RunStopped(f"{self.name(url)} failed during a weight sync ({phase} phase): {e}. Check that it is "
                             "running (posttrain serve ...); checkpoints already saved are complete: continue with "
                             "train.resume_from_checkpoint=auto", shared=False) from None

    def close(self) -> None:
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def image_parts(vision, ids: list[int], refs) -> dict:
    """A prompt's images for /inference/v1/generate: its token ids with one placeholder per image (the server widens
    them, as the in-process engine does) and each image as a PNG data URL in `content_parts`."""
    return {"token_ids": vision.narrow(ids, list(refs)),
            "content_parts": [{"type": "image_url", "url": ref.data_url()} for ref in refs]}


def model_vocabulary(tokenizer) -> Optional[int]:
    """The policy's vocabulary size (config.json next to the tokenizer), which bounds the token ids a server may
    return; the tokenizer's own size when there is no such config (a padded embedding can only be larger)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(tokenizer.name_or_path, local_files_only=True)
        config = getattr(config, "text_config", None) or config
        return max(int(config.vocab_size), len(tokenizer))
    except (OSError, ValueError, TypeError, AttributeError):
        return len(tokenizer)


def check_servers(recipe, tokenizer, servers=None) -> None:
    """Before any model is loaded: every server (generation.servers, or the engines the launch wing started) answers,
    takes the token, runs posttrain's weight-sync extension, and serves a model with the trainer's vocabulary,
    tokenizer and context. UserError else."""
    from transformers import AutoConfig

    gen = recipe.generation
    if not os.environ.get(TOKEN_ENV):
        raise UserError(f"generation.placement=servers needs the servers' token in {TOKEN_ENV} (the one given to "
                        f"`posttrain serve --token-file`, or in its environment)")
    config = AutoConfig.from_pretrained(recipe.model.name_or_path, revision=recipe.model.revision,
                                        trust_remote_code=recipe.model.trust_remote_code)
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    probe = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    longest = longest_sequence(recipe)
    timeout = min(gen.request_timeout_s, 30.0)
    for i, url in enumerate(servers or gen.servers):
        where = f"generation.servers[{i}] = {url}"

        def ask(path, body=None, what=""):
            try:
                return call(url, path, body, timeout=timeout)
            except ServerUnavailable as e:
                if e.status == 401:
                    raise UserError(f"{where} refused the token in {TOKEN_ENV}: give the trainer the token the "
                                    "server was started with") from None
                raise UserError(f"{where}: {path} failed ({e}){what}") from None

        def field(answer, *keys):
            try:
                for key in keys:
                    answer = answer[key]
                return answer
            except (KeyError, IndexError, TypeError):
                raise UserError(f"{where}: its answer has no {''.join(f'[{k!r}]' for k in keys)}; is it a vLLM "
                                "server started with `posttrain serve`?") from None

        ask("/health", what="; start it with `posttrain serve --model ...` or fix the address")
        served_model = field(ask("/v1/models", what="; is it a vLLM server?"), "data", 0)
        ask("/get_world_size?include_dp=false", what="; start it with `posttrain serve`, or with "
            "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": \"gloo-posttrain\"}' "
            "(docs/generation.md)")
        try:  # posttrain serve's worker extension; a stock server has none, and its vocabulary goes unchecked
            served = field(call(url, "/collective_rpc", {"method": "posttrain_describe"}, timeout=timeout),
                           "results", 0, "vocab_size")
        except ServerUnavailable:
            served = vocab
        if vocab is not None and served != vocab:
            raise UserError(f"{where} serves a model with a vocabulary of {served} tokens, but "
                            f"model.name_or_path={recipe.model.name_or_path} has {vocab}: start the server with the "
                            "policy's starting weights (posttrain serve --model ...)")
        tokens = field(ask("/tokenize", {"prompt": TOKENIZER_PROBE, "add_special_tokens": False}), "tokens")
        if tokens != probe:
            raise UserError(f"{where} tokenizes text differently from the trainer's tokenizer (model "
                            f"{recipe.model.name_or_path}): start the server with the policy's model directory")
        if gen.lora_sync == "adapter":
            check_runtime_lora(url, where, recipe.model.lora.r, timeout)
        max_len = served_model.get("max_model_len") if isinstance(served_model, dict) else None
        if max_len is not None and (type(max_len) is not int or max_len < longest):
            raise UserError(f"{where} serves at most {max_len} tokens per sequence, but a prompt + completion may "
                            f"take {longest} (data.max_prompt_length or data.max_length, + "
                            "generation.max_completion_length): restart it with a larger --max-model-len")


def check_runtime_lora(url: str, where: str, rank: int, timeout: float) -> None:
    """generation.lora_sync=adapter: the server loads LoRA adapters at run time (its unload route answers "cannot be
    found" for an adapter it never had; without runtime loading vLLM has no such route). UserError else."""
    try:
        call(url, "/v1/unload_lora_adapter", {"lora_name": "posttrain-startup-check-0"}, timeout=timeout)
    except ServerUnavailable as e:
        if "cannot be found" not in str(e):
            raise UserError(f"{where} does not load LoRA adapters at run time, which generation.lora_sync=adapter "
                            f"needs: start it with `posttrain serve --model ... -- --enable-lora --max-lora-rank "
                            f"{max_lora_rank(rank)}` (a stock server: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and those "
                            "options), or set generation.lora_sync=merged") from None
