"""The judge reward against a real vLLM server on CPU serving the tiny model (the session's `posttrain serve`): every
request answered through the token-guarded server, concurrently; prints the requests per second measured."""

from __future__ import annotations

import math
import time

from posttrain.config.schema import RewardConfig
from posttrain.rewards.load import load_reward


def test_the_tiny_model_judges_a_batch_over_the_session_server(vllm_server, tmp_path):
    template = tmp_path / "judge.jinja"
    template.write_text("Question: {{ prompt }}\\nAnswer: {{ completion }}\\nReference: {{ answer }}\\nScore 0-10:")
    n = 32
    for concurrency in (1, 8):
        reward = load_reward(RewardConfig(name="judge", kwargs={
            "url": f"{vllm_server.url}/v1", "prompt_template": str(template), "parse": "number", "max_tokens": 8,
            "concurrency": concurrency, "request_timeout_s": 120, "token_env": "POSTTRAIN_SERVER_TOKEN",
            "score_range": [-1e30, 1e30]}))  # the random tiny model writes any number: this measures throughput
        started = time.perf_counter()
        scores = reward.fn(prompts=[f"What is {i} + 1?" for i in range(n)],
                           completions=[str(i + 1) for i in range(n)], completion_ids=None,
                           answer=[str(i + 1) for i in range(n)])
        seconds = time.perf_counter() - started
        print(f"\njudge: {n} requests in {seconds:.2f} s = {n / seconds:.1f} requests/s (tiny model, CPU vLLM, "
              f"concurrency {concurrency}, 8 tokens each)")
        assert len(scores) == n and all(s is None or math.isfinite(s) for s in scores)
        assert reward.fn.model == str(vllm_server.model_dir)  # asked the server which model it serves
