"""The one HTTP client for generation servers, and what their answers must look like.

    answer = call("http://gpu7:8000", "/inference/v1/generate", body, timeout=300, token=token)
    tokens, logprobs, finish = read_completion(answer, max_tokens=64, vocab_size=32000)

Never a hang, never trust the other side: `timeout` is a deadline for the whole request (connect, send, headers,
body), not for each socket read, so a server that drips a byte at a time is cut off when it is spent; an answer
larger than `max_bytes` is refused (by its Content-Length before any of it is read, or once that much has arrived);
a redirect is never followed (the token would go with it to wherever it points); an answer cut short (fewer bytes than its Content-Length: the server died while
sending it) is an error to retry, never an empty answer; an answer that is not JSON, or not the shape a vLLM answer
has, is an error that says what was wrong. Every error is a `ServerUnavailable`; its `retry`
says whether trying again can help (a refused connection, a missed deadline, HTTP 5xx) or not (a bad answer, 4xx).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from typing import Callable, Optional, TypeVar
from urllib.parse import urlsplit

from posttrain.errors import RunStopped

TOKEN_ENV = "POSTTRAIN_SERVER_TOKEN"
T, R = TypeVar("T"), TypeVar("R")
MAX_ANSWER_BYTES = 32 * 2**20  # a control call's answer; a completion's is sized from its max_tokens
ERROR_DETAIL_BYTES = 4096  # how much of an error answer is read to quote it


class ServerUnavailable(Exception):
    """A request to a generation server failed: refused, out of time, answered with an error or with something that
    is not a valid answer. `status`: the HTTP status when there was one; `retry`: whether another try may succeed."""

    def __init__(self, message: str, status: Optional[int] = None, retry: bool = True):
        super().__init__(message)
        self.status = status
        self.retry = retry


def call(url: str, path: str, body: Optional[dict] = None, timeout: float = 60.0, token: Optional[str] = None,
         max_bytes: int = MAX_ANSWER_BYTES):
    """One HTTP request to a server: POST `body` as JSON (GET when None); returns the decoded JSON answer (None when
    empty). The whole request must end within `timeout` seconds and its answer stay under `max_bytes`. The token
    (default: $POSTTRAIN_SERVER_TOKEN) goes to this server only: redirects are errors, never followed."""
    token = os.environ.get(TOKEN_ENV, "") if token is None else token
    parts = urlsplit(url.rstrip("/") + path)
    connection_class = HTTPSConnection if parts.scheme == "https" else HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()

    def cut():  # the deadline: a blocked connect / read returns at once
        expired.set()
        if connection.sock is not None:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    started = time.monotonic()
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        data = None if body is None else json.dumps(body).encode()
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        connection.request("GET" if body is None else "POST", target, body=data, headers=headers)
        response = connection.getresponse()
        if 300 <= response.status < 400:
            raise ServerUnavailable(f"{path}: HTTP {response.status} redirect to {response.getheader('Location')!r}; "
                                    "posttrain follows no redirect (the token would go with it): give the server's "
                                    "own address", response.status, retry=False)
        if response.status >= 400:
            detail = _read(response, ERROR_DETAIL_BYTES, expired, truncate=True).decode(errors="replace")
            raise ServerUnavailable(f"HTTP {response.status} from {path}: {detail[-500:]}", response.status,
                                    retry=response.status >= 500)
        raw = _read(response, max_bytes, expired)
    except (OSError, HTTPException) as e:  # refused, reset, unreachable, cut by the deadline
        if expired.is_set() or time.monotonic() - started >= timeout:
            raise ServerUnavailable(f"{path}: no complete answer within {timeout:g} s") from None
        reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ServerUnavailable(f"{path}: {reason}") from None
    finally:
        watchdog.cancel()
        connection.close()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServerUnavailable(f"{path}: the answer is not JSON ({e}): {raw[:120]!r}", retry=False) from None


def call_with_retries(url: str, path: str, body: dict, *, timeout: float, token: Optional[str], retries: int,
                      failed: Callable[[ServerUnavailable, int], str], max_bytes: int = MAX_ANSWER_BYTES,
                      abandon: Optional[threading.Event] = None):
    """`call`, tried again up to `retries` times (1, 2, 4 ... at most 10 s apart) while another try may help; then
    RunStopped with the message `failed(error, tries)`. Once `abandon` is set (the batch this request belongs to
    failed or was given up: request_all), no further try goes out."""
    abandon = abandon or threading.Event()
    for attempt in range(retries + 1):
        try:
            return call(url, path, body, timeout=timeout, token=token, max_bytes=max_bytes)
        except ServerUnavailable as e:
            if not e.retry or attempt == retries or abandon.wait(min(2.0 ** attempt, 10.0)):
                raise RunStopped(failed(e, attempt + 1), shared=False) from None


def request_all(pool: ThreadPoolExecutor, request: Callable[[T, threading.Event], R], items: list[T]) -> list[R]:
    """request(item, abandon) for every item on `pool` (bounded: its workers), the answers in order. The first
    failure, or whatever else ends the wait (a second Ctrl-C's KeyboardInterrupt), cancels every request not started
    and sets `abandon`, so those in flight try no more: no request goes out once the call has ended. (A pool's queued
    requests used to run on after a failure, and the process waited for all of them before it could exit.)"""
    abandon = threading.Event()

    def run(item: T) -> R:
        if abandon.is_set():  # a worker freed at the moment of a failure takes no new request
            raise concurrent.futures.CancelledError()
        try:
            return request(item, abandon)
        except BaseException:
            abandon.set()  # at once, from the worker: the others may finish before the waiting thread wakes
            raise

    futures = [pool.submit(run, item) for item in items]
    try:
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futures:  # the failure itself, not a request skipped because of it
            if f.done() and not f.cancelled() and not isinstance(f.exception(), concurrent.futures.CancelledError):
                f.result()
        return [f.result() for f in futures]
    except BaseException:
        abandon.set()
        for f in futures:
            f.cancel()
        raise


def _read(response, max_bytes: int, expired: threading.Event, truncate: bool = False) -> bytes:
    """The body of `response`, at most `max_bytes` (more is an error, or with `truncate` cut off)."""
    length = response.getheader("Content-Length")
    if not truncate and length is not None and length.isdigit() and int(length) > max_bytes:
        raise ServerUnavailable(f"the answer would be {int(length)} bytes, more than the {max_bytes} allowed",
                                retry=False)
    chunks, size = [], 0
    while chunk := response.read1(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            if truncate:
                break
            raise ServerUnavailable(f"the answer passed the {max_bytes} bytes allowed", retry=False)
    if expired.is_set():
        raise OSError("cut by the deadline")
    announced = int(length) if length is not None and length.isdigit() else None
    if not truncate and announced is not None and size < announced:  # http.client's read1 does not check this
        raise ServerUnavailable(f"the connection closed after {size} of the {announced} bytes announced (did the "
                                "server stop?)", retry=True)
    return b"".join(chunks)[:max_bytes]


def completion_bytes(max_tokens: int) -> int:
    """The most bytes an answer to one completion request may take: a generous 4 KiB per token (id, log-prob,
    the token's text and bytes when a server adds them) over a fixed part."""
    return 2**20 + 4096 * max_tokens


class BadAnswer(ValueError):
    """An answer that is not what a vLLM server sends: says which field and how."""


def read_completion(answer, max_tokens: int, vocab_size: Optional[int]) -> tuple[list[int], list[float], str, set]:
    """(token ids, their log-probs, finish reason, weight versions) of a `/inference/v1/generate` answer with one
    choice, checked: ids are ints in [0, vocab_size), at most `max_tokens` of them, one finite log-prob <= 0 each."""
    if not isinstance(answer, dict):
        raise BadAnswer(f"the answer is a {type(answer).__name__}, not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise BadAnswer(f"'choices' must be a list of one object (n=1 was asked), got {_short(choices)}")
    choice = choices[0]
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise BadAnswer(f"'token_ids' must be a list of integers, got {_short(tokens)}")
    if len(tokens) > max_tokens:
        raise BadAnswer(f"{len(tokens)} tokens, but at most {max_tokens} (max_tokens) were asked for")
    bound = vocab_size if vocab_size is not None else 2**31
    outside = [t for t in tokens if not 0 <= t < bound]
    if outside:
        raise BadAnswer(f"token id {outside[0]} is outside the vocabulary [0, {bound})")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or len(content) != len(tokens):
        raise BadAnswer(f"'logprobs.content' must hold one entry per token ({len(tokens)}), got {_short(content)}")
    logprobs = []
    for step in content:
        value = step.get("logprob") if isinstance(step, dict) else None
        if type(value) not in (int, float) or not math.isfinite(value) or value > 0:
            raise BadAnswer(f"log-prob {value!r} of token {len(logprobs)}: a log-prob is a finite number <= 0")
        logprobs.append(float(value))
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length", "abort"):
        raise BadAnswer(f"'finish_reason' is {_short(finish)}, not stop or length")
    spans = choice.get("weight_versions") or []
    if not isinstance(spans, list) or not all(isinstance(s, dict) and "version" in s for s in spans):
        raise BadAnswer(f"'weight_versions' must be a list of {{version: ...}}, got {_short(spans)}")
    return tokens, logprobs, finish, {str(s["version"]) for s in spans}


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
