"""A distillation teacher behind a vLLM server, for teachers too big to hold beside the student: its k most likely
tokens and their log-probs at every position of the student's sequences (vLLM's `prompt_logprobs`).

    posttrain serve --model Qwen/Qwen2.5-72B-Instruct --port 8001 -- --max-logprobs 20     # the teacher, anywhere
    posttrain distill --config recipes/distill.yaml algo.teacher_server=http://gpu9:8001 algo.teacher_top_k=20

One `/v1/completions` request per sequence (the token ids as the prompt, max_tokens 1, prompt_logprobs k), all in
flight at once; a failed request is retried (generation.request_retries, each generation.request_timeout_s seconds),
then the run stops naming the server. vLLM's prompt log-probs are raw (temperature 1): losses.distill's top-k loss
applies algo.temperature, which over a fixed support is exact. The start-up check (before any model loads): the
server answers, takes the token (POSTTRAIN_SERVER_TOKEN), names a model and tokenizes text as the student's tokenizer
does. Every answer is checked as a generation server's are (http.read_completion): one entry per token of the
sequence, ids inside the student's vocabulary, log-probs finite and <= 0; anything else stops the run naming the
server and the field, before the teacher's numbers reach the loss.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from posttrain.errors import RunStopped, UserError
from posttrain.generation.http import BadAnswer, request_all
from posttrain.generation.server import (TOKEN_ENV, TOKENIZER_PROBE, ServerUnavailable, call, call_with_retries,
                                         model_vocabulary)

KEY = "algo.teacher_server"


def parse_prompt_logprobs(prompt_logprobs: list, k: int, length: Optional[int] = None,
                          vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `choices[0].prompt_logprobs` of one sequence of T tokens (None, then {token id: {logprob, rank, ...}})
    -> (logprobs_TK, ids_TK): the k entries of rank 1..k at each position, by rank. The prompt's own token is in every
    entry too and is dropped when its rank is above k. Position 0, which nothing predicts, gets k arbitrary ids with
    equal log-probs (the loss masks it; finite values keep its gradient finite). BadAnswer (a ValueError) naming the
    position for anything a vLLM server does not send: `length` entries, ids in [0, vocab_size), finite log-probs
    <= 0, whole ranks >= 1."""
    if not isinstance(prompt_logprobs, list) or (length is not None and len(prompt_logprobs) != length):
        raise BadAnswer(f"'prompt_logprobs' must hold one entry per token ({length}), got "
                        f"{len(prompt_logprobs) if isinstance(prompt_logprobs, list) else type(prompt_logprobs).__name__}")
    logprobs_TK = torch.zeros(len(prompt_logprobs), k)
    ids_TK = torch.arange(k).repeat(len(prompt_logprobs), 1)
    for t, entry in enumerate(prompt_logprobs):
        if entry is None:
            continue
        ranked = sorted(_entry(entry, t, vocab_size))
        top = [(token, logprob) for rank, token, logprob in ranked if rank <= k][:k]
        if len(top) < k:
            raise ValueError(f"position {t}: the server returned {len(top)} log-probs of rank <= {k}; start it with "
                             f"--max-logprobs >= {k} (and a vocabulary of at least {k} tokens)")
        ids_TK[t] = torch.tensor([token for token, _ in top])
        logprobs_TK[t] = torch.tensor([logprob for _, logprob in top])
    return logprobs_TK, ids_TK


def _entry(entry, t: int, vocab_size: Optional[int]) -> list[tuple[int, int, float]]:
    """One position's {token id: {logprob, rank}} as (rank, token, logprob), checked."""
    if not isinstance(entry, dict):
        raise BadAnswer(f"position {t}: an entry must be an object of token ids, got {type(entry).__name__}")
    bound = vocab_size if vocab_size is not None else 2**31
    out = []
    for token, value in entry.items():
        try:
            token_id, rank, logprob = int(token), value["rank"], value["logprob"]
        except (ValueError, TypeError, KeyError):
            raise BadAnswer(f"position {t}: {token!r}: {str(value)[:80]} is not a token id with a rank and a "
                            "log-prob") from None
        if not 0 <= token_id < bound:
            raise BadAnswer(f"position {t}: token id {token_id} is outside the vocabulary [0, {bound})")
        if type(rank) is not int or rank < 1:
            raise BadAnswer(f"position {t}: rank {rank!r} of token {token_id}: a rank is a whole number >= 1")
        if type(logprob) not in (int, float) or not math.isfinite(logprob) or logprob > 0:
            raise BadAnswer(f"position {t}: log-prob {logprob!r} of token {token_id}: a log-prob is a finite number "
                            "<= 0")
        out.append((rank, token_id, float(logprob)))
    return out


