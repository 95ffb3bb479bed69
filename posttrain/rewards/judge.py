"""An LLM judge as a reward: each completion is put into a prompt template, sent to any OpenAI-compatible chat endpoint
(vLLM's `vllm serve`, `posttrain serve`, a hosted API), and the judge's answer is read as a number.

    rewards:
      - name: judge
        kwargs:
          url: http://127.0.0.1:8000/v1          # the endpoint's base URL (POST {url}/chat/completions)
          model: Qwen/Qwen2.5-7B-Instruct         # the name the server serves (unset: the one it lists)
          prompt_template: judge.jinja            # gets prompt, completion and every dataset column
          parse: number                           # number | yes_no | a regex whose group 1 is the number
          concurrency: 16                         # requests in flight (and pooled connections)
          request_timeout_s: 60
          retries: 2
          token_env: POSTTRAIN_JUDGE_TOKEN        # the API token is read from this environment variable
          score_range: [0, 10]                    # the scores the template asks for (required but for yes_no):
                                                  # any other answer is refused
        timeout: 600                              # seconds the whole batch may take

At start-up, before any model loads, every setting is checked by kind and range, a token_env named on purpose must
be set, the server must answer at {url}/models (and take the token), and the template's variables must be prompt,
completion or columns of the data (once it is read).

Requests go out concurrently over one pool of keep-alive connections (httpx). The server is never trusted: a request
has a deadline (connect, send and the whole answer within request_timeout_s: a server that drips bytes is cut off), an
answer over `max_answer_bytes` is refused, redirects are not followed (the token would go along), the answer must be
JSON of the chat-completion shape; refused connections, missed deadlines and HTTP 5xx are tried again (0.25 s, 0.5 s,
... apart), other failures are not. A request that still fails raises, and the reward's `on_error` decides (stop the
run naming the sample, or `skip` the batch). An answer that `parse` cannot read gives None (no reward for the sample,
counted in rewards/skipped).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from posttrain.errors import UserError, overflows_float32
from posttrain.generation.http import BadAnswer, ServerUnavailable
from posttrain.rewards.contract import abandoned
from posttrain.usercode import stop_requested

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PARSERS = ("number", "yes_no")
TOKEN_ENV = "POSTTRAIN_JUDGE_TOKEN"
"""Where the API token is read from unless kwargs.token_env names another variable (unset: no token)."""


def read_chat_answer(answer: Any) -> str:
    """The text of an OpenAI chat-completion answer's first choice, checked; BadAnswer names what is wrong."""
    if not isinstance(answer, dict):
        raise BadAnswer(f"the answer is a {type(answer).__name__}, not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadAnswer(f"'choices' must be a non-empty list of objects, got {str(choices)[:80]}")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise BadAnswer(f"'choices[0].message.content' must be a string, got {str(message)[:80]}")
    return content


def parse_score(text: str, parse: str) -> Optional[float]:
    """The judge's verdict as a number: the last number in the text (number), 1/0 for an answer starting with yes/no
    (yes_no), or group 1 of the first match of a regular expression; None when it is not there."""
    if parse == "yes_no":
        word = text.strip().lstrip("*\"'`").lower()
        return 1.0 if word.startswith("yes") else 0.0 if word.startswith("no") else None
    if parse == "number":
        numbers = _NUMBER.findall(text)
        value = float(numbers[-1]) if numbers else None
    else:
        match = re.search(parse, text, re.DOTALL)
        found = _NUMBER.search(match.group(1)) if match else None
        value = float(found.group()) if found else None
    return None if value is None or math.isnan(value) else value  # inf (400 digits) is refused by Judge.in_range


class Judge:
    """The `judge` built-in (TRL's reward contract): one chat request per completion, `concurrency` at a time."""

    def __init__(self, url: str, prompt_template: str, model: str = "", parse: str = "number", system: str = "",
                 max_tokens: int = 64, temperature: float = 0.0, concurrency: int = 8, request_timeout_s: float = 60.0,
                 retries: int = 2, token_env: str = TOKEN_ENV, max_answer_bytes: int = 2**20,
                 score_range: Optional[list] = None):
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"reward judge: kwargs.url must be an http(s) URL like http://127.0.0.1:8000/v1, got "
                            f"{url!r}")
        check_types(max_tokens=max_tokens, concurrency=concurrency, retries=retries, max_answer_bytes=max_answer_bytes,
                    temperature=temperature, request_timeout_s=request_timeout_s)
        checks = {"concurrency": concurrency >= 1, "max_tokens": max_tokens >= 1, "retries": retries >= 0,
                  "request_timeout_s": request_timeout_s > 0, "temperature": temperature >= 0,
                  "max_answer_bytes": max_answer_bytes >= 1024}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise UserError(f"reward judge: kwargs {', '.join(bad)} out of range (need concurrency, max_tokens >= 1, "
                            "retries >= 0, request_timeout_s > 0, temperature >= 0, max_answer_bytes >= 1024)")
        if parse not in PARSERS:
            try:
                if re.compile(parse).groups < 1:
                    raise re.error("it has no group")
            except re.error as e:
                raise UserError(f"reward judge: kwargs.parse is {parse!r}: neither number, yes_no nor a regular "
                                f"expression with a group around the score ({e})") from None
        self.score_range = check_range(score_range, parse)
        self.template, self.columns = _load_template(prompt_template)
        self.url, self.model, self.parse, self.system = str(url).rstrip("/"), model, parse, system
        self.max_tokens, self.temperature, self.retries = max_tokens, temperature, retries
        self.timeout, self.max_answer_bytes, self.concurrency = request_timeout_s, max_answer_bytes, concurrency
        self.token, self.token_env = os.environ.get(token_env, ""), token_env
        if token_env != TOKEN_ENV and not self.token:  # named on purpose: the judge needs it
            raise UserError(f"reward judge: kwargs.token_env names ${token_env}, which is not set (or empty); export "
                            "the judge's API token in it, or drop token_env for a judge without one")
        self._lock = threading.Lock()
        import httpx  # here, not at import: `import posttrain` needs no HTTP library

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._client = httpx.Client(limits=limits, headers=headers, follow_redirects=False,
                                    timeout=httpx.Timeout(request_timeout_s))
        self._check_reachable()

    def _check_reachable(self) -> None:
        """At start-up, before any model loads: the server answers at kwargs.url (GET {url}/models), takes the token,
        and serves a model (the one it lists when kwargs.model is unset). A server without /models is fine when
        kwargs.model names the model."""
        try:
            self._served_model() if not self.model else self._request("/models", None)
        except ServerUnavailable as e:
            if e.status == 404 and self.model:
                return
            raise UserError(f"reward judge: kwargs.url {self.url} {self._why(e)}") from None
        except BadAnswer as e:
            raise UserError(f"reward judge: {e}") from None

    def _why(self, error: ServerUnavailable) -> str:
        """What a failed request says, naming the token's variable when the server refused the token."""
        if error.status in (401, 403):
            given = f"${self.token_env} is set" if self.token else f"${self.token_env} is not set"
            return (f"refused the request (HTTP {error.status}): it needs an API token ({given}); export it, or name "
                    "the variable that holds it in kwargs.token_env")
        return f"does not answer as an OpenAI-compatible server ({error}); start the judge there or fix kwargs.url"

    def __call__(self, prompts, completions, completion_ids=None, **kwargs) -> list[Optional[float]]:
        columns = {k: v for k, v in kwargs.items() if isinstance(v, (list, tuple)) and len(v) == len(completions)}
        texts = [self.template.render(prompt=p, completion=c, **{k: v[i] for k, v in columns.items()})
                 for i, (p, c) in enumerate(zip(prompts, completions))]
        answers = bounded_map(self.ask, texts, self.concurrency, abandoned())
        return [self.in_range(parse_score(answer, self.parse), answer) for answer in answers]

    def in_range(self, score: Optional[float], answer: str) -> Optional[float]:
        """The score, when it is one the judge may give: within kwargs.score_range (which float32 holds: a 45-digit
        answer is never a score)."""
        low, high = self.score_range
        if score is not None and not low <= score <= high:
            raise BadAnswer(f"judge {self.url} answered {answer[:80]!r}: score {score:.6g} is outside kwargs."
                            f"score_range {[low, high]}")
        return score

    def ask(self, text: str) -> str:
        """The judge's answer to one rendered prompt, tried again while that can help."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": text}]
        body = {"model": self.model or self._served_model(), "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        for attempt in range(self.retries + 1):
            if stop_requested():  # the run is stopping: no new request (nor another try)
                raise ServerUnavailable(f"judge {self.url}: not asked, the run is stopping", retry=False)
            try:
                answer = self._request("/chat/completions", body)
                break
            except ServerUnavailable as e:
                if not e.retry or attempt == self.retries:
                    what = self._why(e) if e.status in (401, 403) else str(e)
                    raise ServerUnavailable(f"judge {self.url}: {what} (after {attempt + 1} tries)", e.status,
                                            e.retry) from None
                time.sleep(min(0.25 * 2**attempt, 5.0))
        try:
            return read_chat_answer(answer)
        except BadAnswer as e:
            raise BadAnswer(f"judge {self.url}: {e}") from None

    def _served_model(self) -> str:
        """No kwargs.model: the one model the server lists at {url}/models (asked once)."""
        with self._lock:
            if not self.model:
                answer = self._request("/models", None)
                data = answer.get("data") if isinstance(answer, dict) else None
                ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
                if len(ids) != 1 or not isinstance(ids[0], str):
                    raise BadAnswer(f"judge {self.url}: kwargs.model is not set and {self.url}/models lists "
                                    f"{ids or 'no model'}; name the judge model in kwargs.model")
                self.model = ids[0]
        return self.model

    def _request(self, path: str, body: Optional[dict]):
        """One request over the pool (POST `body`, GET when None): its answer as JSON, within the deadline and the
        size limit."""
        import httpx

        deadline = time.monotonic() + self.timeout
        try:
            with self._client.stream("GET" if body is None else "POST", self.url + path, json=body) as response:
                if 300 <= response.status_code < 400:
                    raise ServerUnavailable(f"HTTP {response.status_code} redirect; no redirect is followed (the token "
                                            "would go with it): give the server's own address", response.status_code,
                                            retry=False)
                raw = bytearray()
                for chunk in response.iter_bytes():
                    raw += chunk
                    if len(raw) > self.max_answer_bytes:
                        raise ServerUnavailable(f"the answer passed the {self.max_answer_bytes} bytes allowed",
                                                retry=False)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("deadline")
                if response.status_code >= 400:
                    raise ServerUnavailable(f"HTTP {response.status_code}: {bytes(raw[:300]).decode(errors='replace')}",
                                            response.status_code, retry=response.status_code >= 500)
        except httpx.TimeoutException:
            raise ServerUnavailable(f"no complete answer within {self.timeout:g} s") from None
        except httpx.TransportError as e:
            raise ServerUnavailable(f"{type(e).__name__}: {e}") from None
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"no complete answer within {self.timeout:g} s")
        try:
            return json.loads(bytes(raw))
        except ValueError as e:
            raise ServerUnavailable(f"the answer is not JSON ({e}): {bytes(raw[:120])!r}", retry=False) from None


def bounded_map(fn: Callable[[Any], Any], items: list, workers: int, abandon: threading.Event) -> list:
    """[fn(item) for item in items], `workers` at a time in daemon threads that take no new item once `abandon` is
    set (the reward's caller gave up: its timeout passed) or the run is stopping: a timed-out batch stops sending
    requests after those in flight, and the process never waits for them to exit (a ThreadPoolExecutor's threads
    are joined at exit: minutes of requests nobody reads)."""
    results: list = [None] * len(items)
    errors: list = []
    pending = iter(range(len(items)))
    lock = threading.Lock()

    def work():
        while not (abandon.is_set() or stop_requested() or errors):
            with lock:
                index = next(pending, None)
            if index is None:
                return
            try:
                results[index] = fn(items[index])
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                errors.append(e)

    threads = [threading.Thread(target=work, name="posttrain-judge", daemon=True)
               for _ in range(min(workers, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if abandon.is_set() or stop_requested():
        raise ServerUnavailable("the judge's batch was abandoned (its reward timed out, or the run is stopping)",
                                retry=False)
    return results


def check_types(**values) -> None:
    """The judge's numeric kwargs are numbers of the right kind (`retries: 1.5` failed mid-run, `concurrency: '8'`
    was a traceback)."""
    for key, value in values.items():
        whole = key in ("max_tokens", "concurrency", "retries", "max_answer_bytes")
        ok = isinstance(value, int) if whole else isinstance(value, (int, float))
        if not ok or isinstance(value, bool) or (not whole and not math.isfinite(value)):
            kind = "a whole number" if whole else "a number"
            raise UserError(f"reward judge: kwargs.{key} is {value!r} ({type(value).__name__}); give {kind}")


def check_range(score_range, parse: str) -> tuple[float, float]:
    """kwargs.score_range [low, high]: the scores the template asks for. Required unless parse is yes_no (1 or 0):
    an answer is otherwise read as any number at all, so a judge that strays from its template's scale (11 on a
    0-10 scale, 45 digits) would be trained on as if that were the scale."""
    if score_range is None:
        if parse == "yes_no":
            return 0.0, 1.0
        raise UserError("reward judge: kwargs.score_range is not set; declare the scores the template asks for, as "
                        "[low, high] (score_range: [0, 10] for 'a number from 0 to 10'): an answer outside it is then "
                        "refused, never trained on (parse: yes_no needs none: its scores are 1 and 0)")
    if (not isinstance(score_range, (list, tuple)) or len(score_range) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       and not overflows_float32(v) for v in score_range) or score_range[0] > score_range[1]):
        raise UserError(f"reward judge: kwargs.score_range is {score_range!r}; give [low, high], the scores the "
                        "template asks for (e.g. [0, 10])")
    return float(score_range[0]), float(score_range[1])


def _load_template(path: str):
    """The prompt template (Jinja, sandboxed like chat templates; an unknown variable is an error, not blank), and
    the dataset columns it reads (its variables besides prompt and completion)."""
    from jinja2 import StrictUndefined, TemplateError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise UserError(f"reward judge: kwargs.prompt_template {path} is not a file; write a Jinja template using "
                        "{{ prompt }}, {{ completion }} and the dataset's columns")
    environment = ImmutableSandboxedEnvironment(undefined=StrictUndefined)
    try:
        source = file.read_text()
        columns = meta.find_undeclared_variables(environment.parse(source)) - {"prompt", "completion"}
        return environment.from_string(source), sorted(columns)
    except TemplateError as e:
        raise UserError(f"reward judge: kwargs.prompt_template {path} is not a valid Jinja template: {e}") from None
