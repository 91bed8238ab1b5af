"""§8 (extension) INT8 KV cache: per-token per-head scales, its memory saving, its logits error."""

import pytest
import torch

from labkit.testing import LLAMA_CONFIGS, labkit_from_hf, random_llama, random_tokens

INT8 = "stage02_kv_cache.int8_cache"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_int8_uses_one_absmax_scale_per_vector(impl, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 16, generator=g) * torch.rand(2, 3, 5, 1, generator=g) * 10
    q, scale = impl(INT8).quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape, f"seed={seed}: codes are int8 of x's shape"
    assert scale.shape == (2, 3, 5, 1), f"seed={seed}: one scale per (batch, head, token)"
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, msg=f"seed={seed}: scale = max|x| / 127")
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127, f"seed={seed}: the largest |x| maps to ±127"
    err = (impl(INT8).dequantize_int8(q, scale) - x).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all(), f"seed={seed}: round-to-nearest error is at most scale / 2"


def test_quantize_int8_zero_vector_stays_zero(impl):
    q, scale = impl(INT8).quantize_int8(torch.zeros(1, 1, 2, 8))
    assert torch.equal(q, torch.zeros_like(q)) and (scale > 0).all(), "zeros quantize to 0 with a positive scale"


@pytest.mark.parametrize("seed", [0, 1])
def test_int8_layer_cache_stores_codes_and_returns_dequantized_prefix(impl, seed):
    g = torch.Generator().manual_seed(seed)
    cache = impl(INT8).Int8LayerCache(1, 2, 12, 8)
    ks = [torch.randn(1, 2, t, 8, generator=g) for t in (5, 1, 1)]
    for k in ks:
        keys, values = cache.append(k, 2 * k)
    assert cache.k.dtype == torch.int8 and cache.v.dtype == torch.int8, "the buffers hold int8 codes"
    full = torch.cat(ks, dim=2)
    scale = full.abs().amax(-1, keepdim=True) / 127
    assert keys.dtype == torch.float32 and keys.shape == full.shape, f"seed={seed}: float prefix of every key so far"
    assert ((keys - full).abs() <= scale / 2 + 1e-6).all(), f"seed={seed}: keys within half a step of the originals"
    assert ((values - 2 * full).abs() <= scale + 1e-6).all(), f"seed={seed}: values within half a step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_cache_hands_back_the_dtype_it_was_built_for(impl, dtype):
    mod = impl(INT8)
    x = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(4))
    q, scale = mod.quantize_int8(x)
    assert mod.dequantize_int8(q, scale, dtype).dtype == dtype, f"dequantize_int8(..., {dtype}) returns {dtype}"
    cache = mod.Int8LayerCache(1, 2, 6, 8, dtype=dtype)
    keys, values = cache.append(x.to(dtype), x.to(dtype))
    assert keys.dtype == dtype and values.dtype == dtype, f"a {dtype} cache feeds {dtype} attention"
    torch.testing.assert_close(keys.float(), x, atol=float(scale.max()), rtol=0.01, msg=f"dtype={dtype} seed=4")


def test_int8_append_past_max_seq_raises_and_keeps_the_cache(impl):
    cache = impl(INT8).Int8LayerCache(1, 2, 5, 8)
    k = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(5))
    cache.append(k, k)
    with pytest.raises(ValueError, match="max_seq_len"):
        cache.append(k[:, :, :2], k[:, :, :2])
    assert cache.length == 4, "a failed append must leave the cache as it was"
    keys, _ = cache.append(k[:, :, :1], k[:, :, :1])
    assert keys.shape[2] == 5, "filling the cache exactly to max_seq_len must work"


def test_int8_cache_saving_is_the_bytes_per_element_ratio(impl):
    from labkit.model import Config

    config = Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
    mod = impl(INT8)
    int8 = mod.Int8KVCache(config, 1, 64)
    fp32 = impl("stage02_kv_cache.kv_cache").KVCache(config, 1, 64)
    k = torch.randn(1, 2, 3, 32)
    for layer in int8.layers:
        layer.append(k, k)
    # 32 one-byte codes + one float32 scale per token per head, against 32 four-byte floats.
    assert int8.nbytes * 128 == fp32.nbytes * 36, f"INT8 + scales should take 36/128 of float32, got {int8.nbytes}"


@pytest.mark.parametrize("name", ["gqa2-tied", "mqa-odd"])
def test_int8_cache_logits_stay_close_to_the_float_model(impl, name):
    hf = random_llama(0, **LLAMA_CONFIGS[name])
    model = labkit_from_hf(hf)
    ids = random_tokens(0, 24, hf.config.vocab_size)[None]
    cache = impl(INT8).Int8KVCache(model.config, 1, 24)
    forward = impl("stage02_kv_cache.cached_llama").forward
    got = torch.cat(
        [forward(model, ids[:, :16], cache)] + [forward(model, ids[:, t : t + 1], cache) for t in range(16, 24)], 1
    )
    with torch.no_grad():
        expected = hf(ids).logits
    err = (got - expected).abs().max() / expected.std()
    assert 0 < err < 0.05, f"config={name} seed=0: INT8 KV error / logit std = {err:.4f}, expected (0, 0.05)"
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= 0.9, f"config={name} seed=0: top-1 agreement with float {agree:.2f} < 0.9"
