"""What the Ray driver hands its actors (launch/ray_inputs.py): recipe paths resolved once, only the needed env."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from posttrain.algorithms.ppo import PPOAlgoConfig
from posttrain.config.load import load_recipe
from posttrain.launch.ray_inputs import absolute_paths, worker_env

REWARD = "rewards=[{name: exact_match}]"


def test_relative_paths_become_absolute_in_the_drivers_directory(tmp_path, monkeypatch):
    """recipes/ppo_ray.yaml's case: the reward model at runs/rm/final, relative to where the command ran."""
    (tmp_path / "runs" / "rm" / "final").mkdir(parents=True)
    (tmp_path / "data.jsonl").write_text("{}\n")
    (tmp_path / "my_rewards.py").write_text("def r(**k): return 0\n")
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(None, ["data.train=data.jsonl", "output_dir=runs/ppo", "model.name_or_path=Qwen/Qwen2.5-0.5B",
                                "rewards=[{name: reward_model, kwargs: {path: runs/rm/final}}, "
                                "{name: 'my_rewards.py:r'}, {name: exact_match}]"], PPOAlgoConfig)
    got = absolute_paths(recipe, tmp_path)
    assert got.data.train == str(tmp_path / "data.jsonl")
    assert got.output_dir == str(tmp_path / "runs" / "ppo")  # absolute before it exists
    assert got.rewards[0].kwargs["path"] == str(tmp_path / "runs" / "rm" / "final")
    assert got.rewards[1].name == f"{tmp_path / 'my_rewards.py'}:r"
    assert got.rewards[2].name == "exact_match" and got.model.name_or_path == "Qwen/Qwen2.5-0.5B"  # not paths here
    assert absolute_paths(got, "/elsewhere") == got  # absolute paths stay as they are


def test_workers_get_only_the_secrets_the_run_needs(tmp_path):
    env = {"HF_HOME": "/cache", "HF_TOKEN": "hf_secret", "ACCELERATE_MIXED_PRECISION": "no", "OMP_NUM_THREADS": "1",
           "WANDB_API_KEY": "w_secret", "AWS_SECRET_ACCESS_KEY": "x", "PATH": "/bin", "POSTTRAIN_SERVER_TOKEN": "t"}
    (tmp_path / "model").mkdir()
    local = load_recipe(None, ["data.train=x.jsonl", f"model.name_or_path={tmp_path / 'model'}", REWARD], PPOAlgoConfig)
    local = dataclasses.replace(local, data=dataclasses.replace(local.data, train=str(tmp_path / "model")))
    assert worker_env(env, local) == {"HF_HOME": "/cache", "ACCELERATE_MIXED_PRECISION": "no", "OMP_NUM_THREADS": "1"}
    hub = load_recipe(None, ["data.train=x.jsonl", "model.name_or_path=Qwen/Qwen2.5-0.5B", REWARD,
                             "train.report_to=[tensorboard, wandb]"], PPOAlgoConfig)
    got = worker_env(env, hub)
    assert got["HF_TOKEN"] == "hf_secret" and got["WANDB_API_KEY"] == "w_secret"  # a hub model; W&B reporting
    assert "AWS_SECRET_ACCESS_KEY" not in got and "PATH" not in got and "POSTTRAIN_SERVER_TOKEN" not in got


def test_a_cluster_started_for_the_run_keeps_its_session_in_the_run(tmp_path, monkeypatch):
    """Its logs and sockets in <output_dir>/ray, or ~/.cache/posttrain/ray where Ray's socket paths would pass the
    107 bytes of a Unix socket path; an existing cluster keeps its own (test_recipes.py: what listens where)."""
    from posttrain.launch.ray_launcher import init_options, session_root

    monkeypatch.setenv("HOME", "/home/u")
    assert init_options(None, Path("/r/run"))["_temp_dir"] == "/r/run/ray"
    monkeypatch.chdir(tmp_path)
    assert session_root(Path("run")) == (tmp_path / "run" / "ray" if len(str(tmp_path)) < 30 else
                                         Path("/home/u/.cache/posttrain/ray"))  # a relative output_dir: from here
    deep = Path("/" + "d" * 60)
    assert session_root(deep) == Path("/home/u/.cache/posttrain/ray")
    monkeypatch.setenv("HOME", "/" + "h" * 60)
    assert session_root(deep) is None  # Ray's own /tmp/ray, said at start-up
    assert "_temp_dir" not in init_options("10.0.0.1:6379", Path("/r/run")) and \
        init_options("10.0.0.1:6379", Path("/r/run"))["include_dashboard"] is False


def test_the_session_folder_does_not_make_output_dir_foreign(tmp_path):
    """The driver starts the cluster (writing output_dir/ray) before the ranks check output_dir."""
    from posttrain.rundir.claim import check_output_dir, classify

    out = tmp_path / "run"
    (out / "ray" / "session_x").mkdir(parents=True)
    assert classify(out) == "new"
    recipe = load_recipe(None, ["data.train=x.jsonl", f"output_dir={out}", "model.name_or_path=m", REWARD],
                         PPOAlgoConfig)
    assert check_output_dir(recipe, "ppo") is None


def test_ranks_join_a_store_the_first_worker_hosts(monkeypatch):
    """Rank 0's own TCPStore would listen on every interface: every rank is a client (TORCHELASTIC_USE_AGENT_STORE,
    as under torchrun, whose agent hosts it) of the store Worker.rendezvous hosts on the node's address only."""
    import os

    import psutil
    from torch.distributed import TCPStore

    from posttrain.launch.ray_actors import Worker, rank_env
    from posttrain.launch.ray_placement import Plan, RankSlot

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")  # the node's address, as Ray says it
    worker = Worker()
    addr, port = worker.rendezvous(2)
    assert addr == "127.0.0.1"
    bound = {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections("inet") if c.laddr.port == port
             and c.status == psutil.CONN_LISTEN}
    assert bound == {"127.0.0.1"}
    TCPStore(addr, port, 2, False).set("rank1", "here")  # a rank joins as a client
    assert worker._store.store.get("rank1") == b"here"
    env = rank_env(RankSlot(1, None, 1, 0), 2, 1, addr, port, Plan(units=(), gpu_resource="none"))
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["MASTER_PORT"] == str(port)