class TeacherServer:
    def __init__(self, url: str, top_k: int, timeout: float, retries: int, token: Optional[str] = None):
        self.url, self.top_k, self.timeout, self.retries, self.token = url.rstrip("/"), top_k, timeout, retries, token
        self.model: Optional[str] = None
        self.vocab_size: Optional[int] = None  # the student's: bounds the ids the teacher may return

    def check(self, tokenizer, student: str) -> None:
        """UserError unless the server answers, takes the token and tokenizes like the student's tokenizer."""
        where, timeout = f"{KEY} = {self.url}", min(self.timeout, 30.0)
        try:
            models = call(self.url, "/v1/models", timeout=timeout, token=self.token)
            tokens = call(self.url, "/tokenize", {"prompt": TOKENIZER_PROBE, "add_special_tokens": False},
                          timeout=timeout, token=self.token)
        except ServerUnavailable as e:
            refused = e.status == 401
            raise UserError(f"{where}: " + (f"refused the token in {TOKEN_ENV}" if refused else f"no answer ({e})")
                            + "; start the teacher with `posttrain serve --model ...` and give its URL and token")
        try:
            self.model, tokens = str(models["data"][0]["id"]), tokens["tokens"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{where}: its /v1/models or /tokenize answer names no model or tokens ({str(models)[:80]});"
                            " is it a vLLM server? start the teacher with `posttrain serve --model ...`") from None
        self.vocab_size = model_vocabulary(tokenizer)
        if tokens != tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
            raise UserError(f"{where} (serving {self.model}) tokenizes text differently from the student "
                            f"(model.name_or_path={student}): distillation needs one tokenizer on both sides")

    def topk(self, rows: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The teacher's top-k (logprobs_TK, ids_TK) for each row of token ids, all requests in flight at once."""
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(rows), 64)), thread_name_prefix="posttrain-teacher")
        try:  # a failure ends the batch at once: no request of it goes out after (http.request_all)
            answers = request_all(pool, self._one, rows)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [a[0] for a in answers], [a[1] for a in answers]

    def _one(self, ids: list[int], abandon: Optional[threading.Event] = None) -> tuple[torch.Tensor, torch.Tensor]:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": self.top_k}
        answer = call_with_retries(
            self.url, "/v1/completions", body, timeout=self.timeout, token=self.token, retries=self.retries,
            abandon=abandon,
            failed=lambda e, tries: f"the teacher server {self.url} failed: {e} ({tries} tries, "
                                    f"generation.request_timeout_s={self.timeout:g} each); checkpoints already saved "
                                    "are complete: continue with train.resume_from_checkpoint=auto")
        try:
            choice = answer["choices"][0] if isinstance(answer, dict) and isinstance(answer.get("choices"), list) \
                and answer["choices"] and isinstance(answer["choices"][0], dict) else None
            if choice is None:
                raise BadAnswer(f"'choices' must be a list of one object, got {str(answer)[:80]}")
            return parse_prompt_logprobs(choice.get("prompt_logprobs"), self.top_k, len(ids), self.vocab_size)
        except ValueError as e:  # BadAnswer, or too few log-probs for top_k
            raise RunStopped(f"the teacher server {self.url} sent a wrong answer to /v1/completions: {e}. Is it a vLLM "
                             "server serving the student's vocabulary? checkpoints already saved are complete: "
                             "continue with train.resume_from_checkpoint=auto", shared=False) from None
