"""The ways to compute a prompt once for its G completions, measured on one GRPO micro-batch (forward + backward of
the completion tokens' log-probs, random weights, fp32):

    .venv/bin/python bench/shared_prefix.py --size smollm2 --prompt 512 --completion 128 --gens 8
    .venv/bin/python bench/shared_prefix.py --size tiny --prompt 256 --completion 64 --gens 8 --repeats 3

- plain: the G rows [prompt | completion], padded (what every row computed alone costs; train.shared_prefix=false);
- mask: posttrain's layout (ops/shared_prefix.py): one packed row [prompt | c1 | ... | cG] under a 4-D SDPA mask;
- kv: the prompt's forward once with a cache, its keys and values expanded to the G rows, the completions' forward
  on top (the backward sums the G rows' gradients into the prompt's activations): the other way peers take.

Each variant runs in a fresh process (its own peak RSS), `--repeats` times; the best wall and CPU seconds (the
latter moves little with a shared machine's load) are printed with the tokens it forwarded and its peak memory.
Completion lengths vary around --completion (0.5x to 1.5x), as sampled ones do.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SIZES = {  # Llama shapes
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=768),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
}


def batch(args):
    import torch

    from posttrain.data.collate import collate_padded

    g = torch.Generator().manual_seed(0)
    vocab = SIZES[args.size]["vocab_size"]
    prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
    lengths = torch.randint(args.completion // 2, args.completion * 3 // 2 + 1, (args.gens,), generator=g).tolist()
    rows = [{"input_ids": prompt + torch.randint(3, vocab, (n,), generator=g).tolist(),
             "completion_mask": [0] * args.prompt + [1] * n} for n in lengths]
    return collate_padded(rows, 0), lengths


def step_plain_or_mask(model, plain, shared: bool):
    from posttrain.batch import share_prefixes
    from posttrain.models.forward import policy_logprobs_entropy

    b = share_prefixes(plain) if shared else plain
    logprobs_BT, _ = policy_logprobs_entropy(model, b)
    (logprobs_BT * plain.completion_mask_BT).sum().backward()
    return b.forwarded_tokens()


def step_kv(model, plain, lengths, prompt_length: int):
    """The prompt once with a cache; keys / values expanded to G rows; the completions on top."""
    import torch

    from posttrain.ops.logprobs import linear_next_token_logprobs

    ids = plain.input_ids_BT
    g, width = ids.shape[0], max(lengths)
    out = model.model(input_ids=ids[:1, :prompt_length], use_cache=True)
    cache = out.past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.expand(g, -1, -1, -1), layer.values.expand(g, -1, -1, -1)
    completions = ids[:, prompt_length:prompt_length + width]
    mask = torch.cat([torch.ones(g, prompt_length, dtype=torch.long), plain.attention_mask_BT[:, prompt_length:
                                                                                             prompt_length + width]], 1)
    positions = torch.arange(prompt_length, prompt_length + width).expand(g, -1)
    hidden = model.model(input_ids=completions, past_key_values=cache, attention_mask=mask, position_ids=positions,
                         use_cache=True).last_hidden_state
    # the prompt's last position predicts each completion's first token; then each completion predicts its own
    hidden_GCH = torch.cat([out.last_hidden_state[:, -1:].expand(g, -1, -1), hidden[:, :-1]], 1)
    keep = plain.completion_mask_BT[:, prompt_length:prompt_length + width]
    logprobs = linear_next_token_logprobs(hidden_GCH, model.lm_head.weight, completions)
    (logprobs * keep).sum().backward()
    return prompt_length + sum(lengths)


def one(args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[args.size], attn_implementation="sdpa")).float()
    plain, lengths = batch(args)
    times, cpu = [], []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        started, cpu_started = time.perf_counter(), time.process_time()
        if args.variant == "kv":
            tokens = step_kv(model, plain, lengths, args.prompt)
        else:
            tokens = step_plain_or_mask(model, plain, shared=args.variant == "mask")
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    if args.variant == "plain":
        tokens = plain.input_ids_BT.numel()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"variant": args.variant, "seconds": min(times), "cpu_seconds": min(cpu), "tokens": tokens,
                      "peak_mb": peak_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variant", choices=("plain", "mask", "kv"))
    args = parser.parse_args()
    if args.variant:
        return one(args)
    print(f"{args.size}: prompt {args.prompt}, G={args.gens}, completions ~{args.completion} (0.5x-1.5x); "
          "forward + backward of the completion log-probs, best of", args.repeats)
    print(f"{'variant':8} {'s':>8} {'CPU s':>8} {'tokens':>8} {'peak MB':>9} {'CPU speed-up':>13}")
    base = None
    for variant in ("plain", "mask", "kv"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant], capture_output=True,
                             text=True)
        if out.returncode:
            print(f"{variant:8} failed (exit {out.returncode}): {(out.stderr.strip() or '?').splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r["cpu_seconds"]
        print(f"{variant:8} {r['seconds']:8.3f} {r['cpu_seconds']:8.3f} {r['tokens']:8d} {r['peak_mb']:9.0f} "
              f"{base / r['cpu_seconds']:12.2f}x")


if __name__ == "__main__":
    main()
