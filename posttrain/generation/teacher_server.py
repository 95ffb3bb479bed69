"""A distillation teacher behind a vLLM server, for teachers too big to hold beside the student: its k most likely
tokens and their log-probs at every position of the student's sequences (vLLM's `prompt_logprobs`).

    posttrain serve --model Qwen/Qwen2.5-72B-Instruct --port 8001 -- --max-logprobs 20     # the teacher, anywhere
    posttrain distill --config recipes/distill.yaml algo.teacher_server=http://gpu9:8001 algo.teacher_top_k=20

One `/v1/completions` request per sequence (the token ids as the prompt, max_tokens 1, prompt_logprobs k), all in
flight at once; a failed request is retried (generation.request_retries, each generation.request_timeout_s seconds),
then the run stops naming the server. vLLM's prompt log-probs are raw (temperature 1): losses.distill's top-k loss
applies algo.temperature, which over a fixed support is exact. The start-up check (before any model loads): the
server answers, takes the token (POSTTRAIN_SERVER_TOKEN) and tokenizes text as the student's tokenizer does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from posttrain.errors import UserError
from posttrain.generation.server import TOKEN_ENV, TOKENIZER_PROBE, ServerUnavailable, call, call_with_retries

KEY = "algo.teacher_server"


def parse_prompt_logprobs(prompt_logprobs: list, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `choices[0].prompt_logprobs` of one sequence of T tokens (None, then {token id: {logprob, rank, ...}})
    -> (logprobs_TK, ids_TK): the k entries of rank 1..k at each position, by rank. The prompt's own token is in every
    entry too and is dropped when its rank is above k. Position 0, which nothing predicts, gets k arbitrary ids with
    equal log-probs (the loss masks it; finite values keep its gradient finite)."""
    logprobs_TK = torch.zeros(len(prompt_logprobs), k)
    ids_TK = torch.arange(k).repeat(len(prompt_logprobs), 1)
    for t, entry in enumerate(prompt_logprobs):
        if entry is None:
            continue
        ranked = sorted(((int(v["rank"]), int(token), float(v["logprob"])) for token, v in entry.items()))
        top = [(token, logprob) for rank, token, logprob in ranked if rank <= k][:k]
        if len(top) < k:
            raise ValueError(f"position {t}: the server returned {len(top)} log-probs of rank <= {k}; start it with "
                             f"--max-logprobs >= {k} (and a vocabulary of at least {k} tokens)")
        ids_TK[t] = torch.tensor([token for token, _ in top])
        logprobs_TK[t] = torch.tensor([logprob for _, logprob in top])
    return logprobs_TK, ids_TK


class TeacherServer:
    def __init__(self, url: str, top_k: int, timeout: float, retries: int, token: Optional[str] = None):
        self.url, self.top_k, self.timeout, self.retries, self.token = url.rstrip("/"), top_k, timeout, retries, token
        self.model: Optional[str] = None

    def check(self, tokenizer, student: str) -> None:
        """UserError unless the server answers, takes the token and tokenizes like the student's tokenizer."""
        where, timeout = f"{KEY} = {self.url}", min(self.timeout, 30.0)
        try:
            self.model = call(self.url, "/v1/models", timeout=timeout, token=self.token)["data"][0]["id"]
            tokens = call(self.url, "/tokenize", {"prompt": TOKENIZER_PROBE, "add_special_tokens": False},
                          timeout=timeout, token=self.token)["tokens"]
        except ServerUnavailable as e:
            refused = e.status == 401
            raise UserError(f"{where}: " + (f"refused the token in {TOKEN_ENV}" if refused else f"no answer ({e})")
                            + "; start the teacher with `posttrain serve --model ...` and give its URL and token")
        if tokens != tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
            raise UserError(f"{where} (serving {self.model}) tokenizes text differently from the student "
                            f"(model.name_or_path={student}): distillation needs one tokenizer on both sides")

    def topk(self, rows: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The teacher's top-k (logprobs_TK, ids_TK) for each row of token ids, all requests in flight at once."""
        with ThreadPoolExecutor(max_workers=max(1, min(len(rows), 64))) as pool:
            answers = list(pool.map(self._one, rows))
        return [a[0] for a in answers], [a[1] for a in answers]

    def _one(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": self.top_k}
        answer = call_with_retries(
            self.url, "/v1/completions", body, timeout=self.timeout, token=self.token, retries=self.retries,
            failed=lambda e, tries: f"the teacher server {self.url} failed: {e} ({tries} tries, "
                                    f"generation.request_timeout_s={self.timeout:g} each); checkpoints already saved "
                                    "are complete: continue with train.resume_from_checkpoint=auto")
        return parse_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], self.top_k)
