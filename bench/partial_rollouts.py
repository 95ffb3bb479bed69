"""What sampling in chunks costs (generation.partial_rollouts): the same completions' generation whole and in chunks of
`--chunks` tokens on the in-process vLLM engine, each chunk a new request from prompt + tokens so far
(online/partial.py's rounds, all under one version), with vLLM's prefix cache off or on.

    .venv/bin/python bench/partial_rollouts.py --model ~/.cache/posttrain/smollm2-135m-instruct --length 256 \
        --chunks 64,128
    .venv/bin/python bench/partial_rollouts.py --model tiny/ --prefix-caching

One engine per process (vLLM's in-process engine is not torn down within one): run it once per --prefix-caching
setting. Prints one line per way of sampling: the prompt tokens the engine prefilled (what chunking adds: each chunk's
request carries prompt + tokens so far) and how many of them its prefix cache served, then the median seconds of
--repeats runs and new tokens per second (wall clock: on a shared machine, read the token counts first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from posttrain.config.schema import GenerationConfig, VLLMConfig
from posttrain.generation.vllm_engine import VLLMEngine
from posttrain.online.engine_link import EngineLink
from posttrain.online.partial import Partial

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "prompts_train.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="max_completion_length")
    parser.add_argument("--chunks", default="16,32", help="partial_chunk_tokens values, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    chats = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: args.prompts]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) if tokenizer.chat_template
             else c[-1]["content"] for c in chats]
    prompts = [{"prompt_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in texts]
    engine = VLLMEngine(args.model, tokenizer, VLLMConfig(kv_cache_gb=2, enable_prefix_caching=args.prefix_caching),
                        seed=0, max_model_len=max(len(p["prompt_ids"]) for p in prompts) + args.length + 8)
    # ignore stop ids: every completion runs the whole length, so the ways compare the same amount of work
    engine.stop_ids = ()
    gen = GenerationConfig(engine="vllm", max_completion_length=args.length, max_staleness=1, partial_rollouts=True)
    prefilled = [0]
    generate = engine.generate

    def counted(prompt_ids, params):
        prefilled[0] += sum(len(ids) for ids in prompt_ids)
        return generate(prompt_ids, params)

    engine.generate = counted
    link = EngineLink.over(engine, None, gen, seed=0)
    link.synced_at = 0
    positions = list(range(args.prompts))

    def whole():
        batch = Partial.start(0, positions, 0, prompts, args.group)
        batch.round(link, args.length)
        return batch

    def chunked(tokens):
        def run():
            batch = Partial.start(0, positions, 0, prompts, args.group)
            while not batch.finished:
                batch.round(link, tokens)
            return batch
        return run

    ways = {"whole": whole, **{f"chunks of {c}": chunked(int(c)) for c in args.chunks.split(",")}}
    whole()  # warm-up
    engine.prefix_cache_hits()
    print(f"{args.model}: {args.prompts} prompts x {args.group}, {args.length} tokens each, prefix caching "
          f"{'on' if args.prefix_caching else 'off'}")
    base = None
    for name, way in ways.items():
        seconds, prefilled[0] = [], 0
        for _ in range(args.repeats):
            started = time.perf_counter()
            batch = way()
            seconds.append(time.perf_counter() - started)
        tokens = sum(len(c) for c in batch.rows.completion_ids)
        median = statistics.median(seconds)
        base = base or median
        hits = engine.prefix_cache_hits()
        cached = f", {hits[0] / args.repeats:.0f} served by the prefix cache" if hits else ""
        print(f"  {name:16} prompt tokens {prefilled[0] / args.repeats:7.0f}{cached}; {median:7.2f} s "
              f"{tokens / median:6.0f} new tokens/s {median / base - 1:+6.1%} (runs: "
              f"{', '.join(f'{s:.2f}' for s in seconds)})", flush=True)
    engine.end()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
