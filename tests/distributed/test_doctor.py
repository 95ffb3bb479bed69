"""posttrain doctor under a launcher: passes on 2 gloo processes; a wrong MASTER_ADDR and a rank that never joins
fail within the timeout, naming what is wrong, instead of hanging."""

import subprocess
import sys
import time

from tests.distributed.launch import ROOT, free_port, launch, worker_env


def test_doctor_passes_on_two_gloo_processes(tmp_path, tiny_model_dir):
    """doctor --config checks the recipe's model and data exist too: the recipe's tiny/ is the session's model."""
    r = launch(2, "doctor", [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={tiny_model_dir}", "--timeout",
                             "60"], config="recipes/sft.yaml", timeout=180)
    assert r.returncode == 0, r.output[-4000:]
    for rank in (0, 1):
        assert f"[rank {rank}] PASS  rendezvous: 2 ranks joined" in r.output, r.output[-4000:]
        assert f"[rank {rank}] PASS  all_reduce" in r.output
    assert "PASS  same recipe" in r.output and "is shared by all ranks" in r.output
    assert "doctor: all checks passed" in r.output and "FAIL" not in r.output


def _doctor_alone(rank: int, port: int, timeout: float = 3) -> subprocess.Popen:
    """One rank of a 2-rank group started by hand, its partner never started."""
    env = worker_env(env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(port)})
    return subprocess.Popen([sys.executable, "-m", "posttrain", "doctor", "--timeout", str(timeout)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_wrong_master_addr_and_a_rank_that_never_joins_fail_within_the_timeout():
    started = time.perf_counter()
    # rank 1 alone: nobody listens at MASTER_ADDR:MASTER_PORT (the doctor's own ranks, --nproc-per-node: under
    # torchrun, its rendezvous would wait 600 s before the doctor starts); rank 0 alone: it hosts the store, rank 1
    # never comes
    wrong_address = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "doctor", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--timeout", "3"], cwd=ROOT,
        env=worker_env(env={}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lonely = _doctor_alone(rank=0, port=free_port())
    outputs = [p.communicate(timeout=120)[0] for p in (wrong_address, lonely)]
    assert time.perf_counter() - started < 90  # start-up (imports, on a loaded 2-core CI machine) + the 3 s deadline,
    # not the minutes of a rendezvous
    out = outputs[0]
    assert wrong_address.returncode == 1, out[-3000:]
    assert "FAIL  rendezvous: MASTER_ADDR:MASTER_PORT 127.0.0.1:" in out and "not reachable from rank 1" in out
    assert "fix: set MASTER_ADDR" in out
    out = outputs[1]
    assert lonely.returncode == 1, out[-3000:]
    assert "1 of 2 ranks joined within 3 s; missing ranks [1]" in out


def test_a_collective_that_never_completes_is_named_within_the_timeout():
    """Rank 1 joins, then stops (SIGSTOP: a hung GPU, a stuck NIC): rank 0's next step (the process group or the
    all-reduce) fails at its deadline naming that step, instead of waiting on rank 1 for ever."""
    import os
    import signal

    port = free_port()  # the rendezvous must fit in the timeout from each process's start, imports included
    stuck, waiting = _doctor_alone(rank=1, port=port, timeout=30), _doctor_alone(rank=0, port=port, timeout=30)
    try:
        for line in stuck.stdout:  # rank 1 says it joined: stop it before it takes part in anything else
            if "PASS  rendezvous" in line:
                os.kill(stuck.pid, signal.SIGSTOP)
                break
        started = time.perf_counter()
        out = waiting.communicate(timeout=120)[0]
        assert time.perf_counter() - started < 60, out[-3000:]
    finally:
        os.kill(stuck.pid, signal.SIGKILL)
        stuck.wait()
    assert waiting.returncode == 1, out[-3000:]
    assert "did not complete within 30 s: a rank is stuck or gone" in out, out[-3000:]

