"""The server engine (`generation.placement: servers`): vLLM servers started with `posttrain serve`, on any nodes.

    posttrain serve --model tiny/ --port 8000                      # on each generation GPU / node; prints its URL
    export POSTTRAIN_SERVER_TOKEN=...                              # the same token on both sides
    posttrain grpo --config recipes/grpo_server.yaml generation.servers='[http://gpu7:8000, http://gpu8:8000]'

Generation: each completion is one request to vLLM's token-in / token-out endpoint (`/inference/v1/generate`), all
in flight at once; a prompt's group of samples goes to one server, the groups are spread evenly over the servers.
Row i of a seeded call gets the seed `seed + i`, as in the in-process engine, so a sample does not depend on which
server drew it. A request that fails is retried (`generation.request_retries`, each with `generation.request_timeout`
seconds); one that still fails stops the run with a message naming the server, never a hang.

Weight sync (trainer rank 0; the other ranks help gather the buckets and wait): rank 0 and every server's workers
form one gloo group (`posttrain.distributed.weight_sync`), set up through `/collective_rpc` and the workers'
`WeightSyncExtension` (`posttrain.rollout.server_worker`). Buckets of `generation.sync_bucket_mb` are broadcast to all
servers at once and stream into one `reload_weights` per worker. Then the policy version is set on every server
(vLLM's `/update_weight_version`): vLLM stamps it on every completion, and this engine refuses a completion stamped
with another version (a server that restarted and lost its weights, a sync that did not land).

Start-up checks (`check_servers`, before any model is loaded): every server answers, takes the token, runs the
weight-sync extension, and serves a model with the trainer's vocabulary and tokenizer; otherwise exit 2.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

from posttrain.errors import RunStopped, UserError
from posttrain.rollout.base import Completions, GenerationEngine, SamplingParams, check_prompts, longest_sequence

TOKEN_ENV = "POSTTRAIN_SERVER_TOKEN"
TOKENIZER_PROBE = "posttrain vocabulary probe: What is 12 + 7? Answer: 19."


class ServerUnavailable(Exception):
    """A request to a generation server failed (refused, timed out, or answered with an error)."""


def call(url: str, path: str, body: Optional[dict] = None, timeout: float = 60.0, token: Optional[str] = None):
    """One HTTP request to a server: POST `body` as JSON (GET when None); returns the decoded JSON answer (None when
    empty). Raises ServerUnavailable saying what went wrong, with the HTTP status in `.status` when there was one."""
    token = os.environ.get(TOKEN_ENV, "") if token is None else token
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[-500:]
        error = ServerUnavailable(f"HTTP {e.code} from {path}: {detail}")
        error.status = e.code
        raise error from None
    except (urllib.error.URLError, OSError) as e:  # refused, reset, unreachable, timed out
        reason = getattr(e, "reason", e)
        raise ServerUnavailable(f"{path}: {reason or type(e).__name__}") from None
    return json.loads(raw) if raw else None


class ServerEngine(GenerationEngine):
    """`GenerationEngine` over `posttrain serve` servers. generation: the recipe's `generation.*`; tokenizer: gives
    the eos id; sends_weights: this process is the trainer rank that pushes weight syncs (the others only take part
    in gathering them); servers, token: other servers than generation.servers, another token than the one in
    POSTTRAIN_SERVER_TOKEN (the engine of a node, rollout/vllm_node.py)."""

    holds_copy = True  # the servers' weights are synced from the trainer
    shared = True  # every rank's requests go to the same servers: all ranks wait until a sync has landed
    outlives_run = True  # the servers go on after the run: they get the final policy

    def __init__(self, generation, tokenizer, sends_weights: bool, servers=None, token: Optional[str] = None):
        if tokenizer.eos_token_id is None:
            raise UserError("the tokenizer has no eos token; set one (tokenizer.eos_token) so generation can stop")
        self.servers = list(servers or generation.servers)
        self.token = token
        self.eos_id = int(tokenizer.eos_token_id)
        self.timeout = float(generation.request_timeout)
        self.retries = int(generation.request_retries)
        self.bucket_bytes = int(generation.sync_bucket_mb * 2**20)
        self.sends_weights = sends_weights
        self._version = None  # the policy version the servers hold; None: their start-up weights
        self._group = None  # the gloo sync group (rank 0 only), opened at the first sync
        self.last_sync: list[dict] = []  # what each server reported of the last sync (receive_s, total_s)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="posttrain-server")

    # --- GenerationEngine ---

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        check_prompts(prompt_ids)
        servers = self.assign(prompt_ids, len(self.servers))
        futures = [self._pool.submit(self._generate_one, self.servers[s], ids, params, i)
                   for i, (ids, s) in enumerate(zip(prompt_ids, servers))]
        rows = [f.result() for f in futures]
        return Completions([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    @staticmethod
    def assign(prompt_ids: list[list[int]], n_servers: int) -> list[int]:
        """The server of each row: consecutive equal prompts (a prompt's group of samples) stay together, and the
        groups are split into `n_servers` contiguous runs of about equal size."""
        starts = [i for i in range(len(prompt_ids)) if i == 0 or prompt_ids[i] != prompt_ids[i - 1]]
        group_of = []
        for g, start in enumerate(starts):
            end = starts[g + 1] if g + 1 < len(starts) else len(prompt_ids)
            group_of += [g] * (end - start)
        return [g * n_servers // len(starts) for g in group_of]

    def _generate_one(self, url: str, ids: list[int], params: SamplingParams, row: int):
        body = {"token_ids": list(ids), "sampling_params": {
            "n": 1,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            **({} if params.seed is None else {"seed": (params.seed + row) % 2**63}),
            "logprobs": 0,  # the sampled token's own log-prob
            "ignore_eos": True,  # the tokenizer's eos stops a completion, as in the other engines
            "stop_token_ids": [self.eos_id],
            "detokenize": False,
        }}
        answer = self._with_retries(url, "/inference/v1/generate", body)
        choice = answer["choices"][0]
        tokens = list(choice["token_ids"])
        logprobs = [float(step["logprob"]) for step in (choice.get("logprobs") or {}).get("content") or []]
        versions = {span["version"] for span in choice.get("weight_versions") or []}
        expected = str(self._version) if self._version is not None else None
        if expected is not None and versions - {expected}:
            raise RunStopped(f"{self.name(url)} sampled with weights of version {sorted(versions)}, not the "
                             f"policy of step {expected} synced to it: did it restart? Restart the run "
                             f"(train.resume_from_checkpoint=auto) so every server gets the weights again",
                             shared=False)
        truncated = choice["finish_reason"] == "length" and (not tokens or tokens[-1] != self.eos_id)
        return tokens, logprobs, truncated

    def _with_retries(self, url: str, path: str, body: dict):
        for attempt in range(self.retries + 1):
            try:
                return call(url, path, body, timeout=self.timeout, token=self.token)
            except ServerUnavailable as e:
                if getattr(e, "status", 500) < 500 or attempt == self.retries:
                    raise RunStopped(
                        f"{self.name(url)} failed: {e} ({attempt + 1} tries, generation.request_timeout="
                        f"{self.timeout:g}s each). Check that it is running (posttrain serve ...) and reachable; "
                        f"checkpoints already saved are complete: continue with train.resume_from_checkpoint=auto",
                        shared=False) from None
                time.sleep(min(2.0 ** attempt, 10.0))

    def name(self, url: str) -> str:
        """How errors name a server."""
        return f"generation server {url}"

    @property
    def version(self):
        return self._version

    @version.setter
    def version(self, step) -> None:
        """The policy version the servers now hold; rank 0 stamps it on every server (vLLM tags each completion)."""
        self._version = step
        if self.sends_weights:
            for url in self.servers:
                self._rpc(url, "/update_weight_version", {"new_version": str(step)})

    def load_weights(self, named_tensors: Iterable) -> None:
        """Rank 0: broadcast the tensors to every server in buckets of `generation.sync_bucket_mb`; the servers load
        them in one `reload_weights` each. Other ranks: iterate (a ZeRO-3 / FSDP2 gather is a collective) and drop."""
        if not self.sends_weights:
            for _ in named_tensors:
                pass
            return
        from posttrain.distributed.weight_sync import send_weights

        if self._group is None:
            self._group = self._open_group()
        receivers = [threading_call(self._rpc, url, "/collective_rpc", {"method": "posttrain_receive"})
                     for url in self.servers]
        try:
            send_weights(self._group, self._buckets(named_tensors))
        finally:
            self.last_sync = [receiver.join()["results"][0] for receiver in receivers]  # each server's seconds
        for url in self.servers:  # prefixes cached before the sync hold keys and values of the old weights
            self._rpc(url, "/reset_prefix_cache", {})

    def _buckets(self, named_tensors: Iterable):
        bucket, size = [], 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor.detach().cpu()))
            size += nbytes
        if bucket:
            yield bucket

    def _open_group(self):
        """Trainer rank 0 hosts the rendezvous store; each server's workers join as ranks 1.. (one call per server,
        all at once: the group forms only when every member is in)."""
        from posttrain.distributed.weight_sync import SyncStore, local_address_towards, open_sync_group

        sizes = [self._rpc(url, "/collective_rpc", {"method": "posttrain_describe"})["results"][0]["world_size"]
                 for url in self.servers]
        world = 1 + sum(sizes)
        addr = os.environ.get("POSTTRAIN_SYNC_ADDR") or local_address_towards(host_of(self.servers[0]))
        store = SyncStore(addr, world, self.timeout)
        joins, base = [], 1
        for url, size in zip(self.servers, sizes):
            spec = json.dumps({"addr": addr, "port": store.port, "base_rank": base, "world_size": world,
                               "timeout_s": self.timeout})
            joins.append(threading_call(self._rpc, url, "/collective_rpc",
                                        {"method": "posttrain_join", "args": [spec]}))
            base += size
        group = open_sync_group(addr, store.port, 0, world, self.timeout, addr, store=store)
        for join in joins:
            join.join()
        return group

    def _rpc(self, url: str, path: str, body: dict):
        """A control call (no retry: it is not idempotent); a failure stops the run naming the server."""
        try:
            return call(url, path, body, timeout=self.timeout, token=self.token)
        except ServerUnavailable as e:
            raise RunStopped(f"{self.name(url)} failed during a weight sync: {e}. Check that it is running "
                             "(posttrain serve ...); checkpoints already saved are complete: continue with "
                             "train.resume_from_checkpoint=auto", shared=False) from None

    def sleep(self) -> None:
        """Nothing to free here: the servers run on their own accelerators."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._pool.shutdown(wait=False, cancel_futures=True)


