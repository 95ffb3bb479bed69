"""The `placement:` section and its fit against hand-made clusters (pure: no Ray needed)."""

from __future__ import annotations

import pytest

from posttrain.algorithms.grpo import GRPOAlgoConfig
from posttrain.config.load import load_recipe
from posttrain.launch.ray_placement import (Node, fit, nodes_from_ray, pick_gpu_resource, placement_table,
                                                 rank_slots, resolve, whole_cluster)
from posttrain.errors import UserError


def recipe(*overrides):
    """A GRPO recipe whose placement counts GPUs in the GPU resource (the launcher resolves the default, auto)."""
    return load_recipe(None, ["data.train=x.jsonl", "rewards=[{name: exact_match}]", "placement.gpu_resource=GPU",
                              *overrides], GRPOAlgoConfig)


def four_gpus():
    return [Node("node-a-0000", "10.0.0.1", gpus=4, cpus=16)]


def two_nodes(gpus=2, cpus=8):
    return [Node("node-a-0000", "10.0.0.1", gpus=gpus, cpus=cpus), Node("node-b-0000", "10.0.0.2", gpus=gpus, cpus=cpus)]


def test_defaults_put_every_role_with_the_policy_on_every_gpu():
    p = recipe("launcher=ray").placement
    units = resolve(p, ("policy", "reference"), two_nodes())
    assert [(u.roles, u.num_nodes, u.workers_per_node, u.fractions) for u in units] == [
        (("policy", "reference"), 2, 2, (0.5, 0.5))]
    plan = fit(units, two_nodes(), p)
    assert [s.rank for s in rank_slots(plan.units[0])] == [0, 1, 2, 3]
    assert [(s.node.address, s.local_rank, s.node_rank) for s in rank_slots(plan.units[0])] == [
        ("10.0.0.1", 0, 0), ("10.0.0.1", 1, 0), ("10.0.0.2", 0, 1), ("10.0.0.2", 1, 1)]


def test_gpu_resource_auto_is_gpu_where_the_cluster_has_one_else_cpu():
    def ray_node(node_id, alive=True, **resources):  # the shape of a ray.nodes() entry
        return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "10.0.0.1", "Resources": resources}

    auto = load_recipe(None, ["data.train=x.jsonl", "rewards=[{name: exact_match}]"], GRPOAlgoConfig).placement
    assert auto.gpu_resource == "auto"
    assert pick_gpu_resource(auto, [ray_node("a", CPU=8.0)]).gpu_resource == "none"
    assert pick_gpu_resource(auto, [ray_node("a", CPU=8.0), ray_node("b", CPU=8.0, GPU=2.0)]).gpu_resource == "GPU"
    assert pick_gpu_resource(auto, [ray_node("b", alive=False, GPU=2.0)]).gpu_resource == "none"
    explicit = recipe("placement.gpu_resource=fake_gpu").placement
    assert pick_gpu_resource(explicit, [ray_node("a", CPU=8.0)]) is explicit
    nodes = nodes_from_ray([ray_node("a", CPU=8.0, fake_gpu=1.0), ray_node("b", alive=False, fake_gpu=1.0)], "fake_gpu")
    assert nodes == [Node("a", "10.0.0.1", gpus=1.0, cpus=8.0)]


def test_cpu_only_cluster_defaults_to_one_worker():
    p = recipe("placement.gpu_resource=none").placement
    nodes = [Node("cpu-node-000", "10.0.0.1", gpus=0, cpus=4)]
    assert whole_cluster(p, nodes) == (1, 1)
    plan = fit(resolve(p, ("policy",), nodes), nodes, p)
    assert "0 (CPU)" in placement_table(plan)


