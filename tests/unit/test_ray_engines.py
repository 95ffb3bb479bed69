"""Generation engines as Ray actors, the parts that need neither Ray nor vLLM: what the recipe may combine with
them, the `posttrain serve` options they start with, the recipe the ranks then run, and that a server's process dies
with the process that started it. One real engine actor is in tests/distributed/test_ray_launcher.py."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from posttrain.algorithms.grpo import GRPOAlgoConfig
from posttrain.config.load import load_recipe
from posttrain.launch.ray_engines import Engines, check_engines
from posttrain.generation.server_process import serve_args
from posttrain.launch.ray_placement import Node
from posttrain.errors import UserError


def recipe(*overrides):
    return load_recipe(None, ["data.train=x.jsonl", "rewards=[{name: exact_match}]", "launcher=ray", *overrides],
                       GRPOAlgoConfig)


def test_what_contradicts_engine_actors_is_a_user_error():
    with pytest.raises(UserError, match="placement.generation.num_engines=1 counts Ray engines, but "
                                        "generation.placement=servers"):  # servers of one's own and engines
        recipe("placement.generation.num_engines=1", "generation.engine=server", "generation.servers=[http://a:1]")
    message = "generation.vllm.tensor_parallel_size=2 sizes in-process engines; .* placement.generation.tensor_parallel_size=1"
    with pytest.raises(UserError, match=message):
        check_engines(recipe("placement.generation.num_engines=1", "generation.vllm.tensor_parallel_size=2"))
    check_engines(recipe("generation.vllm.tensor_parallel_size=2"))  # no engines: nothing to contradict


def test_engines_replace_hf_or_vllm_generation():
    for engine in ("hf", "vllm"):
        check_engines(recipe("placement.generation.num_engines=2", f"generation.engine={engine}"))


def test_serve_options_come_from_the_recipe():
    r = recipe("model.name_or_path=/m", "data.max_length=100", "data.max_prompt_length=40",
               "generation.max_completion_length=24", "generation.vllm.gpu_memory_utilization=0.9")
    assert serve_args(r, 2) == ["--model", "/m", "--", "--tensor-parallel-size", "2", "--max-model-len", "64",
                                "--gpu-memory-utilization", "0.9", "--enforce-eager"]
    r = recipe("model.name_or_path=/m", "model.revision=v1", "model.trust_remote_code=true",
               "generation.vllm.max_model_len=4096", "generation.vllm.dtype=bfloat16",
               "generation.vllm.enforce_eager=false")
    args = serve_args(r, 1)
    assert args[args.index("--max-model-len") + 1] == "4096"
    assert {"--dtype", "bfloat16", "--revision", "v1", "--trust-remote-code"} <= set(args)
    assert "--enforce-eager" not in args
    assert "--enable-prefix-caching" not in args and "--no-enable-prefix-caching" not in args  # vLLM's default
    for choice, flag in (("true", "--enable-prefix-caching"), ("false", "--no-enable-prefix-caching")):
        assert flag in serve_args(recipe(f"generation.vllm.enable_prefix_caching={choice}"), 1)


def test_the_ranks_generate_on_the_engines_with_their_token():
    r = recipe("generation.engine=vllm", "placement.generation.num_engines=2")
    engines = Engines(["actor-0", "actor-1"], ["http://10.0.0.2:8001", "http://10.0.0.3:8002"],
                      [Node("node-b-0000", "10.0.0.2"), Node("node-c-0000", "10.0.0.3")], ["/o/e0.log", "/o/e1.log"],
                      "s3cret")
    assert (r.generation.engine, r.generation.placement) == ("vllm", "ray")
    assert engines.urls == ["http://10.0.0.2:8001", "http://10.0.0.3:8002"]  # what run.Launched.servers gets
    assert engines.env == {"POSTTRAIN_SERVER_TOKEN": "s3cret"}
    assert engines.banner().splitlines()[1:] == [
        "engine 0  10.0.0.2 (node-b-0)  http://10.0.0.2:8001  log: /o/e0.log",
        "engine 1  10.0.0.3 (node-c-0)  http://10.0.0.3:8002  log: /o/e1.log"]
    assert Engines().env == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_a_server_process_ends_with_the_process_that_started_it():
    """What keeps a server from outliving a killed engine actor (and vLLM from outliving a killed `posttrain
    serve`): the child asked for SIGTERM at its parent's death."""
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               "from posttrain.generation.serve import die_with_parent\n"
                               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                               "start_new_session=True, preexec_fn=die_with_parent())\n"
                               "print(child.pid, flush=True)\n"
                               "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    assert child.is_running()
    parent.kill()
    parent.wait()
    child.wait(timeout=10)  # psutil.TimeoutExpired if it lived on
