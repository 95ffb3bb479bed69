"""Which rank was lost: every rank records (host, pid) of all ranks at start; when a collective fails because a
peer went away, `lost_ranks()` names the ranks on this host whose process has ended (killed, crashed, OOM-killed).
Ranks on other hosts cannot be checked from here (the launcher's report names them)."""

from __future__ import annotations

import os
import socket

_PEERS: list[tuple[str, int]] = []  # (host, pid) of every rank of this process group, in rank order


def me() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def record(peers: list[tuple[str, int]]) -> None:
    _PEERS[:] = peers


def lost_ranks() -> list[int]:
    here = socket.gethostname()
    lost = []
    for rank, (host, pid) in enumerate(_PEERS):
        if host != here or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                gone = f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # dead, not yet reaped by the launcher
        except OSError:
            gone = True
        lost += [rank] if gone else []
    return lost
