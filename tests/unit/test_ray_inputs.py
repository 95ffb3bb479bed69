"""What the Ray driver hands its actors (launch/ray_inputs.py): recipe paths resolved once, only the needed env."""

from __future__ import annotations

import dataclasses

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


def test_a_cluster_started_for_the_run_listens_on_loopback():
    from posttrain.launch.ray_launcher import init_options

    assert init_options(None)["_node_ip_address"] == "127.0.0.1"
    assert "_node_ip_address" not in init_options("10.0.0.1:6379")  # an existing cluster keeps its own addresses
