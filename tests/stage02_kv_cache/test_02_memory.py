"""§1 KV-cache memory math, against hand-computed integers and real allocated buffers."""

import numpy as np
import pytest

from labkit.model import Config
from labkit.specs import LLAMA3_8B, LLAMA3_70B

MEMORY = "stage02_kv_cache.memory"
H100_BYTES = 80 * 10**9


def test_kv_cache_bytes_llama3_8b_worked_example(impl):
    mem = impl(MEMORY)
    assert mem.kv_cache_bytes(32, 8, 128, seq_len=1, batch=1, dtype_bytes=2) == 131_072, "128 KiB per token in bf16"
    assert mem.kv_cache_bytes(32, 8, 128, seq_len=8192, batch=1, dtype_bytes=2) == 1_073_741_824, "≈1.07 GB at 8k"
    assert mem.kv_cache_bytes(32, 8, 128, seq_len=8192, batch=32, dtype_bytes=2) == 34_359_738_368, "≈34 GB at 8k×32"


def test_kv_cache_bytes_70b_bf16_and_fp8(impl):
    mem = impl(MEMORY)
    bf16 = mem.kv_cache_bytes(80, 8, 128, seq_len=8192, batch=32, dtype_bytes=2)
    fp8 = mem.kv_cache_bytes(80, 8, 128, seq_len=8192, batch=32, dtype_bytes=1)
    assert bf16 == 85_899_345_920, f"70B-class at 8k × 32 in bf16 should be 85,899,345,920 B (≈86 GB), got {bf16}"
    assert fp8 == bf16 // 2, f"FP8 halves the cache: expected {bf16 // 2}, got {fp8}"
    int4 = mem.kv_cache_bytes(80, 8, 128, seq_len=8192, batch=32, dtype_bytes=0.5)
    assert int4 == bf16 // 4 and isinstance(int4, int), (
        f"INT4 (0.5 B/elem) should give the int {bf16 // 4}, got {int4!r}"
    )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kv_cache_bytes_random_shapes(impl, seed):
    rng = np.random.default_rng(seed)
    L, H, D, S, B = (int(x) for x in rng.integers(1, [100, 64, 256, 100_000, 64]))
    dtype_bytes = int(rng.choice([1, 2, 4]))
    expected = 2 * L * H * D * S * B * dtype_bytes
    got = impl(MEMORY).kv_cache_bytes(L, H, D, S, B, dtype_bytes)
    assert got == expected, f"seed={seed}: layers={L} kv_heads={H} head_dim={D} seq={S} batch={B} bytes={dtype_bytes}"


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_cache_bytes_equals_what_a_real_cache_allocates(impl, seed):
    rng = np.random.default_rng(seed)
    n_kv = int(rng.integers(1, 4))
    config = Config(num_hidden_layers=int(rng.integers(1, 5)), num_key_value_heads=n_kv, num_attention_heads=2 * n_kv)
    batch, max_seq_len = int(rng.integers(1, 4)), int(rng.integers(5, 50))
    cache = impl("stage02_kv_cache.kv_cache").KVCache(config, batch, max_seq_len)
    allocated = sum(layer.k.nbytes + layer.v.nbytes for layer in cache.layers)
    got = impl(MEMORY).kv_cache_bytes(
        config.num_hidden_layers, n_kv, config.head_dim, max_seq_len, batch, cache.layers[0].k.element_size()
    )
    assert got == allocated, f"seed={seed}: formula says {got} B, the float32 buffers hold {allocated} B"


