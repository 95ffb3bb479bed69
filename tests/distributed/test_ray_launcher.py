"""`posttrain grpo --ray` on a local Ray cluster of two "nodes" (a head and a worker on this machine, each with one
`fake_gpu` standing in for a GPU and one CPU): the 2 ranks land one per node and train the same weights as
`torchrun --nproc_per_node 2` with the same seed; PPO with reference and reward model in a replica on the other node
trains what one torchrun process does, and so does distill with its teacher there; a placement that does not fit stops
before anything starts; a killed rank or replica stops the run naming it and its node; GRPO generates on a vLLM engine
actor on the other node.

One cluster per module (start-up costs seconds and memory); it is shut down at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.launch import ROOT, Result, launch, worker_env
from tests.distributed.test_grpo_distributed import overrides as grpo_overrides
from tests.distributed.test_ppo_distributed import REWARD, critic_weights, overrides as ppo_overrides
from posttrain.demo.tasks import write_example_data
from posttrain.generation.vllm_engine import vllm_available
from tests.integration.helpers import max_weight_diff

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'posttrain[ray]')")
pytestmark = [pytest.mark.ray, pytest.mark.distributed]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"fake_gpu": 1},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"fake_gpu": 1})
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=5)


def run_ray(command: str, overrides: list[str], cluster, timeout: float = 400, watch=None,
            env: dict | None = None) -> Result:
    """`python -m posttrain <command> --ray placement.address=<cluster> ...` in a subprocess (`env` added to its
    environment, which the driver forwards to the workers); `watch(proc)` runs while it does (to kill an actor
    mid-run)."""
    out_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))
    argv = [sys.executable, "-m", "posttrain", command, "--ray", f"placement.address={cluster.address}",
            "placement.gpu_resource=fake_gpu", *overrides]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=worker_env(env=env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if watch is not None:
        watch(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    from pathlib import Path

    return Result(proc.returncode, output, Path(out_dir), time.perf_counter() - started)


def kill_after_first_checkpoint(out, title: str):
    """A watcher for run_ray: once a checkpoint exists, SIGKILL the newest process whose title has `title` (Ray
    names an actor's process ray::<Class>[.<method>]). Any step-* counts: with train.save_total_limit=2 step-1 is
    gone once step-3 is saved, which a fast run reaches between two looks."""
    import psutil

    def watch(proc):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if any((out / "checkpoints").glob("step-*")):
                found = [p for p in psutil.process_iter(["cmdline"]) if title in " ".join(p.info["cmdline"] or [])]
                if found:
                    os.kill(max(found, key=lambda p: p.pid).pid, signal.SIGKILL)
                    return
            time.sleep(0.2)

    return watch


def test_grpo_ranks_on_two_nodes_match_torchrun(tiny_model_dir, data, tmp_path, cluster):
    reference = launch(2, "grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "torchrun", per_device=2))
    reference.check_world(2)
    result = run_ray("grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "ray", per_device=2), cluster)
    result.check_world(2, nodes=2)
    table = result.output[result.output.index("posttrain ray placement"):].splitlines()[1:4]
    assert table[0].split()[:2] == ["role", "node"], table
    assert [row.split()[0] for row in table[1:]] == ["policy", "policy"], table  # GRPO's reference (beta > 0) ...
    assert "reference" in table[1], table  # ... is colocated with it, inside the same workers
    assert len({row.split()[2] for row in table[1:]}) == 2, table  # two different nodes
    assert any(loss != 0 for loss in reference.losses().values())  # something to compare
    assert reference.losses() == pytest.approx(result.losses(), abs=1e-5)
    assert max_weight_diff(reference.final_weights(), result.final_weights()) < 1e-4


def test_ppo_with_critic_on_two_nodes_matches_torchrun(tiny_model_dir, data, tmp_path, cluster):
    """PPO's policy, reference and critic live in the same two workers (one per node); the policy AND the critic
    train as under torchrun."""
    reference = launch(2, "ppo", ppo_overrides(tiny_model_dir, data, tmp_path / "torchrun", per_device=2))
    reference.check_world(2)
    result = run_ray("ppo", ppo_overrides(tiny_model_dir, data, tmp_path / "ray", per_device=2), cluster)
    result.check_world(2, nodes=2)
    assert "critic" in result.output[result.output.index("posttrain ray placement"):].splitlines()[2]
    one, two = reference.metrics(), result.metrics()
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for expected, got in zip(one, two):
        for name in ("loss", "loss/critic", "kl"):
            assert got[name] == pytest.approx(expected[name], abs=1e-5), name
    assert max_weight_diff(reference.final_weights(), result.final_weights()) < 1e-4
    assert max_weight_diff(critic_weights(reference.output_dir), critic_weights(result.output_dir)) < 1e-4


def test_placement_that_does_not_fit_stops_before_start(tiny_model_dir, data, tmp_path, cluster):
    result = run_ray("grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "run", per_device=2)
                     + ["placement.policy.num_gpus_per_node=2"], cluster, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "the placement does not fit the Ray cluster: policy+reference needs 2 node(s) with 2 fake_gpu GPU(s)" \
        in result.output, result.output[-3000:]
    assert not (tmp_path / "run").exists()


def test_engine_actors_and_servers_of_ones_own_exit_2(tiny_model_dir, data, tmp_path, cluster):
    """placement.generation.num_engines starts the servers; generation.servers lists others (two answers to where
    generation runs): refused before any actor starts."""
    result = run_ray("grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "run", per_device=2)
                     + ["generation.engine=server", "generation.servers=[http://127.0.0.1:8000]",
                        "placement.generation.num_engines=1"], cluster, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    said = [line for line in result.output.splitlines() if line.startswith("posttrain: error: ")]
    assert len(said) == 1 and "placement.generation.num_engines=1 counts Ray engines, but " \
        "generation.placement=servers" in said[0], result.output[-3000:]
    assert not (tmp_path / "run").exists()


def server_processes() -> set[int]:
    """Processes of `posttrain serve` or vLLM on this machine."""
    import psutil

    def is_server(cmdline: str) -> bool:  # the api_server, its engine processes (renamed), posttrain serve
        return "vllm.entrypoints" in cmdline or cmdline.startswith("VLLM::") or "-m posttrain serve " in cmdline

    return {p.pid for p in psutil.process_iter(["cmdline"]) if is_server(" ".join(p.info["cmdline"] or []))}


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)")
def test_grpo_with_an_engine_actor(tiny_vllm_model_dir, data, tmp_path, cluster):
    """One training rank on one node generates on a `posttrain serve` engine actor on the other: the sampler's
    log-probs stay the trainer's after every weight sync, and no server process outlives the run."""
    out = tmp_path / "run"
    before = server_processes()
    result = run_ray("grpo", grpo_overrides(tiny_vllm_model_dir, data, out, per_device=4)
                     + ["data.eval=null", "train.max_steps=3", "train.learning_rate=1e-2",
                        "generation.vllm.kv_cache_gb=1", "placement.policy.num_nodes=1",
                        "placement.policy.num_gpus_per_node=1", "placement.generation.num_engines=1"], cluster)
    result.check_world(1)
    table = result.output[result.output.index("posttrain ray placement"):].splitlines()[2:5]
    node_of = {re.split(r"\s{2,}", row)[0]: re.search(r"\(([0-9a-f]{8})\)", row)[1] for row in table}
    assert set(node_of) == {"policy", "reference", "engine 0"}, table
    assert node_of["policy"] == node_of["reference"] != node_of["engine 0"], table
    banner = result.output[result.output.index("posttrain ray generation: 1 engine(s)"):].splitlines()
    assert "(generation.placement=ray)" in banner[0], banner[0]
    log = out / "engines" / "engine-0.log"
    found = re.match(rf"engine 0  \S+ \({node_of['engine 0']}\)  (http://\S+:\d+)  log: (\S+)$", banner[1])
    assert found and found[2] == str(log), banner[1]
    assert f"posttrain serve: ready at {found[1]}" in log.read_text()

    rows = result.metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sampler_logprob_gap"] < 2e-3 for r in rows), [r["sampler_logprob_gap"] for r in rows]
    assert all(r["time/sync"] > 0 and r["policy_lag"] == 0 for r in rows)
    assert not server_processes() - before  # neither `posttrain serve` nor any of its vLLM processes is left


def test_input_error_found_by_the_ranks_is_exit_2(tiny_model_dir, data, tmp_path, cluster):
    """The ranks' own checks (here: the data file) come back to the driver as the usual one-line error."""
    result = run_ray("grpo", grpo_overrides(tiny_model_dir, data, tmp_path / "run", per_device=2)
                     + [f"data.train={tmp_path / 'missing.jsonl'}"], cluster, timeout=200)
    assert result.returncode == 2, result.output[-3000:]
    assert "posttrain: error: data.train" in result.output and "missing.jsonl" in result.output, result.output[-3000:]


def test_killed_actor_names_rank_and_node(tiny_model_dir, data, tmp_path, cluster):
    out = tmp_path / "run"
    overrides = grpo_overrides(tiny_model_dir, data, out, per_device=2) + ["train.max_steps=400", "train.save_steps=1"]
    result = run_ray("grpo", overrides, cluster, watch=kill_after_first_checkpoint(out, "ray::RankWorker.run"))
    assert result.returncode == 1, result.output[-4000:]
    message = result.output[result.output.index("posttrain: error: rank"):]
    assert re.match(r"posttrain: error: rank [01] \(policy\+reference worker on node \S+ \([0-9a-f]{8}\)\): its actor "
                    r"died: The actor died unexpectedly", message), message
    assert "Some common causes" not in message  # Ray's generic advice is cut; the exit detail stays
    assert "continue with train.resume_from_checkpoint=auto" in message
    from posttrain.rundir.checkpoint import resolve_resume

    assert resolve_resume(str(out), "auto") is not None  # the newest complete checkpoint is there to resume from


ZERO2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
"""DeepSpeed ZeRO-2 as a launcher asks for it; the Ray driver forwards it to every worker (ranks and role groups)."""


@pytest.fixture(scope="module")
def ppo_with_rm(tiny_model_dir, data, tmp_path_factory):
    """PPO's overrides with a reward model beside the rule reward (the critic starts from it: no fresh head), and the
    run of one process with every role inside, under DeepSpeed ZeRO-2, that the layouts below are compared with."""
    from transformers import AutoTokenizer

    from tests.unit.test_rewards_reward_model import save_classifier

    root = tmp_path_factory.mktemp("ppo_rm")
    rm = save_classifier(root / "rm", AutoTokenizer.from_pretrained(tiny_model_dir))
    extra = [f"rewards=[{{name: '{REWARD}'}}, {{name: reward_model, kwargs: {{path: '{rm}'}}}}]", "train.save_steps=1"]
    reference = launch(1, "ppo", ppo_overrides(tiny_model_dir, data, root / "torchrun", 4, *extra),
                       accelerate_config="zero2")
    reference.check_world(1)
    assert reference.facts["engine"] == "deepspeed-zero2"
    return extra, reference


def test_ppo_with_frozen_roles_apart_matches_torchrun(tiny_model_dir, data, tmp_path, cluster, ppo_with_rm):
    """Policy and critic train in one worker on one node; reference and reward model are served by a replica on the
    other node: the run trains what one torchrun process with every role inside trains, and logs the replica's time."""
    extra, reference = ppo_with_rm
    result = run_ray("ppo", ppo_overrides(tiny_model_dir, data, tmp_path / "ray", 4, *extra)
                     + ["placement.colocate=[[policy, critic], [reference, reward_model]]",
                        "placement.policy.num_nodes=1", "placement.policy.num_gpus_per_node=1"], cluster, env=ZERO2)
    result.check_world(1)
    assert result.facts["engine"] == "deepspeed-zero2"
    table = result.output[result.output.index("posttrain ray placement"):].splitlines()[2:6]
    node_of = {row.split()[0]: row.split()[2] for row in table}
    assert set(node_of) == {"policy", "critic", "reference", "reward_model"}, table
    assert node_of["policy"] == node_of["critic"] != node_of["reference"] == node_of["reward_model"], table
    one, two = reference.metrics(), result.metrics()
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for expected, got in zip(one, two):
        for name in ("loss", "loss/critic", "kl", "rewards/reward_model/mean"):
            assert got[name] == pytest.approx(expected[name], abs=1e-5), name
        assert got["time/role/reference"] > 0 and got["time/role/reward_model"] > 0  # the replica's calls, per step
        assert "time/role/reference" not in expected  # colocated roles are not remote calls
    assert max_weight_diff(reference.final_weights(), result.final_weights()) < 1e-4
    assert max_weight_diff(critic_weights(reference.output_dir), critic_weights(result.output_dir)) < 1e-4


def test_distill_with_the_teacher_apart_matches_one_process(tiny_model_dir, data, tmp_path, cluster):
    """posttrain distill with the teacher in a replica on the other node (its logits come back over Ray) trains what
    one process holding the teacher trains, on-policy steps included."""
    from posttrain.models.tiny import make_tiny_model
    from tests.distributed.test_distill_distributed import overrides as distill_overrides
    from tests.integration.helpers import final_weights, metrics, run_cli

    teacher = make_tiny_model(tmp_path / "teacher", seed=1)
    assert run_cli("distill", *distill_overrides(tiny_model_dir, teacher, data, tmp_path / "one", 1)) == 0
    apart = ["placement.colocate=[]", "placement.policy.num_nodes=1", "placement.policy.num_gpus_per_node=1"]
    result = run_ray("distill", distill_overrides(tiny_model_dir, teacher, data, tmp_path / "ray", 1) + apart, cluster)
    result.check_world(1)
    table = result.output[result.output.index("posttrain ray placement"):].splitlines()[2:4]
    node_of = {row.split()[0]: row.split()[2] for row in table}
    assert set(node_of) == {"policy", "teacher"} and node_of["policy"] != node_of["teacher"], table
    one, two = metrics(tmp_path / "one"), result.metrics()
    assert {r["on_policy"] for r in one} == {0.0, 1.0}  # both kinds of step are compared
    assert [r["on_policy"] for r in one] == [r["on_policy"] for r in two]
    for expected, got in zip(one, two):
        for name in ("loss", "forward_kl", "top1_agreement", "teacher_logprob"):
            assert got[name] == pytest.approx(expected[name], abs=1e-5), (name, expected, got)
    assert max_weight_diff(final_weights(tmp_path / "one"), result.final_weights()) < 1e-5


def test_killed_role_replica_names_role_and_node(tiny_model_dir, data, tmp_path, cluster):
    out = tmp_path / "run"
    overrides = grpo_overrides(tiny_model_dir, data, out, per_device=4) + [
        "train.max_steps=400", "train.save_steps=1", "placement.colocate=[]", "placement.policy.num_nodes=1",
        "placement.policy.num_gpus_per_node=1"]
    result = run_ray("grpo", overrides, cluster, watch=kill_after_first_checkpoint(out, "ray::RoleWorker"))
    assert result.returncode == 1, result.output[-4000:]
    message = result.output[result.output.index("posttrain: error: "):]
    assert re.match(r"posttrain: error: reference worker 0 on node \S+ \([0-9a-f]{8}\): its actor died: ", message), \
        message
    assert "continue with train.resume_from_checkpoint=auto" in message
    from posttrain.rundir.checkpoint import resolve_resume

    assert resolve_resume(str(out), "auto") is not None


def test_ppo_critic_in_its_own_group_matches_torchrun_and_resumes(tiny_model_dir, data, tmp_path, cluster,
                                                                 ppo_with_rm):
    """OpenRLHF's --colocate_actor_ref + --colocate_critic_reward: policy and reference in the training worker on one
    node; critic and reward model in a group of their own on the other, the critic trained there (its own process
    group, optimiser and schedule; DeepSpeed ZeRO-2 there as in the ranks), saved into each checkpoint and exported
    as final-critic/. It trains what one process with every role inside trains, and a resume from its step-1
    checkpoint ends where it ended."""
    extra, reference = ppo_with_rm
    layout = ["placement.colocate=[[policy, reference], [critic, reward_model]]", "placement.policy.num_nodes=1",
              "placement.policy.num_gpus_per_node=1"]
    result = run_ray("ppo", ppo_overrides(tiny_model_dir, data, tmp_path / "ray", 4, *extra) + layout, cluster,
                     env=ZERO2)
    result.check_world(1)
    assert result.facts["engine"] == "deepspeed-zero2"
    table = result.output[result.output.index("posttrain ray placement"):].splitlines()[2:6]
    node_of = {row.split()[0]: row.split()[2] for row in table}
    assert node_of["policy"] == node_of["reference"] != node_of["critic"] == node_of["reward_model"], table
    one, two = reference.metrics(), result.metrics()
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for expected, got in zip(one, two):
        for name in ("loss", "loss/critic", "grad_norm/critic", "learning_rate/critic", "values/mean", "kl"):
            assert got[name] == pytest.approx(expected[name], abs=1e-5), name
        assert got["time/role/critic"] > 0 and got["time/update/critic"] > 0
    assert max_weight_diff(reference.final_weights(), result.final_weights()) < 1e-4
    assert max_weight_diff(critic_weights(reference.output_dir), critic_weights(result.output_dir)) < 1e-4
    saved = result.output_dir / "checkpoints" / "step-1" / "critic"
    assert (saved / "role_state.json").is_file()
    assert list(saved.rglob("*optim_states.pt")), sorted(saved.rglob("*"))  # the group's own DeepSpeed engine saved it

    resumed = result.copy_at(1, tmp_path / "resumed")
    shutil.rmtree(resumed / "final-critic")  # the resumed run must export its own
    again = run_ray("ppo", ppo_overrides(tiny_model_dir, data, resumed, 4, *extra, "train.resume_from_checkpoint=auto")
                    + layout, cluster, env=ZERO2)
    assert again.returncode == 0, again.output[-4000:]
    assert max_weight_diff(result.final_weights(), again.final_weights()) < 1e-5
    assert max_weight_diff(critic_weights(result.output_dir), critic_weights(resumed)) < 1e-5
