"""The judge reward against a hostile fake OpenAI-compatible server (wrong JSON, slow, 500s, redirects, floods) and
its parsing; the real vLLM server as judge is tests/integration/test_judge.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.config.schema import RewardConfig
from posttrain.errors import UserError
from posttrain.generation.http import BadAnswer, ServerUnavailable
from posttrain.rewards import RewardError, RewardSet
from posttrain.rewards.judge import parse_score
from posttrain.rewards.load import load_reward


class FakeJudge(BaseHTTPRequestHandler):
    """Answers per the server's `mode`; records requests, their peak concurrency and the client ports."""

    protocol_version = "HTTP/1.1"  # keep-alive, so a pooled connection can be reused

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "the-judge", "object": "model"}]})

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append((body, self.headers.get("Authorization"), self.client_address[1]))
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
            attempt = len(server.requests)
        try:
            mode = server.mode
            if mode == "slow":
                time.sleep(2.0)
            if mode == "drip":  # headers at once, then a byte every 0.3 s
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(20):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.3)
                return
            if mode == "500" or (mode == "500_then_ok" and attempt == 1):
                return self._send(500, {"error": "overloaded"})
            if mode == "redirect":
                self.send_response(307)
                self.send_header("Location", "http://elsewhere.example/v1/chat/completions")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if mode == "not_json":
                return self._raw(200, b"<html>gateway</html>")
            if mode == "wrong_shape":
                return self._send(200, {"choices": [{"text": "7"}]})
            if mode == "flood":
                return self._raw(200, b"[" + b"1," * 600_000 + b"1]")
            time.sleep(0.05)
            text = body["messages"][-1]["content"]
            self._send(200, {"choices": [{"message": {"role": "assistant",
                                                      "content": f"Score: {len(text.split('|')[1])}"}}]})
        finally:
            with server.lock:
                server.in_flight -= 1

    def _send(self, status, payload):
        self._raw(status, json.dumps(payload).encode())

    def _raw(self, status, data):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    server.daemon_threads = True
    server.mode, server.requests, server.lock, server.in_flight, server.peak = "ok", [], threading.Lock(), 0, 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    template = tmp_path / "judge.jinja"
    template.write_text("Rate {{ prompt }} |{{ completion }}| against {{ answer }}")
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.template = str(template)
    yield server
    server.shutdown()
    server.server_close()


def judge(fake, **kwargs):
    """The fake's judge (it scores a completion's length: 0-100 declared); score_range=None: none declared. Its
    requests may take 5 s (a loaded CI machine answers a local request in more than 1 s at times); the deadline
    tests give their own."""
    kwargs = {"url": fake.url, "prompt_template": fake.template, "request_timeout_s": 5.0, "retries": 1,
              "score_range": [0, 100], **kwargs}
    return load_reward(RewardConfig(name="judge", kwargs={k: v for k, v in kwargs.items() if v is not None})).fn


