"""Generation speed: the vLLM engine against the HF engine, same model, same prompts, same sampling, tokens/s.
Also what one in-process weight sync costs (the whole model through `VLLMEngine.load_weights`).

    .venv/bin/python bench/generation.py                        # 64 prompts x 128 new tokens, ~24M-parameter Llama
    .venv/bin/python bench/generation.py --prompts 16 --new-tokens 32

Needs vLLM (`make setup EXTRAS=dev,vllm`). fp32 on a CPU (vLLM's bf16 is 3-5x slower there on AVX2). The vLLM
start-up (model load, KV cache) is reported apart and not in tokens/s; each engine gets one warm-up call first.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)  # head_dim 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.config.schema import VLLMConfig
    from posttrain.models.tiny import make_tiny_model
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.hf import HFEngine
    from posttrain.generation.vllm_engine import VLLMEngine

    model_dir = make_tiny_model(tempfile.mkdtemp(prefix="bench-gen-"), seed=0, **MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, tokenizer.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 48, (args.prompts,), generator=g)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    started = time.perf_counter()
    vllm = VLLMEngine(model_dir, tokenizer, VLLMConfig(kv_cache_gb=args.kv_cache_gb), seed=0)
    startup = time.perf_counter() - started
    hf = HFEngine(hf_model, tokenizer)  # tokens/s counts the tokens each engine made (eos may end a few early)
    results = {"prompts": args.prompts, "new_tokens": args.new_tokens, "vllm_startup_s": round(startup, 1)}
    for name, engine in (("hf", hf), ("vllm", vllm)):
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
        started = time.perf_counter()
        out = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        results[f"{name}_tokens_per_s"] = round(sum(map(len, out.completion_ids)) / seconds, 1)
    results["speedup"] = round(results["vllm_tokens_per_s"] / results["hf_tokens_per_s"], 2)
    named = list(hf_model.named_parameters())
    started = time.perf_counter()
    vllm.load_weights([named])
    results["vllm_sync_s"] = round(time.perf_counter() - started, 3)
    results["sync_mb"] = round(sum(p.numel() * p.element_size() for _, p in named) / 2**20, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
