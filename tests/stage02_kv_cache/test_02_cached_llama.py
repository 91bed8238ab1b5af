"""§3–§4 positions, masks, cached attention, and a cached forward that equals HF's, step by step."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from labkit.testing import LLAMA_CONFIGS, labkit_from_hf, random_llama, random_tokens

CACHED = "stage02_kv_cache.cached_llama"
KV_CACHE = "stage02_kv_cache.kv_cache"
ATOL = 1e-5


def test_token_positions_decode_starts_at_the_cache_length(impl):
    tp = impl(CACHED).token_positions
    assert tp(0, 5).tolist() == [[0, 1, 2, 3, 4]], "a prefill of 5 tokens sits at positions 0..4"
    assert tp(17, 1).tolist() == [[17]], "a decode step after 17 cached tokens is at position 17, not 0"
    assert tp(6, 3).tolist() == [[6, 7, 8]], "a prefill chunk continues from the cache length"


def test_token_positions_with_left_padding(impl):
    tp = impl(CACHED).token_positions
    pad = torch.tensor([0, 2, 4])
    assert tp(0, 5, pad).tolist() == [[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2], [-1, -1, -1, -1, 0]], (
        "row b's slot s holds position s - pad[b]; padding slots are -1"
    )
    assert tp(5, 1, pad).tolist() == [[5], [3], [1]], "each row decodes at its own position"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_mask_matches_an_explicit_loop(impl, seed):
    g = torch.Generator().manual_seed(seed)
    B, T, S = 2, 4, 9
    q_pos = torch.randint(-1, 8, (B, T), generator=g)
    k_pos = torch.randint(-1, 8, (B, S), generator=g)
    for window in (None, 3):
        got = impl(CACHED).attention_mask(q_pos, k_pos, window)
        assert got.shape == (B, 1, T, S) and got.dtype == torch.bool, f"seed={seed}: mask is (B, 1, T, S) bool"
        for b in range(B):
            for t in range(T):
                for s in range(S):
                    q, k = int(q_pos[b, t]), int(k_pos[b, s])
                    ok = 0 <= k <= q and (window is None or k > q - window)
                    assert bool(got[b, 0, t, s]) == ok, f"seed={seed} window={window}: query pos {q}, key pos {k}"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2), (8, 2), (5, 1)])
def test_attention_matches_torch_sdpa_with_gqa(impl, seed, n_heads, n_kv):
    g = torch.Generator().manual_seed(seed)
    B, T, S, D = 2, 3, 7, 16
    q = torch.randn(B, n_heads, T, D, generator=g)
    k, v = torch.randn(B, n_kv, S, D, generator=g), torch.randn(B, n_kv, S, D, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    mask[..., 0] = True
    rep = n_heads // n_kv
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
    )
    got = impl(CACHED).attention(q, k, v, mask)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"seed={seed} heads={n_heads} kv={n_kv}")
    unmasked = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    torch.testing.assert_close(impl(CACHED).attention(q, k, v, None), unmasked, atol=ATOL, rtol=0)


def test_attention_row_without_visible_keys_is_finite(impl):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g), torch.randn(1, 1, 3, 8)
    mask = torch.tensor([[False, False, False], [True, True, False]])[None, None]
    got = impl(CACHED).attention(q, k, v, mask)
    assert torch.isfinite(got).all(), "a padding query sees no key: its row must not be NaN (use a finite fill)"
    expected = F.scaled_dot_product_attention(
        q[:, :, 1:], k[:, :, :2].expand(1, 2, 2, 8), v[:, :, :2].expand(1, 2, 2, 8)
    )
    torch.testing.assert_close(got[:, :, 1:], expected, atol=ATOL, rtol=0)


# Checkpoints do not all use RoPE's default θ = 10 000 (Llama 3: 500 000); vary it with the seed.
ROPE_THETAS = (500_000.0, 1_000.0, 10_000.0)


def hf_and_ours(name: str, seed: int):
    theta = ROPE_THETAS[seed % len(ROPE_THETAS)]
    hf = random_llama(seed, rope_parameters={"rope_type": "default", "rope_theta": theta}, **LLAMA_CONFIGS[name])
    return hf, labkit_from_hf(hf)


@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_prefill_logits_match_hf(impl, name):
    hf, model = hf_and_ours(name, 0)
    ids = random_tokens(0, 11, hf.config.vocab_size)[None]
    cache = impl(KV_CACHE).KVCache(model.config, 1, 16)
    got = impl(CACHED).forward(model, ids, cache)
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"config={name} seed=0: prefill logits vs HF")
    assert cache.length == 11, "a prefill of 11 tokens leaves 11 cached positions"


@pytest.mark.parametrize("name,seed", [(name, i % 2) for i, name in enumerate(LLAMA_CONFIGS)])
def test_every_decode_step_matches_hf_dynamic_cache_and_no_cache_forward(impl, name, seed):
    hf, model = hf_and_ours(name, seed)
    prompt_len, steps = 7 + 2 * seed, 6
    ids = random_tokens(seed, prompt_len + steps, hf.config.vocab_size)[None]
    cache = impl(KV_CACHE).KVCache(model.config, 1, prompt_len + steps)
    forward = impl(CACHED).forward
    hf_cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids[:, :prompt_len], past_key_values=hf_cache, use_cache=True)
        forward(model, ids[:, :prompt_len], cache)
        for t in range(prompt_len, prompt_len + steps):
            got = forward(model, ids[:, t : t + 1], cache)
            cached_ref = hf(ids[:, t : t + 1], past_key_values=hf_cache, use_cache=True).logits
            full_ref = hf(ids[:, : t + 1]).logits[:, -1:]
            msg = f"config={name} seed={seed}: decode step at position {t}"
            torch.testing.assert_close(got, cached_ref, atol=ATOL, rtol=0, msg=msg + " vs HF DynamicCache")
            torch.testing.assert_close(got, full_ref, atol=ATOL, rtol=0, msg=msg + " vs HF no-cache forward")


@pytest.mark.parametrize("name", ["gqa4-3layers", "mqa-odd"])
def test_cache_holds_rotated_keys_of_the_kv_heads_only_like_hf(impl, name):
    hf, model = hf_and_ours(name, 1)
    ids = random_tokens(1, 9, hf.config.vocab_size)[None]
    cache = impl(KV_CACHE).KVCache(model.config, 1, 12)
    impl(CACHED).forward(model, ids, cache)
    hf_cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids, past_key_values=hf_cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        assert layer.k.shape[1] == hf.config.num_key_value_heads, "the cache stores n_kv_heads heads, not n_heads"
        torch.testing.assert_close(layer.k[:, :, :9], hf_cache.layers[i].keys, atol=ATOL, rtol=0, msg=f"layer {i} K")
        torch.testing.assert_close(layer.v[:, :, :9], hf_cache.layers[i].values, atol=ATOL, rtol=0, msg=f"layer {i} V")


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_in_chunks_matches_hf(impl, seed):
    hf, model = hf_and_ours("gqa2-tied", seed)
    ids = random_tokens(seed, 13, hf.config.vocab_size)[None]
    cache = impl(KV_CACHE).KVCache(model.config, 1, 13)
    forward = impl(CACHED).forward
    got = torch.cat([forward(model, ids[:, a:b], cache) for a, b in [(0, 5), (5, 6), (6, 13)]], dim=1)
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(
        got, expected, atol=ATOL, rtol=0, msg=f"seed={seed}: chunks 5+1+7 need a causal mask offset by the cache"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncate_then_continue_equals_a_fresh_run(impl, seed):
    hf, model = hf_and_ours("gqa4-3layers", seed)
    ids = random_tokens(seed, 16, hf.config.vocab_size)[None]
    draft = random_tokens(seed + 100, 5, hf.config.vocab_size)[None]
    cache = impl(KV_CACHE).KVCache(model.config, 1, 24)
    forward = impl(CACHED).forward
    forward(model, ids[:, :10], cache)
    forward(model, draft, cache)  # tokens a verifier would reject
    cache.truncate(10)
    got = forward(model, ids[:, 10:], cache)
    with torch.no_grad():
        expected = hf(ids).logits[:, 10:]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"seed={seed}: truncate(10) then continue")
