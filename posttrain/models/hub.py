"""A hub model when the hub cannot be reached: found out in seconds, not after huggingface_hub's retries.

    check_hub_model("Qwen/Qwen2.5-0.5B-Instruct", revision=None, what="model.name_or_path")   # before from_pretrained

Without HF_HUB_OFFLINE, huggingface_hub tries every file of a hub model 5 times (1, 2, 4, 8, 8 s apart) before it
falls back to its cache or fails, so a run on a machine without network spent about a minute retrying before it
said anything (measured: AutoTokenizer.from_pretrained of an uncached Qwen id, no network, 5 retries per file). Here
one bounded probe of the hub (a name lookup and a TCP connection, HUB_PROBE_S in all) decides first: a model in the
Hugging Face cache is then read from it (offline mode for this process, said in one line), and one that is not is a
UserError at once that says how to get it.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
from typing import Optional
from urllib.parse import urlparse

from posttrain.errors import UserError

HUB_PROBE_S = 5.0
"""Seconds the probe of the hub may take, name lookup included."""
TRUE_WORDS = ("1", "true", "yes", "on")


def offline_by_choice() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: nothing is fetched, huggingface_hub fails at once."""
    return any(os.environ.get(k, "").lower() in TRUE_WORDS for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> Optional[str]:
    """Why the hub (HF_ENDPOINT, default https://huggingface.co) cannot be reached now, or None when it takes a TCP
    connection within HUB_PROBE_S (name lookup included: getaddrinfo takes no timeout, so it runs in a thread
    waited on). A proxy is trusted to answer. Probed once per process."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    deadline = time.monotonic() + HUB_PROBE_S
    address = resolve_within(host, port, HUB_PROBE_S)
    if address is None:
        return f"the name {host} did not resolve within {HUB_PROBE_S:g} s"
    if isinstance(address, OSError):
        return f"{host}: {address.strerror or address}"
    try:
        socket.create_connection(address[:2], timeout=max(0.5, deadline - time.monotonic())).close()
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"
    return None


def resolve_within(host: str, port: int, seconds: float):
    """The first TCP address of host:port, the OSError of its look-up, or None when it took longer than `seconds`:
    getaddrinfo takes no timeout (a resolver that keeps retrying blocks for as long as it likes), so it runs in a
    daemon thread waited on that long (posttrain doctor's rendezvous probe uses it too)."""
    answer: list = []

    def look_up() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4])
        except OSError as e:
            answer.append(e)

    worker = threading.Thread(target=look_up, daemon=True, name="posttrain-resolve")
    worker.start()
    worker.join(max(0.0, seconds))
    return answer[0] if answer else None


def check_hub_model(source: str, revision: Optional[str], what: str) -> None:
    """Before a hub id is loaded (not a local directory): when HF_HUB_OFFLINE is unset and the hub cannot be reached,
    a model in the cache is read from it (HF_HUB_OFFLINE for this process, one line on stderr), and one that is not
    cached is a UserError naming it and how to get it. Nothing happens when the hub answers or offline is chosen."""
    if offline_by_choice():
        return
    why = hub_unreachable()
    if why is None:
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source, "config.json", revision=revision), str):
        os.environ["HF_HUB_OFFLINE"] = "1"  # child processes (vLLM engines, servers) too
        constants.HF_HUB_OFFLINE = True  # read at each request by huggingface_hub and transformers
        if os.environ.get("RANK", "0") == "0":
            print(f"posttrain: note: the hub cannot be reached ({why}): {what} {source} is read from the Hugging Face "
                  f"cache ({constants.HF_HUB_CACHE}), HF_HUB_OFFLINE=1 for this run", file=sys.stderr, flush=True)
        return
    raise UserError(f"{what}: {source} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub "
                    f"cannot be reached ({why}). Download it where the hub is reachable (hf download {source}) and "
                    "run with HF_HUB_OFFLINE=1, or give a local model directory (a mirror: HF_ENDPOINT)")