class threading_call(threading.Thread):
    """Run fn(*args) in a thread; `join()` returns its result or raises its exception."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # re-raised in the caller's thread
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return self.result


def host_of(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname or "127.0.0.1"


def check_servers(recipe, tokenizer, servers) -> None:
    """Before any model is loaded: every server (generation.servers, or the engines the launch wing started) answers,
    takes the token, runs posttrain's weight-sync extension, and serves a model with the trainer's vocabulary,
    tokenizer and context. UserError else."""
    from transformers import AutoConfig

    gen = recipe.generation
    if not os.environ.get(TOKEN_ENV):
        raise UserError(f"generation.placement=servers needs the servers' token in {TOKEN_ENV} (the one given to "
                        f"`posttrain serve --token`, or in its environment)")
    config = AutoConfig.from_pretrained(recipe.model.name_or_path, revision=recipe.model.revision,
                                        trust_remote_code=recipe.model.trust_remote_code)
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    probe = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    longest = longest_sequence(recipe)
    timeout = min(gen.request_timeout, 30.0)
    for i, url in enumerate(servers):
        where = f"generation.servers[{i}] = {url}"
        try:
            call(url, "/health", timeout=timeout)
        except ServerUnavailable as e:
            raise UserError(f"{where}: no answer ({e}); start it with `posttrain serve --model ...` or fix the "
                            "address") from None
        try:
            models = call(url, "/v1/models", timeout=timeout)
        except ServerUnavailable as e:
            if getattr(e, "status", None) == 401:
                raise UserError(f"{where} refused the token in {TOKEN_ENV}: give the trainer the token the server "
                                "was started with") from None
            raise UserError(f"{where}: /v1/models failed ({e}); is it a vLLM server?") from None
        try:
            described = call(url, "/collective_rpc", {"method": "posttrain_describe"}, timeout=timeout)["results"]
        except ServerUnavailable as e:
            raise UserError(f"{where} has no posttrain weight-sync extension ({e}); start it with `posttrain serve`, "
                            "not `vllm serve`") from None
        served = described[0]["vocab_size"]
        if vocab is not None and served != vocab:
            raise UserError(f"{where} serves a model with a vocabulary of {served} tokens, but "
                            f"model.name_or_path={recipe.model.name_or_path} has {vocab}: start the server with the "
                            "policy's starting weights (posttrain serve --model ...)")
        tokens = call(url, "/tokenize", {"prompt": TOKENIZER_PROBE, "add_special_tokens": False},
                      timeout=timeout)["tokens"]
        if tokens != probe:
            raise UserError(f"{where} tokenizes text differently from the trainer's tokenizer (model "
                            f"{recipe.model.name_or_path}): start the server with the policy's model directory")
        max_len = models["data"][0].get("max_model_len")
        if max_len is not None and max_len < longest:
            raise UserError(f"{where} serves at most {max_len} tokens per sequence, but a prompt + completion may "
                            f"take {longest} (data.max_prompt_length or data.max_length, + "
                            "generation.max_completion_length): restart it with a larger --max-model-len")