def test_scores_concurrently_over_pooled_connections_with_the_token(fake, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_TOKEN", "s3cret")
    fn = judge(fake, concurrency=4, token_env="MY_JUDGE_TOKEN", model="m")
    completions = ["x" * n for n in range(12)]
    scores = fn(prompts=["p"] * 12, completions=completions, completion_ids=None, answer=["a"] * 12)
    assert scores == [float(n) for n in range(12)]  # the fake scores the completion's length, in order
    bodies = [b for b, _, _ in fake.requests]
    assert {b["model"] for b in bodies} == {"m"} and bodies[0]["messages"][-1]["content"].startswith("Rate p |")
    assert "against a" in bodies[0]["messages"][-1]["content"]  # the dataset's columns reach the template
    assert {auth for _, auth, _ in fake.requests} == {"Bearer s3cret"}
    assert 1 < fake.peak <= 4  # concurrent, never more than the pool
    assert len({port for _, _, port in fake.requests}) <= 4  # connections were reused


def test_without_a_model_name_it_asks_the_server(fake):
    assert judge(fake)(["p"], ["abc"], answer=["a"]) == [3.0]
    assert fake.requests[0][0]["model"] == "the-judge"


def test_a_500_is_tried_again(fake):
    fake.mode = "500_then_ok"
    assert judge(fake)(["p"], ["abcd"], answer=["a"]) == [4.0] and len(fake.requests) == 2


@pytest.mark.parametrize("mode, error, message", [
    ("500", ServerUnavailable, "HTTP 500.*after 2 tries"),
    ("slow", ServerUnavailable, "no complete answer within 1 s"),
    ("drip", ServerUnavailable, "no complete answer within 1 s"),
    ("redirect", ServerUnavailable, "no redirect is followed"),
    ("not_json", ServerUnavailable, "not JSON"),
    ("wrong_shape", BadAnswer, r"choices\[0\].message.content"),
    ("flood", ServerUnavailable, "bytes allowed"),
])
def test_hostile_answers_fail_with_a_reason_and_in_time(fake, mode, error, message):
    fake.mode = mode
    started = time.monotonic()
    with pytest.raises(error, match=message):
        judge(fake, model="m", max_answer_bytes=2**20, request_timeout_s=1.0)(["p"], ["abc"], answer=["a"])
    assert time.monotonic() - started < 4.0  # deadlines hold: at most 2 tries of 1 s and a back-off
    assert len(fake.requests) == (2 if mode in ("500", "slow", "drip") else 1)  # only what may help is tried again


def test_in_a_reward_set_a_failing_judge_obeys_on_error(fake):
    fake.mode = "wrong_shape"
    strict = RewardSet([("judge", judge(fake, model="m"), 1.0, 30.0, "raise")])
    with pytest.raises(RewardError, match="judge"):
        strict.score(["p"], ["abc"], {"answer": ["a"]})
    lenient = RewardSet([("judge", judge(fake, model="m"), 1.0, 30.0, "skip")])
    assert lenient.score(["p"], ["abc"], {"answer": ["a"]})[2] == 1


@pytest.mark.parametrize("text, parse, expected", [
    ("The answer deserves 7/10. Final score: 8", "number", 8.0),
    ("no digits", "number", None),
    ("Yes, it is correct", "yes_no", 1.0),
    ("**No**", "yes_no", 0.0),
    ("maybe", "yes_no", None),
    ("<score>0.75</score> (was 3)", r"<score>(.*?)</score>", 0.75),
    ("<score>n/a</score>", r"<score>(.*?)</score>", None),
])
def test_parse(text, parse, expected):
    assert parse_score(text, parse) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"url": "ftp://x"}, "http"),
    ({"prompt_template": "/no/such.jinja"}, "is not a file"),
    ({"parse": "score"}, "neither number, yes_no nor a regular expression"),
    ({"concurrency": 0}, "concurrency"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"modle": "x"}, "did you mean 'model'"),
])
def test_bad_kwargs_fail_at_load(fake, kwargs, message):
    with pytest.raises(UserError, match=message):
        judge(fake, **kwargs)


def test_a_template_with_an_unknown_variable_fails_on_the_first_batch(fake, tmp_path):
    template = tmp_path / "typo.jinja"
    template.write_text("{{ completoin }}")
    with pytest.raises(Exception, match="completoin"):
        judge(fake, prompt_template=str(template), model="m")(["p"], ["c"])


def test_after_the_judge_times_out_it_sends_no_more_requests_and_holds_no_thread_the_exit_waits_for(fake):
    """A batch of 40 to a judge answering in 2 s, 2 at a time, with a 0.5 s reward timeout: it used to send all 40
    (and the process waited for them at exit); now only those in flight when the caller gave up."""
    fake.mode = "slow"
    rewards = RewardSet([("judge", judge(fake, model="m", concurrency=2, request_timeout_s=5.0, retries=0), 1.0, 0.5,
                          "skip")])
    scores = rewards.score(["p"] * 40, ["abc"] * 40, {"answer": ["a"] * 40})
    assert scores.skipped == 40
    time.sleep(4.5)  # the two in flight end (2 s); none follows them
    assert len(fake.requests) <= 4
    judges = [t for t in threading.enumerate() if t.name == "posttrain-judge"]
    assert all(t.daemon for t in judges)


