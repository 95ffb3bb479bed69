"""GRPO with `generation.vllm.placement: node` on 2 "nodes" (two torchrun agents on this machine, one rank each, DDP):
two engines, each started and synced by its node's rank, against one process with the same global batch. Run by
hand: CI's test of the placement (tests/distributed/test_grpo_vllm_distributed.py) is one node of 2 ranks sharing
one engine, since CI starts as few vLLM engines as it can.

    python bench/node_engines.py           # CPU: the head_dim-32 tiny model, 2 steps; ~2 minutes on 2 cores

Prints the engines each node announced, per step the two runs' reward, loss, sampler gap and sync seconds, the final
weights' largest difference and the seconds of each run; exits 1 when the runs differ (rewards 1e-6, weights 1e-4).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from posttrain.models.tiny import make_tiny_model
    from posttrain.demo.tasks import write_example_data
    from tests.distributed.launch import launch
    from tests.distributed.test_grpo_vllm_distributed import overrides
    from tests.integration.helpers import max_weight_diff

    root = Path(tempfile.mkdtemp(prefix="posttrain-node-engines-"))
    model = root / "model"
    make_tiny_model(model, arch="llama", seed=0, num_heads=2, num_kv_heads=1)  # head_dim 32: vLLM's CPU kernels
    data = write_example_data(root / "data", n_train=32, n_eval=5)
    started = time.perf_counter()
    one = launch(1, "grpo", overrides(model, data, root / "one", 4), timeout=600)
    one_s = time.perf_counter() - started
    started = time.perf_counter()
    two = launch(2, "grpo", [*overrides(model, data, root / "two", 2), "generation.vllm.placement=node"], nnodes=2,
                 timeout=900)
    two_s = time.perf_counter() - started
    if not (one.ok and two.ok):
        print((one.output if not one.ok else two.output)[-4000:])
        return 1
    print(f"one process: {one_s:.0f} s; 2 nodes x 1 rank ({two.facts['engine']}, {two.facts['nodes']} nodes): "
          f"{two_s:.0f} s")
    print("\n".join(line for line in two.output.splitlines() if "vLLM engine at" in line))
    same = True
    rows = {(r["step"], "eval/reward" in r): r for r in one.metrics()}
    for r in two.metrics():
        expected = rows[(r["step"], "eval/reward" in r)]
        for name in ("reward/mean", "eval/reward"):
            if name in r:
                same &= abs(r[name] - expected[name]) <= 1e-6
        if "loss" in r:
            print(f"step {r['step']}: reward {expected['reward/mean']:.6f} / {r['reward/mean']:.6f}, loss "
                  f"{expected['loss']:.7f} / {r['loss']:.7f}, sampler gap {r['sampler_logprob_gap']:.1e}, sync "
                  f"{expected['time/sync']:.3f} s (in-process) / {r['time/sync']:.3f} s (node engines)")
    diff = max_weight_diff(one.final_weights(), two.final_weights())
    same &= diff < 1e-4
    print(f"final weights: largest difference {diff:.1e}; {'same run' if same else 'THE RUNS DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
