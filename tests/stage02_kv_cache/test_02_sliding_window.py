"""§7 (extension) the ring-buffer sliding-window cache, against HF Mistral's sliding-window attention."""

import pytest
import torch

from labkit.testing import labkit_from_hf, random_llama, random_tokens

SLIDING = "stage02_kv_cache.sliding_window"


def llama_and_mistral(seed: int, window: int, kv_heads: int = 2):
    """labkit's Llama and an HF MistralForCausalLM (Llama + sliding window) with the same weights."""
    from transformers import MistralConfig, MistralForCausalLM

    hf = random_llama(seed, num_attention_heads=4, num_key_value_heads=kv_heads)
    cfg = {k: v for k, v in hf.config.to_dict().items() if k not in ("architectures", "model_type")}
    mistral = MistralForCausalLM(MistralConfig(**cfg, sliding_window=window)).float().eval()
    mistral.load_state_dict(hf.state_dict())
    return labkit_from_hf(hf), mistral


def assert_matches_mistral(logits: list, mistral, ids, case: str) -> None:
    """The pieces of logits the cache produced, concatenated, against HF Mistral's full forward."""
    with torch.no_grad():
        expected = mistral(ids).logits
    torch.testing.assert_close(
        torch.cat(logits, dim=1), expected, atol=1e-5, rtol=0, msg=f"{case}: vs HF Mistral with its sliding window"
    )


@pytest.mark.parametrize("seed,window,prefill", [(0, 4, 3), (1, 5, 9), (2, 7, 7)])
def test_sliding_window_decode_matches_hf_mistral(impl, seed, window, prefill):
    model, mistral = llama_and_mistral(seed, window)
    ids = random_tokens(seed, 21, model.config.vocab_size)[None]
    sw = impl(SLIDING)
    cache = sw.SlidingWindowCache(model.config, 1, window)
    logits = [sw.forward_sliding(model, ids[:, :prefill], cache)]
    logits += [sw.forward_sliding(model, ids[:, t : t + 1], cache) for t in range(prefill, 21)]
    assert_matches_mistral(logits, mistral, ids, f"seed={seed} window={window} prefill={prefill}")


@pytest.mark.parametrize("T", [3, 11])
def test_ring_cache_keeps_the_last_window_positions_in_slot_p_mod_window(impl, T):
    ring = impl(SLIDING).RingLayerCache(1, 2, 5, 4)
    g = torch.Generator().manual_seed(T)
    k, v = torch.randn(1, 2, T, 4, generator=g), torch.randn(1, 2, T, 4, generator=g)
    keys, values = ring.append(k, v)
    assert keys.shape == (1, 2, 5 + T, 4), "append returns the ring before the call, then the T new keys"
    assert torch.equal(keys[:, :, 5:], k) and torch.equal(values[:, :, 5:], v)
    for _ in range(4):
        step_k = torch.randn(1, 2, 1, 4, generator=g)
        k = torch.cat([k, step_k], dim=2)
        ring.append(step_k, step_k)
    n = T + 4
    assert ring.length == n and ring.k.shape[2] == 5, "the ring never grows past `window` slots"
    for p in range(n - 5, n):
        assert int(ring.slot_pos[p % 5]) == p, f"T={T}: position {p} belongs in slot {p % 5}"
        assert torch.equal(ring.k[:, :, p % 5], k[:, :, p]), f"T={T}: slot {p % 5} should hold the key of position {p}"


# window, chunk sizes: the ring wraps during the first chunks, then multi-token chunks land in a full ring whose
# slots the chunk's own early queries still read (a chunk longer than the window too), with GQA and without
@pytest.mark.parametrize(
    "seed,window,chunks,kv_heads",
    [(3, 4, [6, 3, 2, 5, 1, 4], 2), (4, 5, [5, 4, 7, 1, 3, 2], 4), (5, 6, [2, 5, 4, 6, 3, 1], 1)],
)
def test_sliding_window_chunks_into_a_wrapped_ring_match_hf_mistral(impl, seed, window, chunks, kv_heads):
    """A chunk of T tokens overwrites the ring slots of positions p - window for its own positions p; its first
    queries still attend to those old keys, so they must come from the ring as it was before the chunk."""
    model, mistral = llama_and_mistral(seed, window, kv_heads)
    n = sum(chunks)
    ids = random_tokens(seed, n, model.config.vocab_size)[None]
    sw = impl(SLIDING)
    cache = sw.SlidingWindowCache(model.config, 1, window)
    logits, start = [], 0
    for T in chunks:
        logits.append(sw.forward_sliding(model, ids[:, start : start + T], cache))
        start += T
    assert_matches_mistral(logits, mistral, ids, f"seed={seed} window={window} chunks={chunks} kv_heads={kv_heads}")
