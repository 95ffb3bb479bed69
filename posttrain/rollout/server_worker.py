"""What `posttrain serve` adds to a vLLM server: weight sync in its workers, and a token on every request.

    python -m vllm.entrypoints.openai.api_server --model DIR \
        --worker-extension-cls posttrain.rollout.server_worker.WeightSyncExtension \
        --middleware posttrain.rollout.server_worker.TokenGuard      # POSTTRAIN_SERVER_TOKEN set; VLLM_SERVER_DEV_MODE=1

`WeightSyncExtension` is mixed into each of vLLM's workers; the trainer calls its methods through the dev endpoint
`/collective_rpc` (string arguments only: vLLM passes no tensors there). The tensors themselves travel over a gloo
group between trainer rank 0 and the workers (`posttrain.distributed.weight_sync`), and go into the model through
the worker's `reload_weights`, which redoes the platform's processing of each reloaded layer (oneDNN repacking on a
CPU) that a bare `model.load_weights` would skip.

`TokenGuard` refuses every request but `/health` without `Authorization: Bearer <POSTTRAIN_SERVER_TOKEN>`. vLLM's
own `--api-key` guards only /v1, /v2, /inference and /cohere, not the dev endpoints that take new weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

TOKEN_ENV = "POSTTRAIN_SERVER_TOKEN"
OPEN_PATHS = ("/health",)  # liveness probes (Kubernetes, SLURM scripts) need no token


class TokenGuard:
    """ASGI middleware (vLLM's `--middleware`): the server's token on every request but /health."""

    def __init__(self, app):
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{TOKEN_ENV} is not set: start the server with `posttrain serve` (--token or "
                               f"{TOKEN_ENV})")
        self.app = app
        self.token_hash = hashlib.sha256(token.encode()).digest()

    def allowed(self, scope) -> bool:
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.encode()).digest()
                return scheme.lower() == "bearer" and secrets.compare_digest(given, self.token_hash)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS and not self.allowed(scope):
            body = json.dumps({"error": f"unauthorized: send 'Authorization: Bearer <{TOKEN_ENV}>'"}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class WeightSyncExtension:
    """Methods added to vLLM's worker, called by the trainer through /collective_rpc (JSON strings in and out)."""

    def posttrain_describe(self) -> dict:
        """What the trainer checks before it starts: vocabulary size, and this worker's rank among the server's."""
        config = self.model_runner.model_config.hf_text_config
        return {"vocab_size": int(config.vocab_size), "rank": int(self.rank),
                "world_size": int(self.parallel_config.world_size)}

    def posttrain_join(self, spec: str) -> None:
        """Join the trainer's sync group: spec = {"addr", "port", "base_rank", "world_size", "timeout_s"}; this worker
        is group rank base_rank + its rank in the server. Blocks until every member has joined."""
        from posttrain.distributed.weight_sync import local_address_towards, open_sync_group

        s = json.loads(spec)
        self.posttrain_close()
        self._posttrain_group = open_sync_group(s["addr"], s["port"], s["base_rank"] + self.rank, s["world_size"],
                                                s["timeout_s"], local_address_towards(s["addr"]))

    def posttrain_close(self) -> None:
        group = getattr(self, "_posttrain_group", None)
        self._posttrain_group = None
        if group is not None:
            group.close()

    def posttrain_receive(self) -> dict:
        """Receive one weight sync (streamed bucket by bucket into a single `reload_weights`, so no layer is ever
        reloaded from half new, half old weights); the next bucket is received while one is loaded. Returns the seconds
        the loader waited for bytes (receive_s) and the whole sync took (total_s); with
        POSTTRAIN_SYNC_DIGESTS=1 in the server's environment it also keeps a SHA-256 per tensor (`posttrain_digests`;
        tests compare them with final/, at some cost per sync)."""
        import time

        from posttrain.distributed.weight_sync import receive_buckets

        if getattr(self, "_posttrain_group", None) is None:
            raise RuntimeError("posttrain_receive before posttrain_join: the trainer opens the sync group first")
        keep_digests = os.environ.get("POSTTRAIN_SYNC_DIGESTS") == "1"
        digests, receiving = {}, [0.0]
        started = time.perf_counter()

        def stream():  # the next bucket arrives (another thread) while this one is loaded
            buckets = prefetched(receive_buckets(self._posttrain_group))
            while True:
                t = time.perf_counter()
                bucket = next(buckets, None)
                receiving[0] += time.perf_counter() - t
                if bucket is None:
                    return
                for name, tensor in bucket:
                    if keep_digests:
                        digests[name] = tensor_digest(tensor)
                    yield name, tensor

        self.reload_weights(weights_iterator=stream())
        repack_tied_lm_head(self.model_runner.get_model())
        self._posttrain_digests = digests
        return {"receive_s": receiving[0], "total_s": time.perf_counter() - started}

    def posttrain_broadcast_only(self, sizes: str) -> None:
        """bench/weight_sync.py's baseline: take part in plain broadcasts of these byte counts and drop the bytes."""
        import torch

        for size in json.loads(sizes):
            self._posttrain_group.broadcast(torch.empty(size, dtype=torch.uint8))

    def posttrain_digests(self) -> dict:
        """SHA-256 per tensor of the last sync this worker received (empty before the first)."""
        return getattr(self, "_posttrain_digests", {})


def prefetched(items, ahead: int = 1):
    """Iterate `items` in a background thread, at most `ahead` items ahead of the consumer (errors re-raised)."""
    import queue
    import threading

    box: queue.Queue = queue.Queue(maxsize=ahead)
    done = object()

    def pump():
        try:
            for item in items:
                box.put(item)
            box.put(done)
        except BaseException as e:  # handed to the consumer's thread
            box.put(e)

    threading.Thread(target=pump, daemon=True, name="posttrain-sync-receive").start()
    while (item := box.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def tensor_digest(tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (what `posttrain_digests` reports, and what tests compare)."""
    import torch

    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def repack_tied_lm_head(model) -> None:
    """A tied lm_head gets no tensor of its own (it is the embedding), so its platform-processed copy (oneDNN on a CPU)
    is redone from the reloaded embedding."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight:
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)
