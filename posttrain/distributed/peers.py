"""Which rank was lost: every rank records (host, pid) of all ranks at start; when a collective fails because a
peer went away, `lost_ranks()` names the ranks on this host whose process has ended (killed, crashed, OOM-killed).
Ranks on other hosts cannot be checked from here (the launcher's report names them)."""

from __future__ import annotations

import os
import socket
from typing import Optional

_PEERS: list[tuple[str, int]] = []  # (host, pid) of every rank of this process group, in rank order


def me() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def record(peers: list[tuple[str, int]]) -> None:
    _PEERS[:] = peers


def process_state(stat_file) -> Optional[str]:
    """The state letter (R running, Z zombie, ...) in a /proc/<pid>/stat file; None when it cannot be read."""
    try:
        with open(stat_file) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def lost_ranks() -> list[int]:
    here = socket.gethostname()
    return [rank for rank, (host, pid) in enumerate(_PEERS)  # Z, X: dead, not yet reaped by the launcher
            if host == here and pid != os.getpid() and process_state(f"/proc/{pid}/stat") in (None, "Z", "X")]