def test_kv_bytes_per_token_reads_the_config_and_gqa_saves_heads_over_kv_heads(impl):
    mem = impl(MEMORY)
    assert mem.kv_bytes_per_token(LLAMA3_8B) == 131_072
    mha = Config(**{**LLAMA3_8B.__dict__, "num_key_value_heads": 32})
    mqa = Config(**{**LLAMA3_8B.__dict__, "num_key_value_heads": 1})
    assert mem.kv_bytes_per_token(mha) == 4 * mem.kv_bytes_per_token(LLAMA3_8B), "GQA 32→8 heads saves 4×"
    assert mem.kv_bytes_per_token(mqa) == 16 * 1024, "MQA keeps one KV head: 16 KiB per token"
    assert mem.kv_bytes_per_token(LLAMA3_8B, dtype_bytes=1) == 65_536, "FP8 halves it"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_bytes_per_token_random_configs(impl, seed):
    rng = np.random.default_rng(seed)
    n_kv = int(rng.integers(1, 9))
    config = Config(
        num_hidden_layers=int(rng.integers(1, 81)),
        num_key_value_heads=n_kv,
        num_attention_heads=n_kv * int(rng.integers(1, 9)),
        head_dim=int(rng.choice([64, 80, 96, 128])),
    )
    expected = 2 * config.num_hidden_layers * n_kv * config.head_dim * 2
    got = impl(MEMORY).kv_bytes_per_token(config)
    assert got == expected, f"seed={seed}: {config}"


def test_max_concurrent_requests_on_an_80gb_h100(impl):
    mem = impl(MEMORY)
    weights_8b = 16_060_000_000  # 8.03 B parameters in bf16
    # (80e9 - 16.06e9) // (131072 * 8192) = 59 requests of 8k tokens; 4× fewer without GQA.
    assert mem.max_concurrent_requests(H100_BYTES, weights_8b, LLAMA3_8B, seq_len=8192) == 59
    mha = Config(**{**LLAMA3_8B.__dict__, "num_key_value_heads": 32})
    assert mem.max_concurrent_requests(H100_BYTES, weights_8b, mha, seq_len=8192) == 14
    assert mem.max_concurrent_requests(H100_BYTES, weights_8b, LLAMA3_8B, seq_len=8192, dtype_bytes=1) == 119
    # 70B in bf16 (140 GB) does not fit on one H100 at all: no request fits.
    assert mem.max_concurrent_requests(H100_BYTES, 140 * 10**9, LLAMA3_70B, seq_len=8192) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_max_concurrent_requests_random(impl, seed):
    rng = np.random.default_rng(seed)
    config = Config(num_hidden_layers=int(rng.integers(8, 81)), num_key_value_heads=int(rng.integers(1, 9)))
    gpu, weights = int(rng.integers(16, 200)) * 10**9, int(rng.integers(1, 16)) * 10**9
    seq = int(rng.integers(512, 32_768))
    per_request = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * seq * 2
    got = impl(MEMORY).max_concurrent_requests(gpu, weights, config, seq)
    assert got == (gpu - weights) // per_request, f"seed={seed}: gpu={gpu} weights={weights} seq={seq}"


def test_decode_arithmetic_intensity_worked_examples(impl):
    mem = impl(MEMORY)
    n = 8_000_000_000
    assert mem.decode_arithmetic_intensity(n, 1) == pytest.approx(1.0), "batch 1, bf16: 2 FLOPs per 2 bytes"
    assert mem.decode_arithmetic_intensity(n, 1, weight_bytes_per_param=1) == pytest.approx(2.0)
    assert mem.decode_arithmetic_intensity(n, 128, weight_bytes_per_param=1) == pytest.approx(256.0)
    # Each request's own cache is read too: at 8k tokens of Llama-3-8B the intensity saturates.
    kv = 131_072 * 8192
    big = mem.decode_arithmetic_intensity(n, 10_000, kv_bytes_per_request=kv)
    assert big == pytest.approx(2 * n * 10_000 / (2 * n + 10_000 * kv))
    assert big < 2 * n / kv, "with a KV cache per request, intensity can never exceed 2·n_params / kv_bytes"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_arithmetic_intensity_random(impl, seed):
    rng = np.random.default_rng(seed)
    n, batch, kv = int(rng.integers(10**8, 10**11)), int(rng.integers(1, 512)), int(rng.integers(0, 10**10))
    w = float(rng.choice([0.5, 1, 2, 4]))
    expected = 2 * n * batch / (n * w + batch * kv)
    got = impl(MEMORY).decode_arithmetic_intensity(n, batch, kv, w)
    assert got == pytest.approx(expected, rel=1e-12), f"seed={seed}: n={n} batch={batch} kv={kv} w={w}"
