"""What `posttrain serve` adds to a vLLM server: a token on every request (`--middleware
posttrain.generation.server_worker.TokenGuard`), and vLLM-free helpers its workers use (the worker extension and the
weight-transfer backend are in `posttrain.generation.vllm_weight_transfer`).

`TokenGuard` refuses every request but `/health` without `Authorization: Bearer <POSTTRAIN_SERVER_TOKEN>`. vLLM's
own `--api-key` guards only /v1, /v2, /inference and /cohere, not the dev endpoints that take new weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import threading

import torch

from posttrain.generation.http import TOKEN_ENV

OPEN_PATHS = ("/health",)  # liveness probes (Kubernetes, SLURM scripts) need no token


class TokenGuard:
    """ASGI middleware (vLLM's `--middleware`): the server's token on every request but /health."""

    def __init__(self, app):
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{TOKEN_ENV} is not set: start the server with `posttrain serve` (--token-file or "
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


def prefetched(items, ahead: int = 1):
    """Iterate `items` in a background thread, at most `ahead` items ahead of the consumer (errors re-raised)."""
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
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def repack_tied_lm_head(model) -> None:
    """A tied lm_head gets no tensor of its own (it is the embedding), so its platform-processed copy (oneDNN on a CPU)
    is redone from the reloaded embedding. A vision-language model's head is its language model's."""
    from vllm.model_executor.models.interfaces import supports_multimodal

    if supports_multimodal(model):
        model = model.get_language_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight:
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)

