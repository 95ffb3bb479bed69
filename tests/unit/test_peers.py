"""lost_ranks names the ranks on this host whose process ended, and nothing else."""

from __future__ import annotations

import socket
import subprocess
import sys

from posttrain.distributed import peers


def test_lost_ranks_are_the_ended_processes_on_this_host():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        peers.record([peers.me(), (socket.gethostname(), ended.pid), (socket.gethostname(), alive.pid),
                      ("another-host", ended.pid)])
        assert peers.lost_ranks() == [1]
    finally:
        alive.kill()
        alive.wait()
        peers.record([])
