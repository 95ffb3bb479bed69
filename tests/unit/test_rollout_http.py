"""Never a hang, never trust the other side: the server engine against fake servers that misbehave, in this process.

Each case is a real HTTP server on 127.0.0.1 answering the way a broken, slow or hostile server would; the engine's
call must stop within its deadline with an error naming the server and what was wrong (RunStopped: exit 1 in a run;
UserError, exit 2, at start-up). No model is loaded."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import types

import pytest

from posttrain.config.schema import GenerationConfig
from posttrain.errors import RunStopped, UserError
from posttrain.generation.base import SamplingParams
from posttrain.generation.http import ServerUnavailable, call, read_completion
from posttrain.generation.server import ServerEngine

VOCAB = 100
TOKENIZER = types.SimpleNamespace(eos_token_id=2)


def choice(tokens=(5, 6, 7), logprobs=(-0.5, -1.0, -0.1), **extra) -> dict:
    ids = tokens if isinstance(tokens, str) else list(tokens)
    return {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "length",
                         "logprobs": {"content": [{"logprob": v} for v in logprobs]}, **extra}]}


class Fake:
    """A threaded HTTP server whose every answer is `respond(handler)`; it records the requests it got."""

    def __init__(self, respond):
        self.requests = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            body = b""

            def do_GET(self):
                fake.requests.append((self.path, dict(self.headers)))
                try:
                    respond(self)
                except OSError:  # the client hung up (as it should)
                    pass

            def do_POST(self):
                self.body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.do_GET()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def send(handler, body: bytes, status: int = 200, headers=()):
    handler.send_response(status)
    for key, value in headers:
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def json_answer(answer):
    text = answer if isinstance(answer, str) else json.dumps(answer)
    return lambda h: send(h, text.encode(), headers=[("Content-Type", "application/json")])


def drip(handler):  # a valid start, then one byte every 0.8 s, for ever
    handler.send_response(200)
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    while True:
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.8)


def huge(handler, announce: bool):  # 300 MiB of JSON-looking bytes, with or without saying so first
    handler.send_response(200)
    if announce:
        handler.send_header("Content-Length", str(300 * 2**20))
    else:
        handler.send_header("Connection", "close")
    handler.end_headers()
    block = b"[" + b"0," * 32767
    for _ in range(300 * 2**20 // len(block)):
        handler.wfile.write(block)


@pytest.fixture
def fake():
    servers = []

    def start(respond):
        servers.append(Fake(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def engine(url, timeout=3.0, **generation):
    config = GenerationConfig(engine="vllm", placement="servers", servers=(url,), request_timeout_s=timeout, request_retries=0,
                              sync_timeout_s=timeout, **generation)
    return ServerEngine(config, TOKENIZER, sends_weights=True, token="s3cret", vocab_size=VOCAB)


def generate(url, timeout=3.0):
    return engine(url, timeout).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=1.0))


BAD_ANSWERS = {
    "NaN log-prob": ('{"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length", '
                     '"logprobs": {"content": [{"logprob": NaN}]}}]}', "log-prob nan of token 0"),
    "inf log-prob": ('{"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length", '
                     '"logprobs": {"content": [{"logprob": -Infinity}]}}]}', "log-prob -inf of token 0"),
    "positive log-prob": (choice(logprobs=(-0.5, 0.25, -0.1)), "log-prob 0.25 of token 1"),
    "id 1e9": (choice(tokens=(5, 10**9, 7)), "token id 1000000000 is outside the vocabulary [0, 100)"),
    "id -5": (choice(tokens=(5, -5, 7)), "token id -5 is outside the vocabulary"),
    "too many tokens": (choice(tokens=[5] * 1000, logprobs=[-1.0] * 1000), "1000 tokens, but at most 4"),
    "ids not a list": (choice(tokens="abc", logprobs=()), "'token_ids' must be a list of integers, got 'abc'"),
    "float ids": (choice(tokens=(5.0, 6.0, 7.0)), "'token_ids' must be a list of integers"),
    "counts differ": (choice(tokens=(5, 6, 7), logprobs=(-1.0,)), "one entry per token (3)"),
    "no choices": ({"id": "x"}, "'choices' must be a list of one object"),
    "empty choices": ({"choices": []}, "'choices' must be a list of one object"),
    "not JSON": ("<html>502 Bad Gateway</html>", "the answer is not JSON"),
    "a JSON list": ([1, 2, 3], "the answer is a list, not a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_wrong_answer_stops_the_call_naming_the_server_and_what_was_wrong(fake, case):
    answer, expected = BAD_ANSWERS[case]
    server = fake(json_answer(answer))
    with pytest.raises(RunStopped) as stopped:
        generate(server.url)
    assert f"generation server {server.url}" in str(stopped.value) and expected in str(stopped.value), stopped.value
    assert stopped.value.exit_code == 1


def test_a_good_answer_passes():
    tokens, logprobs, finish, versions = read_completion(choice(weight_versions=[{"version": "3", "start": 0,
                                                                                  "end": 3}]), 4, VOCAB)
    assert (tokens, logprobs, finish, versions) == ([5, 6, 7], [-0.5, -1.0, -0.1], "length", {"3"})


def test_a_dripping_server_is_cut_off_at_the_deadline(fake):
    """1 byte every 0.8 s: each read succeeds, so a per-read timeout never fires; the whole-request deadline does."""
    server = fake(drip)
    started = time.monotonic()
    with pytest.raises(RunStopped, match=f"generation server {server.url} failed: .*no complete answer within 2 s"):
        generate(server.url, timeout=2.0)
    assert time.monotonic() - started < 3.5


def test_a_server_that_never_answers_is_cut_off_at_the_deadline(fake):
    server = fake(lambda handler: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(RunStopped, match="no complete answer within 1.5 s"):
        generate(server.url, timeout=1.5)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("announce", [True, False])
def test_a_huge_answer_is_refused_without_reading_it_whole(fake, announce):
    server = fake(lambda handler: huge(handler, announce))
    started = time.monotonic()
    with pytest.raises(RunStopped, match=f"{server.url} failed: .*(would be 314572800 bytes|passed the 1064960 bytes)"):
        generate(server.url, timeout=20.0)
    assert time.monotonic() - started < 5.0  # reading 300 MiB through http.client takes longer than this


def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(fake):
    elsewhere = fake(json_answer(choice()))
    server = fake(lambda h: send(h, b"", 302, [("Location", elsewhere.url + "/inference/v1/generate")]))
    with pytest.raises(RunStopped, match=f"{server.url} failed: .*HTTP 302 redirect to '{elsewhere.url}"):
        generate(server.url)
    assert len(server.requests) == 1 and server.requests[0][1]["Authorization"] == "Bearer s3cret"
    assert elsewhere.requests == []  # neither the request nor the token reached the other port


def test_a_sync_whose_server_never_joins_stops_within_sync_timeout(fake):
    """The server says it has one worker, then never joins the transfer group (its /init_weight_transfer_engine
    hangs): the trainer stops after sync_timeout_s naming the server and the phase, instead of waiting for ever."""
    import torch

    def respond(handler):
        if handler.path.startswith("/init_weight_transfer_engine"):
            time.sleep(30)
        send(handler, json.dumps({"world_size": 1}).encode())

    server = fake(respond)
    sync = engine(server.url, timeout=2.0)
    started = time.monotonic()
    with pytest.raises(RunStopped, match=f"generation server {server.url} failed during a weight sync \\(init phase"):
        sync.load_weights([[("w", torch.zeros(3))]])
    assert time.monotonic() - started < 6.0
    sync.close()


def test_call_errors_are_retryable_only_when_another_try_can_help(fake):
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()
    with pytest.raises(ServerUnavailable) as e:
        call(f"http://127.0.0.1:{port}", "/health", timeout=2)
    assert e.value.retry
    for respond, retry in ((lambda h: send(h, b"{}", 503), True), (lambda h: send(h, b"{}", 404), False),
                           (json_answer("not json"), False)):
        with pytest.raises(ServerUnavailable) as e:
            call(fake(respond).url, "/x", timeout=2)
        assert e.value.retry is retry, e.value


def cut_short(handler):  # a server dying while it sends its answer: 10 of the 1000 bytes it announced, then gone
    handler.send_response(200)
    handler.send_header("Content-Length", "1000")
    handler.end_headers()
    handler.wfile.write(b'{"choices"')
    handler.wfile.flush()
    handler.close_connection = True


def test_an_answer_cut_short_is_an_error_to_retry_never_an_empty_answer(fake):
    """http.client's read1 takes a closed connection for the end of the body, so a server killed mid-answer once
    read as an empty (None) answer and the run stopped on 'a wrong answer' instead of trying the server again."""
    server = fake(cut_short)
    with pytest.raises(ServerUnavailable, match="closed after 10 of the 1000 bytes announced") as e:
        call(server.url, "/inference/v1/generate", {"token_ids": [1]}, timeout=5)
    assert e.value.retry
    with pytest.raises(RunStopped, match=f"generation server {server.url} failed: .*closed after 10 of the 1000"):
        generate(server.url)


def test_bad_answers_at_start_up_are_user_errors_naming_the_server(fake, tiny_model_dir, monkeypatch):
    from posttrain.config.schema import Recipe
    from posttrain.generation.server import check_servers
    from transformers import AutoTokenizer

    monkeypatch.setenv("POSTTRAIN_SERVER_TOKEN", "s3cret")
    for answer, expected in (("garbage", "/v1/models failed (/v1/models: the answer is not JSON"),
                             ({"data": []}, "its answer has no ['data'][0]")):
        server = fake(lambda h, answer=answer: (send(h, b"") if h.path == "/health" else json_answer(answer)(h)))
        recipe = Recipe(model=Recipe().model.__class__(name_or_path=str(tiny_model_dir)),
                        data=Recipe().data.__class__(train="x.jsonl"),
                        generation=GenerationConfig(engine="vllm", placement="servers", servers=(server.url,)))
        with pytest.raises(UserError) as error:
            check_servers(recipe, AutoTokenizer.from_pretrained(tiny_model_dir))
        assert f"generation.servers[0] = {server.url}" in str(error.value) and expected in str(error.value)


def test_the_sync_store_listens_on_the_given_address_only():
    from posttrain.distributed.sync_group import SyncStore

    store = SyncStore("127.0.0.2", 2, 5)
    with socket.create_connection(("127.0.0.2", store.port), timeout=2):
        pass
    # bound to that address alone (not 0.0.0.0; TCPStore listens on this socket and opens none of its own). Not a
    # refused connection to 127.0.0.1:port: a test beside this one may hold that port on 127.0.0.1
    assert store._listener.getsockname() == ("127.0.0.2", store.port)
    assert len(store.key) == 32  # entries live under a random key only the token-guarded HTTP channel carries


def test_a_sync_runs_vllms_four_phases_and_the_bytes_arrive_bit_for_bit(fake):
    """The trainer side of the native path against a server that does what vLLM's routes + the gloo-posttrain
    backend do (a real gloo group; the worker is a thread): init once, then start, update, finish per sync, in that
    order; every tensor arrives with its name, dtype, shape and bytes."""
    import torch

    from posttrain.distributed.sync_group import open_sync_group, receive_buckets

    phases, received, worker = [], [], {}

    def respond(handler):
        route = handler.path.split("?")[0]
        phases.append(route)
        body = json.loads(handler.body or b"{}")
        if route == "/get_world_size":
            answer = {"world_size": 1}
        elif route == "/init_weight_transfer_engine":
            info = body["init_info"]
            worker["group"] = open_sync_group(info["addr"], info["port"], info["rank_offset"], info["world_size"],
                                              info["timeout_s"], "127.0.0.1", key=info["key"])
            answer = {}
        elif route == "/update_weights":
            received.extend([[(name, t.clone()) for name, t in bucket] for bucket in receive_buckets(worker["group"])])
            answer = {}
        elif route == "/reset_prefix_cache":  # vLLM answers success false while a request holds cache blocks
            answer = {"success": worker.get("reset", True)}
        else:
            answer = {}
        send(handler, json.dumps(answer).encode())

    server = fake(respond)
    sync = engine(server.url, timeout=20.0, sync_bucket_mb=1)
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(300, 1024, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
               ("c", torch.arange(6).view(2, 3)), ("d", torch.randn(4, 4, generator=g).t())]
    for round_ in range(2):
        buckets = [tensors[:1], tensors[1:]]  # as the backend gathers them: they travel as they come
        sync.load_weights(iter(buckets))
        assert [[name for name, _ in b] for b in received] == [[name for name, _ in b] for b in buckets]
        arrived = dict(pair for bucket in received for pair in bucket)
        for name, tensor in tensors:
            assert arrived[name].dtype == tensor.dtype and torch.equal(arrived[name], tensor), name
        received.clear()
    one_sync = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    # /collective_rpc: an update a dead trainer left open is ended first (posttrain_end_abandoned_update)
    assert phases == ["/get_world_size", "/collective_rpc", "/init_weight_transfer_engine"] + one_sync * 2
    worker["reset"] = False  # a prefix cache that stays holds the old weights' keys and values: the run stops
    with pytest.raises(RunStopped, match=f"generation server {server.url} could not reset its prefix cache"):
        sync.load_weights(iter([tensors]))
    sync.close()
    worker["group"].close()


def test_the_request_carries_every_stop_id_and_a_completion_ending_on_one_is_finished(fake, eos_ids_model_dir):
    """The generation config's second eos (7) goes to the server in stop_token_ids beside the tokenizer's; a
    completion that ends on it at max_tokens is not truncated."""
    from posttrain.config.schema import ModelConfig
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(eos_ids_model_dir(7))))
    bodies = []
    server = fake(lambda h: (bodies.append(json.loads(h.body)), json_answer(choice(tokens=(5, 6, 7)))(h)))
    config = GenerationConfig(engine="vllm", placement="servers", servers=(server.url,), request_retries=0)
    out = ServerEngine(config, tokenizer, sends_weights=True, token="s3cret", vocab_size=VOCAB).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=1.0))
    assert bodies[0]["sampling_params"]["stop_token_ids"] == [tokenizer.eos_token_id, 7]
    assert out.completion_ids == [[5, 6, 7]] and out.truncated == [False]


def refuse_slowly(handler):
    """Every request: HTTP 400 (nothing to retry) a moment after it arrives."""
    time.sleep(0.3)
    send(handler, b'{"error": "bad request"}', status=400, headers=[("Content-Type", "application/json")])


@pytest.mark.parametrize("client", ["generation", "teacher"])
def test_a_failed_request_ends_its_batch_and_no_request_goes_out_after(fake, client):
    """200 requests over a pool of 64, every one refused: the call stops at the first failure, and the ~136 requests
    still queued are never sent (the pool used to send every one of them after the call had failed, and the process
    could not exit until they were done: issue 48, class 3)."""
    from posttrain.generation.teacher_server import TeacherServer

    server = fake(refuse_slowly)
    with pytest.raises(RunStopped, match="HTTP 400"):
        if client == "generation":
            engine(server.url).generate([[1, 2, i] for i in range(200)], SamplingParams(max_new_tokens=4))
        else:
            TeacherServer(server.url, top_k=2, timeout=3.0, retries=0, token="s3cret").topk([[1, 2, i]
                                                                                         for i in range(200)])
    stopped, count = time.monotonic(), len(server.requests)
    time.sleep(1.5)  # long enough for several more waves of 0.3 s requests, had they gone out
    assert len(server.requests) <= 64 + 8, (count, len(server.requests))  # a few may start before the cancel
    assert time.monotonic() - stopped >= 1.5


def test_request_all_cancels_the_queue_and_stops_retries_on_a_failure():
    """The helper alone: items run two at a time; item 0 fails, so items not started never run, and a retry loop
    watching `abandon` is told at once."""
    from concurrent.futures import ThreadPoolExecutor

    from posttrain.generation.http import request_all

    ran, told = [], []

    def request(item, abandon):
        ran.append(item)
        if item == 0:
            time.sleep(0.05)
            raise RuntimeError("item 0 failed")
        told.append(abandon.wait(2.0))  # a request in flight, waiting to retry
        return item

    pool = ThreadPoolExecutor(max_workers=2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="item 0 failed"):
        request_all(pool, request, list(range(20)))
    pool.shutdown(wait=True)
    assert sorted(ran) in ([0, 1], [0, 1, 2]) and all(told) and time.monotonic() - started < 1.5
    assert request_all(ThreadPoolExecutor(max_workers=3), lambda item, abandon: item * 2, [1, 2, 3]) == [2, 4, 6]