def test_three_plus_one_on_four_gpus():
    """OpenRLHF's '3 training + 1 generating' on one 4-GPU node: policy+reference share 3 GPUs, one engine."""
    p = recipe("placement.policy.num_gpus_per_node=3", "placement.generation.num_engines=1").placement
    plan = fit(resolve(p, ("policy", "reference"), four_gpus()), four_gpus(), p)
    assert plan.units[0].unit.workers_per_node == 3 and len(plan.engines) == 1
    table = placement_table(plan)
    assert "engine 0" in table and "3 x 0.5" in table, table
    with pytest.raises(UserError, match="generation engine 2 of 2 needs 1 node"):
        p2 = recipe("placement.policy.num_gpus_per_node=3", "placement.generation.num_engines=2").placement
        fit(resolve(p2, ("policy",), four_gpus()), four_gpus(), p2)


def test_two_groups_on_two_nodes():
    """Actor and reference on one node, critic and reward model on the other."""
    p = recipe("placement.colocate=[[policy, reference], [critic, reward_model]]",
               "placement.policy.num_gpus_per_node=2", "placement.critic.num_gpus_per_node=2",
               "placement.policy.gpu_fraction=0.75").placement
    units = resolve(p, ("policy", "reference", "critic", "reward_model"), two_nodes())
    assert [(u.roles, u.fractions) for u in units] == [(("policy", "reference"), (0.75, 0.25)),
                                                        (("critic", "reward_model"), (0.5, 0.5))]
    plan = fit(units, two_nodes(), p)
    assert {plan.units[0].nodes[0].address, plan.units[1].nodes[0].address} == {"10.0.0.1", "10.0.0.2"}
    rows = placement_table(plan).splitlines()
    assert len(rows) == 5 and rows[0].split()[:2] == ["role", "node"]
    critic = next(r for r in rows if r.startswith("critic"))
    assert "reward_model" in critic and "2 x 0.5" in critic


def test_placement_that_does_not_fit_says_what_is_short():
    p = recipe("placement.policy.num_nodes=2", "placement.policy.num_gpus_per_node=3").placement
    with pytest.raises(UserError) as e:
        fit(resolve(p, ("policy", "reference"), two_nodes()), two_nodes(), p)
    message = str(e.value)
    assert "policy+reference needs 2 node(s) with 3 GPU GPU(s)" in message, message
    assert "only 0 node(s) have that left" in message and "10.0.0.2 (node-b-0): 2 GPU, 8 CPU" in message, message


def test_roles_placed_apart_compete_for_the_same_gpus():
    p = recipe("placement.colocate=[]", "placement.policy.num_nodes=2", "placement.policy.num_gpus_per_node=2").placement
    with pytest.raises(UserError, match=r"reference needs 1 node\(s\) with 1 GPU GPU\(s\).*only 0 node"):
        fit(resolve(p, ("policy", "reference"), two_nodes()), two_nodes(), p)


def test_no_gpus_at_all_points_at_gpu_resource():
    p = recipe().placement
    nodes = [Node("cpu-node-000", "127.0.0.1", gpus=0, cpus=2)]
    with pytest.raises(UserError, match="no 'GPU' resource at all.*placement.gpu_resource=none"):
        fit(resolve(p, ("policy",), nodes), nodes, p)


def test_cpus_are_counted_too():
    p = recipe("placement.gpu_resource=fake_gpu", "placement.cpus_per_worker=2",
               "placement.policy.num_gpus_per_node=2").placement
    nodes = [Node("a-000000000", "127.0.0.1", gpus=2, cpus=3)]
    with pytest.raises(UserError, match=r"2 fake_gpu GPU\(s\) and 4 CPU\(s\)"):
        fit(resolve(p, ("policy",), nodes), nodes, p)


@pytest.mark.parametrize("override, message", [
    ("placement.polcy.num_nodes=1", "did you mean 'placement.policy'"),
    ("placement.policy.num_gpu_per_node=1", "did you mean 'placement.policy.num_gpus_per_node'"),
    ("placement.policy.num_nodes=0", "placement.policy.num_nodes must be >= 1"),
    ("placement.colocate=[[policy]]", "2 or more roles"),
    ("placement.colocate=[[policy, actor]]", "unknown role 'actor'"),
    ("placement.colocate=[[policy, reference], [reference, critic]]", "reference is in groups 0 and 1"),
    ("placement.policy.gpu_fraction=1.5", "must be in \\(0, 1\\]"),
    ("launcher=slurm", "launcher is 'slurm'; choose one of local, ray"),
    ("placement.generation.num_engines=-1", "num_engines must be >= 0"),
])
def test_bad_placement_fails_at_start_up(override, message):
    with pytest.raises(UserError, match=message):
        recipe(override)


