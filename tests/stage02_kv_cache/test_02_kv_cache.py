"""§2 LayerCache: preallocated buffers, append returns the valid prefix, truncate, overflow errors."""

import pytest
import torch

KV_CACHE = "stage02_kv_cache.kv_cache"


def chunks(seed: int, sizes: list[int], batch: int = 2, n_kv: int = 3, head_dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, n_kv, t, head_dim, generator=g), torch.randn(batch, n_kv, t, head_dim, generator=g))
        for t in sizes
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_append_returns_the_valid_prefix(impl, seed):
    cache = impl(KV_CACHE).LayerCache(2, 3, 32, 8)
    seen_k, seen_v = [], []
    for k, v in chunks(seed, [7, 1, 1, 4, 1]):
        seen_k.append(k)
        seen_v.append(v)
        got_k, got_v = cache.append(k, v)
        expected_k, expected_v = torch.cat(seen_k, dim=2), torch.cat(seen_v, dim=2)
        assert cache.length == expected_k.shape[2], f"seed={seed}: length should count every appended token"
        assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v), (
            f"seed={seed}: append must return all keys/values so far, shape {tuple(expected_k.shape)}"
        )


@pytest.mark.in_process("the cache's own buffers: data_ptr, which a copy from a worker cannot keep")
def test_append_writes_into_the_preallocated_buffers(impl):
    cache = impl(KV_CACHE).LayerCache(2, 3, 32, 8)
    assert cache.k.shape == (2, 3, 32, 8), "buffers are (B, n_kv_heads, max_seq_len, head_dim), allocated up front"
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    for k, v in chunks(5, [6, 1, 1]):
        got_k, got_v = cache.append(k, v)
    assert cache.k.data_ptr() == k_ptr and cache.v.data_ptr() == v_ptr, "append must not reallocate the buffers"
    assert got_k.data_ptr() == k_ptr and got_v.data_ptr() == v_ptr, (
        "append should return views of the buffers (a slice), not copies"
    )
    assert torch.equal(cache.k[:, :, :8], got_k), "the data must live in cache.k at slots [0, length)"


def test_append_past_max_seq_raises_a_clear_error_and_keeps_the_cache(impl):
    cache = impl(KV_CACHE).LayerCache(2, 3, 10, 8)
    (k1, v1), (k2, v2) = chunks(3, [8, 3])
    cache.append(k1, v1)
    with pytest.raises(ValueError, match="max_seq_len"):
        cache.append(k2, v2)
    assert cache.length == 8, "a failed append must leave the cache as it was"
    got_k, _ = cache.append(k2[:, :, :2], v2[:, :, :2])
    assert torch.equal(got_k[:, :, 8:], k2[:, :, :2]), "filling the cache exactly to max_seq_len must work"


@pytest.mark.parametrize("seed", [0, 1])
def test_truncate_then_append_overwrites_the_tail(impl, seed):
    cache = impl(KV_CACHE).LayerCache(2, 3, 32, 8)
    (k1, v1), (k2, v2) = chunks(seed, [9, 4])
    cache.append(k1, v1)
    cache.truncate(5)
    assert cache.length == 5, f"seed={seed}: truncate(5) leaves 5 positions"
    got_k, got_v = cache.append(k2, v2)
    assert torch.equal(got_k, torch.cat([k1[:, :, :5], k2], dim=2)), f"seed={seed}: keys after truncate + append"
    assert torch.equal(got_v, torch.cat([v1[:, :, :5], v2], dim=2)), f"seed={seed}: values after truncate + append"


def test_truncate_rejects_lengths_outside_the_cache(impl):
    cache = impl(KV_CACHE).LayerCache(1, 1, 16, 4)
    k, v = chunks(0, [6], batch=1, n_kv=1, head_dim=4)[0]
    cache.append(k, v)
    for bad in (7, -1):
        with pytest.raises(ValueError):
            cache.truncate(bad)
    cache.truncate(6)
    cache.truncate(0)
    assert cache.length == 0, "truncate(length) is a no-op and truncate(0) empties the cache"


def test_kv_cache_truncates_every_layer(impl):
    from labkit.model import Config

    cache = impl(KV_CACHE).KVCache(Config(num_hidden_layers=3), batch=1, max_seq_len=12)
    k, v = chunks(1, [7], batch=1, n_kv=2, head_dim=32)[0]
    for layer in cache.layers:
        layer.append(k, v)
    cache.truncate(4)
    assert cache.length == 4 and all(layer.length == 4 for layer in cache.layers), "every layer keeps 4 positions"
