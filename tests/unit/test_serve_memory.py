"""`posttrain serve` on a CPU sizes vLLM's KV cache from the model and the batch instead of reserving 0.92 of RAM."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from posttrain.generation.cpu_memory import cpu_kv_cache_bytes, kv_bytes_per_token, serve_kv_cache_option

MIB = 2**20
# 2 layers, 4 query heads sharing 2 kv heads of 64 / 4 = 16: 2 (k and v) x 2 x 2 x 16 = 128 numbers a token
CONFIG = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                     intermediate_size=128, vocab_size=100, max_position_embeddings=4096)


def test_kv_cache_is_layers_x_kv_heads_x_head_dim_x_tokens():
    assert kv_bytes_per_token(CONFIG, 4) == 512 and kv_bytes_per_token(CONFIG, 2) == 256
    assert cpu_kv_cache_bytes(CONFIG, 1024, 16, 4) == 16 * 1024 * 512  # 8 MiB: 16 sequences of 1024 tokens
    assert cpu_kv_cache_bytes(CONFIG, 1024, 16, 4, total_memory=16 * MIB) == 4 * MIB  # a quarter of the machine
    assert cpu_kv_cache_bytes(CONFIG, 1000, 1, 4) == MIB  # 500,000 bytes: rounded up to a whole MiB
    assert cpu_kv_cache_bytes(CONFIG, 4096, 16, 4, total_memory=MIB) == 2 * MIB  # never below one full sequence


def test_serve_passes_an_explicit_kv_cache_unless_the_user_sized_it(tmp_path):
    CONFIG.save_pretrained(tmp_path)
    model = str(tmp_path)
    size = int(serve_kv_cache_option(model, ["--max-model-len", "1024"], {}, None)[1])
    assert size == 8 * MIB  # 16 sequences x 1024 tokens x 512 bytes (fp32, serve's CPU default)
    assert serve_kv_cache_option(model, ["--max-model-len=1024", "--dtype", "bfloat16", "--max-num-seqs", "4"],
                                 {}, None) == ["--kv-cache-memory-bytes", str(MIB)]
    assert int(serve_kv_cache_option(model, [], {}, None)[1]) == 32 * MIB  # max_position_embeddings: 4096
    assert serve_kv_cache_option(model, [], {}, 1.5) == ["--kv-cache-memory-bytes", str(3 * 2**29)]
    for args, env in ((["--kv-cache-memory-bytes=9"], {}), ([], {"VLLM_CPU_KVCACHE_SPACE": "2"})):
        assert serve_kv_cache_option(model, args, env, None) == [], (args, env)
    # what engines a run starts pass for GPUs: on a CPU the explicit cache still replaces vLLM's share of the RAM
    assert serve_kv_cache_option(model, ["--gpu-memory-utilization", "0.3", "--max-model-len", "1024"], {},
                                 None) == ["--kv-cache-memory-bytes", str(8 * MIB)]


def test_serve_command_carries_the_kv_cache_size_on_a_cpu_only():
    from tests.unit.test_rollout_server import serve_args
    from posttrain.generation.serve import vllm_command

    memory = ["--kv-cache-memory-bytes", str(8 * MIB)]
    cpu = vllm_command(serve_args("--max-model-len", "512"), on_gpu=False, memory=memory)
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(8 * MIB)
    assert "--kv-cache-memory-bytes" not in vllm_command(serve_args(), on_gpu=True, memory=memory)


def test_a_kv_cache_size_must_be_positive(tmp_path):
    from posttrain.errors import UserError
    from posttrain.generation.serve import check_serve_args
    from tests.unit.test_rollout_server import serve_args

    if __import__("importlib").util.find_spec("vllm") is None:
        pytest.skip("without vLLM the first check is that vLLM is missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="--kv-cache-gb must be > 0, got 0"):
        check_serve_args(serve_args(model=str(tmp_path), kv_cache_gb=0))