def test_colocated_fractions_must_fit_one_gpu_and_layouts_agree():
    with pytest.raises(UserError, match="gpu_fraction adds up to 1.2 > 1"):
        recipe("placement.colocate=[[policy, reference]]", "placement.policy.gpu_fraction=0.6",
               "placement.reference.gpu_fraction=0.6")
    with pytest.raises(UserError, match="shares its GPUs with no role"):
        recipe("placement.colocate=[[critic, reward_model]]", "placement.policy.gpu_fraction=0.5")
    p = recipe("placement.policy.num_gpus_per_node=2", "placement.reference.num_gpus_per_node=1").placement
    with pytest.raises(UserError, match="placement.reference.num_gpus_per_node is 1 but reference is colocated"):
        resolve(p, ("policy", "reference"), two_nodes())


def test_launcher_ray_without_ray_installed_says_how_to_install(monkeypatch, capsys):
    from posttrain.cli import run_command

    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray -> ImportError
    code = run_command(["grpo", "--ray", "data.train=x.jsonl", "rewards=[{name: exact_match}]"])
    assert code == 2
    assert "launcher: ray needs the ray package, which is not installed: pip install 'posttrain[ray]'" in \
        capsys.readouterr().err


def test_a_trained_role_apart_has_one_worker_per_policy_rank():
    """Frozen roles apart are replicas, any number; the critic's group has one worker per rank, said up front."""
    from posttrain.launch.ray_roles import check_apart

    roles = ("policy", "reference", "critic", "reward_model")
    frozen = recipe("placement.colocate=[[policy, critic], [reference, reward_model]]",
                    "placement.policy.num_gpus_per_node=2").placement
    check_apart(resolve(frozen, roles, two_nodes()))  # 2 ranks, 1 replica: fine
    same = recipe("placement.colocate=[[policy, reference], [critic, reward_model]]",
                  "placement.policy.num_gpus_per_node=2", "placement.critic.num_gpus_per_node=2").placement
    check_apart(resolve(same, roles, two_nodes()))
    fewer = recipe("placement.colocate=[[policy, reference], [critic, reward_model]]",
                   "placement.policy.num_gpus_per_node=2").placement
    with pytest.raises(UserError, match=r"placement: critic\+reward_model apart from the policy has 1 worker\(s\) but "
                                        r"the policy has 2: .* set placement.critic.num_nodes / num_gpus_per_node"):
        check_apart(resolve(fewer, roles, two_nodes()))


def test_a_distillation_teacher_is_a_role_to_place_unless_it_is_a_server():
    from types import SimpleNamespace

    from posttrain.launch.ray_placement import roles_needed

    r = recipe("placement.colocate=[]", "placement.teacher.num_gpus_per_node=2")
    local = SimpleNamespace(needs_reference=False, needs_critic=False, teacher_model=lambda: "its ModelConfig")
    server = SimpleNamespace(needs_reference=False, needs_critic=False, teacher_model=lambda: None)
    assert roles_needed(local, r) == ("policy", "teacher")
    assert roles_needed(server, r) == ("policy",)  # algo.teacher_server: a URL, nothing to place
    units = resolve(r.placement, ("policy", "teacher"), two_nodes())
    assert [(u.roles, u.num_nodes, u.workers_per_node) for u in units] == [(("policy",), 1, 1), (("teacher",), 1, 2)]
    with pytest.raises(UserError, match="placement.teacher.num_nodes must be >= 1"):
        recipe("placement.teacher.num_nodes=0")