def test_a_stop_signal_ends_the_judges_requests(fake, monkeypatch):
    import signal

    from posttrain.usercode import request_stop

    fake.mode = "slow"
    fn = judge(fake, model="m", concurrency=2, request_timeout_s=5.0, retries=0)
    threading.Timer(0.3, request_stop, args=(signal.SIGTERM,)).start()
    try:
        with pytest.raises(ServerUnavailable, match="abandoned"):
            fn(["p"] * 20, ["abc"] * 20, answer=["a"] * 20)
    finally:
        request_stop(0)
    assert len(fake.requests) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"retries": 1.5}, r"kwargs.retries is 1.5 \(float\); give a whole number"),
    ({"concurrency": "8"}, r"kwargs.concurrency is '8' \(str\); give a whole number"),
    ({"max_tokens": True}, r"kwargs.max_tokens is True"),
    ({"request_timeout_s": "60"}, r"kwargs.request_timeout_s is '60' \(str\); give a number"),
    ({"token_env": "NO_SUCH_JUDGE_TOKEN_XYZ"}, r"kwargs.token_env names \$NO_SUCH_JUDGE_TOKEN_XYZ, which is not set"),
    ({"url": "http://127.0.0.1:9/v1"}, r"kwargs.url http://127.0.0.1:9/v1 does not answer"),
    ({"score_range": [10, 0]}, r"kwargs.score_range is \[10, 0\]"),
])
def test_judge_settings_are_checked_at_load_naming_the_key(fake, kwargs, message):
    """Each of these was found mid-run (after the model loaded), or was a traceback, or did not name the key."""
    with pytest.raises(UserError, match=message):
        judge(fake, **kwargs)


def test_a_server_that_wants_a_token_is_refused_at_load_naming_the_variable(fake, monkeypatch):
    def refuse(handler):
        handler._send(401, {"error": "unauthorized"})

    monkeypatch.setattr(FakeJudge, "do_GET", refuse)
    monkeypatch.delenv("POSTTRAIN_JUDGE_TOKEN", raising=False)
    with pytest.raises(UserError, match=r"refused the request \(HTTP 401\): it needs an API token "
                                        r"\(\$POSTTRAIN_JUDGE_TOKEN is not set\)"):
        judge(fake, model="m")


def test_a_template_variable_that_is_no_column_is_refused_before_any_model_loads(fake, tmp_path):
    from posttrain.rewards.load import load_rewards

    template = tmp_path / "typo.jinja"
    template.write_text("{{ prompt }} {{ completoin }} {{ answer }}")
    rewards = load_rewards([RewardConfig(name="judge", kwargs={"url": fake.url, "prompt_template": str(template),
                                                               "model": "m", "score_range": [0, 10]})])
    with pytest.raises(UserError, match=r"reward 'judge' reads completoin, which is neither prompt, completion nor a "
                                        r"column of data.train \(columns: answer\)"):
        rewards.check_columns(["answer"], "data.train")
    rewards.check_columns(["answer", "completoin"], "data.train")


@pytest.mark.parametrize("answer", ["Score: " + "9" * 45, "Score: " + "9" * 400, "Score: 11", "Score: -1"])
def test_a_score_outside_the_declared_range_is_refused(fake, monkeypatch, answer):
    from posttrain.rewards import judge as judge_module

    monkeypatch.setattr(judge_module.Judge, "ask", lambda self, text: answer)
    fn = judge(fake, model="m", score_range=[0, 10])
    with pytest.raises(BadAnswer, match=r"is outside kwargs.score_range \[0.0, 10.0\]"):
        fn(["p"], ["c"], answer=["a"])
    assert judge(fake, model="m", score_range=[0, 10]).in_range(7.0, "7") == 7.0


@pytest.mark.parametrize("parse", ["number", r"Score: (\d+)"])
def test_a_judge_that_reads_numbers_needs_a_declared_range(fake, parse):
    """Without one, an answer of 11 to a template that asks for 0-10 (or 45 digits) was trained on as it came."""
    with pytest.raises(UserError, match=r"kwargs.score_range is not set; declare the scores the template asks for"):
        judge(fake, model="m", parse=parse, score_range=None)


def test_a_yes_no_judge_needs_no_range(fake, monkeypatch):
    from posttrain.rewards import judge as judge_module

    monkeypatch.setattr(judge_module.Judge, "ask", lambda self, text: "Yes.")
    assert judge(fake, model="m", parse="yes_no", score_range=None)(["p"], ["c"], answer=["a"]) == [1.0]
