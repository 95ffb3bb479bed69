"""The server engine's parts that need no vLLM: recipe checks of generation.servers, how rows are spread over servers,
the token guard, `posttrain serve`'s vLLM command line and bad input, and the weight-sync wire format over a real
gloo group (two threads). The engine against a real server is in tests/integration/test_server.py."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import torch

from posttrain.config.schema import GenerationConfig, Recipe
from posttrain.config.validate import validate
from posttrain.errors import UserError
from posttrain.generation.server import ServerEngine, ServerUnavailable, call


def recipe(**generation) -> Recipe:
    return Recipe(data=Recipe().data.__class__(train="x.jsonl"), generation=GenerationConfig(**generation))


@pytest.mark.parametrize("generation, message", [
    (dict(engine="vllm", placement="servers"), "generation.placement=servers needs generation.servers"),
    (dict(engine="vllm", placement="servers", servers=("127.0.0.1:8000",)), r"generation.servers\[0\] = '127.0.0.1:8000' is not"),
    (dict(engine="vllm", placement="servers", servers=("http://a:1", "http://host")), r"generation.servers\[1\] = 'http://host'"),
    (dict(engine="vllm", placement="servers", servers=("http://a:1", "http://a:1")), "lists a server twice"),
    (dict(engine="hf", servers=("http://a:1",)), "generation.servers is set but generation.placement is 'colocated'"),
    (dict(engine="hf", placement="servers", servers=("http://a:1",)), "generation.engine=hf generates with the policy"),
    (dict(engine="vllm", placement="servers", servers=("http://a:1",), request_timeout_s=0), "generation.request_timeout_s must be > 0"),
    (dict(engine="vllm", placement="servers", servers=("http://a:1",), sync_timeout_s=-1), "generation.sync_timeout_s must be > 0"),
    (dict(engine="vllm", placement="servers", servers=("http://a:1",), request_retries=-1), "generation.request_retries must be >= 0"),
])
def test_bad_server_settings_are_user_errors(generation, message):
    with pytest.raises(UserError, match=message):
        validate(recipe(**generation))


def test_good_server_settings_pass():
    validate(recipe(engine="vllm", placement="servers", servers=("http://127.0.0.1:8000", "https://gpu-7.cluster:443/")))


def test_a_prompts_group_stays_on_one_server_and_groups_spread_evenly():
    rows = [[1]] * 4 + [[2]] * 4 + [[3]] * 4 + [[1]] * 4  # 4 groups of 4 (the last repeats the first prompt)
    assert ServerEngine.assign(rows, 2) == [0] * 8 + [1] * 8
    assert ServerEngine.assign(rows, 3) == [0] * 8 + [1] * 4 + [2] * 4
    assert ServerEngine.assign(rows, 1) == [0] * 16
    assert ServerEngine.assign([[1], [2]], 4) == [0, 2]  # fewer groups than servers: some stay idle
    assert ServerEngine.assign([], 2) == []


def test_unreachable_server_is_named_in_the_error():
    with pytest.raises(ServerUnavailable, match="refused"):
        call("http://127.0.0.1:9", "/health", timeout=5)


def test_token_guard_lets_only_the_token_and_health_through(monkeypatch):
    from posttrain.generation.server_worker import TokenGuard

    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    monkeypatch.setenv("POSTTRAIN_SERVER_TOKEN", "s3cret")
    guard = TokenGuard(app)

    def status(path, authorization=None):
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", authorization.encode())] if authorization else []
        asyncio.run(guard({"type": "http", "path": path, "headers": headers}, None, send))
        return sent[0]["status"] if sent else 200

    assert status("/health") == 200
    assert status("/collective_rpc") == 401
    assert status("/collective_rpc", "Bearer wrong") == 401
    assert status("/collective_rpc", "Basic s3cret") == 401
    assert status("/collective_rpc", "Bearer s3cret") == 200
    assert seen == ["/health", "/collective_rpc"]
    monkeypatch.delenv("POSTTRAIN_SERVER_TOKEN")
    with pytest.raises(RuntimeError, match="POSTTRAIN_SERVER_TOKEN is not set"):
        TokenGuard(app)


def serve_args(*vllm_args, **kwargs):
    return types.SimpleNamespace(**{"model": "tiny/", "host": "127.0.0.1", "port": 8000, "token": None,
                                    "ready_timeout": 60.0, "vllm_args": list(vllm_args), **kwargs})


def test_serve_command_line():
    from posttrain.generation.serve import EXTENSION, MIDDLEWARE, vllm_command

    cpu = vllm_command(serve_args("--max-model-len", "512"), on_gpu=False)
    assert cpu[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for option in (["--worker-extension-cls", EXTENSION], ["--middleware", MIDDLEWARE], ["--enable-scale-out"],
                   ["--logprobs-mode", "processed_logprobs"], ["--dtype", "float32"], ["--no-enable-chunked-prefill"],
                   ["--weight-transfer-config", '{"backend": "gloo-posttrain"}'],
                   ["--host", "127.0.0.1"], ["--max-model-len", "512"]):
        assert any(cpu[i : i + len(option)] == option for i in range(len(cpu))), option
    assert "--dtype" not in vllm_command(serve_args(), on_gpu=True)  # a GPU keeps vLLM's defaults
    mine = vllm_command(serve_args("--dtype", "bfloat16", "--enable-prefix-caching"), on_gpu=False)
    assert mine.count("--dtype") == 1 and "--no-enable-prefix-caching" not in mine  # the user's options win
    nccl = vllm_command(serve_args("--weight-transfer-config", '{"backend": "nccl"}'), on_gpu=True)
    assert nccl.count("--weight-transfer-config") == 1


def test_serve_bad_input_is_a_user_error(tmp_path):
    import socket

    from posttrain.generation.serve import check_serve_args

    if __import__("importlib").util.find_spec("vllm") is None:
        pytest.skip("without vLLM the first check is that vLLM is missing")
    with pytest.raises(UserError, match="no config.json"):
        check_serve_args(serve_args(model=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(UserError, match="cannot listen there"):
            check_serve_args(serve_args(model=str(tmp_path), port=busy.getsockname()[1]))


def test_weights_travel_bit_for_bit_over_a_gloo_group():
    """send_weights on rank 0, receive_weights on rank 1 (a thread standing in for a server worker): names, dtypes,
    shapes and bytes arrive as sent, bucket by bucket, ended by the end mark."""
    from posttrain.distributed.weight_sync import SyncStore, open_sync_group, receive_weights, send_weights

    g = torch.Generator().manual_seed(0)
    buckets = [[("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16))],
               [("c", torch.arange(6, dtype=torch.int64).view(2, 3))], [("d", torch.randn(2, 2, generator=g).t())]]
    store = SyncStore("127.0.0.1", 2, 30)
    received = {}

    def worker():
        group = open_sync_group("127.0.0.1", store.port, 1, 2, 30, "127.0.0.1")
        received.update({name: t.clone() for name, t in receive_weights(group)})
        group.close()

    thread = threading.Thread(target=worker)
    thread.start()
    group = open_sync_group("127.0.0.1", store.port, 0, 2, 30, "127.0.0.1", store=store)
    sent = send_weights(group, buckets)
    thread.join(timeout=30)
    assert sent == sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    expected = dict(pair for bucket in buckets for pair in bucket)
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


@pytest.mark.parametrize("env, rank, world, expected", [
    ({}, 0, 1, (0, 0)),  # one process, no launcher
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, 1, 2, (0, 1)),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}, 4, 8, (1, 0)),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 7, 8, (1, 3)),  # no GROUP_RANK: contiguous ranks per node
])
def test_a_rank_knows_its_node_and_place_in_it(monkeypatch, env, rank, world, expected):
    from posttrain.generation.vllm_node import node_position

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_position(rank, world) == expected


def test_engine_per_node_placement_checks():
    from posttrain.config.load import load_recipe
    from posttrain.algorithms.grpo import GRPOAlgoConfig

    base = ["data.train=x.jsonl", "rewards=[{name: exact_match}]", "generation.engine=vllm"]
    node = load_recipe(None, base + ["generation.placement=node"], GRPOAlgoConfig)
    assert node.generation.placement == "node"
    with pytest.raises(UserError, match="generation.placement is 'gpu'; choose one of colocated, node, servers, ray"):
        load_recipe(None, base + ["generation.placement=gpu"], GRPOAlgoConfig)
    with pytest.raises(UserError, match="placement=node .*under launcher: ray use generation.placement=ray"):
        load_recipe(None, base + ["generation.placement=node", "launcher=ray"], GRPOAlgoConfig)
    with pytest.raises(UserError, match="generation.placement=ray starts the engines as Ray actors: launch with --ray"):
        load_recipe(None, base + ["generation.placement=ray", "placement.generation.num_engines=1"], GRPOAlgoConfig)
    with pytest.raises(UserError, match="generation.placement=ray needs placement.generation.num_engines >= 1"):
        load_recipe(None, base + ["generation.placement=ray", "launcher=ray"], GRPOAlgoConfig)
    with pytest.raises(UserError, match="generation.engine=hf generates with the policy itself"):
        load_recipe(None, base + ["generation.engine=hf", "generation.placement=node"], GRPOAlgoConfig)


@pytest.mark.parametrize("old, placement, engine", [
    (["generation.engine=server", "generation.servers=[http://a:1]"], "servers", "vllm"),
    (["generation.engine=vllm", "generation.vllm.placement=node"], "node", "vllm"),
    (["generation.engine=vllm", "generation.vllm.placement=rank"], "colocated", "vllm"),
    (["launcher=ray", "placement.generation.num_engines=2"], "ray", "vllm"),
])
def test_earlier_spellings_are_read_as_the_one_placement_key(old, placement, engine, capsys):
    """Old recipes keep working: each earlier knob is rewritten to generation.placement, and said once."""
    from posttrain.config.load import load_recipe
    from posttrain.algorithms.grpo import GRPOAlgoConfig

    got = load_recipe(None, ["data.train=x.jsonl", "rewards=[{name: exact_match}]", *old], GRPOAlgoConfig)
    assert (got.generation.placement, got.generation.engine) == (placement, engine)
    assert f"generation.placement={placement}" in capsys.readouterr().err
    with pytest.raises(UserError, match="means generation.placement=servers, but generation.placement=node"):
        load_recipe(None, ["data.train=x.jsonl", "generation.engine=server", "generation.placement=node"],
                    GRPOAlgoConfig)


def test_a_node_engine_that_cannot_start_stops_every_rank_naming_node_and_log(tmp_path):
    """The node's first rank starts `posttrain serve`; serve refuses a model directory without config.json (exit 2):
    a UserError naming the node, the exit code and the end of the engine's log, before any generation."""
    from posttrain.config.load import load_recipe
    from posttrain.algorithms.grpo import GRPOAlgoConfig
    from posttrain.generation.vllm_node import NodeEngine

    (tmp_path / "no-model").mkdir()
    r = load_recipe(None, ["data.train=x.jsonl", "rewards=[{name: exact_match}]", "generation.engine=vllm",
                           "generation.vllm.placement=node", f"model.name_or_path={tmp_path / 'no-model'}",
                           f"output_dir={tmp_path / 'out'}"], GRPOAlgoConfig)
    backend = types.SimpleNamespace(rank=0, world_size=1, is_main=True, all_gather_object=lambda obj: [obj])
    expected = (r"(?s)the vLLM engine of node 0 .*exited with code 2 while starting; the end of its log "
                r"\(.*engines/vllm-node0\.log on that node\).*no config\.json")
    with pytest.raises(UserError, match=expected):
        NodeEngine(r, backend, tokenizer=None)
    assert "no config.json" in (tmp_path / "out" / "engines" / "vllm-node0.log").read_text()


