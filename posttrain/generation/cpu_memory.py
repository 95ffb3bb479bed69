"""How much memory a vLLM server on a CPU reserves: a KV cache sized from the model and the batch.

    cpu_kv_cache_bytes(model_config, max_model_len=1024, sequences=16, dtype_bytes=4)   # -> bytes, a whole MiB

On a CPU vLLM reads `--gpu-memory-utilization` as a share of the machine's RAM (0.92 by default), refuses to start
when that much is not free, and fills what its weights leave with KV cache. A server beside its trainer (CI, a
laptop, the node engine) then fails to start, or starves the trainer. Given an explicit KV cache size
(`--kv-cache-memory-bytes`, or VLLM_CPU_KVCACHE_SPACE) vLLM skips that reservation and takes the weights + the KV
cache, so `posttrain serve` passes one: room for `sequences` sequences of max_model_len tokens, no more than a
quarter of the machine's memory, never less than one full sequence (vLLM needs that much to start).
"""

from __future__ import annotations

from typing import Optional

MIB = 2**20
DEFAULT_SEQUENCES = 16  # full-length sequences the cache holds at once; shorter ones share it (paged blocks)
MAX_SHARE = 0.25  # of the machine's memory
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model_config, dtype_bytes: int) -> int:
    """Bytes of keys and values one token takes over all layers (2 x layers x kv heads x head dim x dtype)."""
    text = getattr(model_config, "text_config", None) or model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_kv_cache_bytes(model_config, max_model_len: int, sequences: int, dtype_bytes: int,
                       total_memory: Optional[int] = None) -> int:
    """KV cache for `sequences` sequences of `max_model_len` tokens, capped at MAX_SHARE of `total_memory` (when
    given) but never below one full sequence; rounded up to a whole MiB."""
    per_sequence = kv_bytes_per_token(model_config, dtype_bytes) * max_model_len
    wanted = per_sequence * max(1, sequences)
    if total_memory is not None:
        wanted = min(wanted, int(total_memory * MAX_SHARE))
    wanted = max(wanted, per_sequence)
    return -(-wanted // MIB) * MIB


def option_value(args: list[str], name: str) -> Optional[str]:
    """The value of `name` in a vLLM command line (`--name V` or `--name=V`); None when absent."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def serve_kv_cache_option(model: str, vllm_args: list[str], environ: dict, kv_cache_gb: Optional[float],
                          trust_remote_code: bool = False) -> list[str]:
    """The `--kv-cache-memory-bytes N` that `posttrain serve` adds on a CPU, or [] when the user sized the cache
    (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE). A --gpu-memory-utilization (what engines a run starts pass,
    for GPUs) does not turn it off: with an explicit cache vLLM reserves no share of the machine's RAM."""
    if kv_cache_gb is not None:
        return ["--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30))]
    given = {a.split("=", 1)[0] for a in vllm_args}
    if "--kv-cache-memory-bytes" in given or environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return []
    import psutil
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text = getattr(config, "text_config", None) or config
    max_len = option_value(vllm_args, "--max-model-len")
    max_len = int(max_len) if max_len and max_len.isdigit() else int(getattr(text, "max_position_embeddings", 2048))
    sequences = option_value(vllm_args, "--max-num-seqs")
    sequences = int(sequences) if sequences and sequences.isdigit() else DEFAULT_SEQUENCES
    dtype_bytes = DTYPE_BYTES.get(option_value(vllm_args, "--dtype") or "float32", 4)
    size = cpu_kv_cache_bytes(config, max_len, sequences, dtype_bytes, psutil.virtual_memory().total)
    return ["--kv-cache-memory-bytes", str(size)]
