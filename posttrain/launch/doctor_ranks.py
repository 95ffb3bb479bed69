"""`posttrain doctor --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]`: the doctor
starts its own ranks, so a master that never answers is named by the doctor within `--timeout`.

    posttrain doctor --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr node0 --master-port 29500

Under torchrun the launcher's own rendezvous runs before the doctor does: with an unreachable --master_addr,
torchrun waits its static rendezvous timeout (600 s by default) and the doctor never starts. Here each local rank is
a plain `python -m posttrain doctor` process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, the
way torchrun would set them, and the doctor's own deadlines apply from the first second: the rendezvous address is
probed, every rank's arrival awaited and each collective watched for `--timeout` seconds each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from posttrain.errors import UserError

def add_launch_flags(doctor) -> None:
    doctor.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many ranks here (no torchrun needed; its rendezvous would wait 600 s for an "
                             "unreachable master before the doctor even starts)")
    doctor.add_argument("--nnodes", type=int, default=1, help="with --nproc-per-node: nodes in the group")
    doctor.add_argument("--node-rank", type=int, default=0, help="with --nproc-per-node: this node's rank")
    doctor.add_argument("--master-addr", default="127.0.0.1", help="with --nproc-per-node: rank 0's node")
    doctor.add_argument("--master-port", type=int, default=29500, help="with --nproc-per-node: rank 0's port")


def rank_argv(args) -> list[str]:
    """What each rank runs: the doctor with this call's own options, without the launch flags."""
    return (["doctor", "--timeout", str(args.timeout)] + (["--config", args.config] if args.config else [])
            + (["--build-ops"] if args.build_ops else []) + list(args.overrides))


def run_ranks(args) -> int:
    """Start this node's ranks, wait for them all, and return the worst exit code (their lines go to our stdout)."""
    n, nodes = args.nproc_per_node, args.nnodes
    if "RANK" in os.environ:
        raise UserError("posttrain doctor --nproc-per-node starts its own ranks: run it once per node, not under "
                        "torchrun or accelerate launch")
    if n < 1 or nodes < 1 or not 0 <= args.node_rank < nodes or not 0 < args.master_port < 65536:
        raise UserError(f"need --nproc-per-node >= 1, --nnodes >= 1, 0 <= --node-rank < --nnodes and a port number; "
                        f"got {n}, {nodes}, {args.node_rank}, {args.master_port}")
    command = [sys.executable, "-m", "posttrain", *rank_argv(args)]
    ranks = []
    for local in range(n):
        env = {**os.environ, "RANK": str(args.node_rank * n + local), "WORLD_SIZE": str(nodes * n),
               "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": args.master_addr,
               "MASTER_PORT": str(args.master_port)}
        ranks.append(subprocess.Popen(command, env=env))
    try:
        codes = [rank.wait() for rank in ranks]
    finally:
        for rank in ranks:  # Ctrl-C, or a rank's watchdog ended it: none stays behind
            if rank.poll() is None:
                rank.send_signal(signal.SIGKILL)
                rank.wait()
    return max((c if c >= 0 else 1) for c in codes)