def test_serve_reads_its_token_from_a_file_or_the_environment_not_the_command_line(tmp_path, monkeypatch, capsys):
    from posttrain.generation.serve import read_token

    monkeypatch.setenv("POSTTRAIN_SERVER_TOKEN", "from-env")
    (tmp_path / "token").write_text("from-file\n")
    assert read_token(serve_args(token_file=str(tmp_path / "token"))) == "from-file"
    assert read_token(serve_args(token_file=None)) == "from-env"
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("POSTTRAIN_SERVER_TOKEN")
    assert read_token(serve_args(token="on-the-command-line", token_file=None)) == "on-the-command-line"
    assert "--token shows the token to every user" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="--token-file .*empty is empty"):
        read_token(serve_args(token_file=str(tmp_path / "empty")))
    with pytest.raises(UserError, match="--token-file .*missing: cannot read it"):
        read_token(serve_args(token_file=str(tmp_path / "missing")))


def test_earlier_spellings_pass_the_command_lines_own_check():
    """The CLI checks each override on its own before the recipe is loaded: an earlier spelling passes there too."""
    from posttrain.algorithms.grpo import GRPOAlgoConfig
    from posttrain.cli import command_line_overrides

    typed = ["generation.vllm.placement=node", "generation.engine=server", "generation.request_timeout=5"]
    assert command_line_overrides(typed, {}, GRPOAlgoConfig) == typed
    with pytest.raises(UserError, match="command line 'generation.vllm.placment=node'"):
        command_line_overrides(["generation.vllm.placment=node"], {}, GRPOAlgoConfig)


@pytest.mark.parametrize("option", ["--port", "--port=18721", "--host", "--model", "--middleware"])
def test_serve_refuses_vllm_options_that_contradict_its_own(option):
    """`posttrain serve --port 18720 -- --port 18721` put vLLM on 18721 while serve polled 18720 for 900 s."""
    from posttrain.generation.serve import check_vllm_args

    with pytest.raises(UserError, match=f"{option.split('=')[0]} after -- would override what posttrain serve passes"):
        check_vllm_args(serve_args(option, "18721"))
    check_vllm_args(serve_args("--max-model-len", "512", "--port-range", "3"))  # others pass through


def test_a_server_just_started_is_not_read_as_left_inside_a_weight_update():
    """vLLM's /collective_rpc sends False as "False" (any non-dict, non-list result as its str()): every server, even
    one just started, was warned about as left mid-update by an earlier trainer."""
    from posttrain.generation.weight_transfer import any_true

    assert not any_true({"results": ["False", "False"]}) and not any_true({"results": [False]})
    assert any_true({"results": ["False", "True"]}) and any_true({"results": [True]})
    assert not any_true(None) and not any_true({"results": "True"}) and not any_true([True])
