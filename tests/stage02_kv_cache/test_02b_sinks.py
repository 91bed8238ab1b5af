"""Part 2 §6–§8: a fixed-budget cache with attention sinks (StreamingLLM) and H2O eviction,
against a brute-force version that keeps every token and masks out the evicted ones."""

import pytest
import torch

from labkit.model import Config, Llama, apply_rope, init_weights, rope_cos_sin
from labkit.testing import labkit_from_hf, random_llama, random_tokens

SINKS = "stage02_kv_cache.sinks"

MODELS = {  # heads / KV heads (MHA, GQA 2, MQA), RoPE θ, eps
    "gqa2": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha3": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, rms_norm_eps=1e-6),
    "mqa4": dict(num_attention_heads=4, num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 300.0}),
}  # fmt: skip


def sink_victim(n_sink):
    return lambda kept, score: min(p for p in kept if p >= n_sink)


def h2o_victim(n_recent):
    def victim(kept, score):
        protected = set(sorted(kept)[-n_recent:]) if n_recent else set()
        return min((score[p], p) for p in kept if p not in protected)[1]

    return victim


@torch.no_grad()
def brute_force(model: Llama, ids: torch.Tensor, budget: int, victim):
    """Keep every token's pre-RoPE K and V; at step t attend over a mask of the tokens the policy
    still keeps (plus t), rotated by their rank among them. Returns logits (T, vocab), the kept
    positions of each layer at the end and each layer's accumulated score {position: attention}."""
    c = model.config
    T = ids.shape[1]
    K = [torch.zeros(c.num_key_value_heads, T, c.head_dim) for _ in model.model.layers]
    V = [torch.zeros(c.num_key_value_heads, T, c.head_dim) for _ in model.model.layers]
    kept = [set() for _ in model.model.layers]
    score = [dict() for _ in model.model.layers]
    out = []
    for t in range(T):
        x = model.model.embed_tokens(ids[:, t : t + 1])
        for i, layer in enumerate(model.model.layers):
            a, h = layer.self_attn, layer.input_layernorm(x)
            q = a.q_proj(h).view(c.num_attention_heads, 1, c.head_dim)
            K[i][:, t] = a.k_proj(h).view(c.num_key_value_heads, c.head_dim)
            V[i][:, t] = a.v_proj(h).view(c.num_key_value_heads, c.head_dim)
            visible = torch.zeros(t + 1, dtype=torch.bool)
            visible[sorted(kept[i]) + [t]] = True
            rank = visible.long().cumsum(0) - 1  # StreamingLLM: position = rank among the visible
            cos, sin = rope_cos_sin(rank, c.head_dim, c.rope_theta)
            k = apply_rope(K[i][:, : t + 1], cos, sin).repeat_interleave(
                c.num_attention_heads // c.num_key_value_heads, 0
            )
            v = V[i][:, : t + 1].repeat_interleave(c.num_attention_heads // c.num_key_value_heads, 0)
            q = apply_rope(q, cos[t : t + 1], sin[t : t + 1])
            s = (q @ k.transpose(-1, -2) / c.head_dim**0.5).masked_fill(~visible, float("-inf"))
            w = s.softmax(-1)  # (H, 1, t + 1)
            received = w.sum(dim=(0, 1))
            for p in kept[i]:
                score[i][p] += float(received[p])
            if len(kept[i]) == budget:
                kept[i].remove(victim(kept[i], score[i]))
            kept[i].add(t)
            score[i][t] = float(received[t])
            y = (w @ v).transpose(0, 1).reshape(1, 1, -1)
            x = x + a.o_proj(y)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out.append(model.lm_head(model.model.norm(x))[0, 0])
    return torch.stack(out), kept, score


CASES = [  # seed, model, budget, policy, argument
    (0, "gqa2", 10, "sinks", 4),
    (1, "mha3", 7, "sinks", 1),
    (2, "mqa4", 9, "sinks", 0),  # window only
    (3, "gqa2", 8, "h2o", 3),
    (4, "mqa4", 11, "h2o", 5),
    (5, "mha3", 6, "h2o", 0),
]


@pytest.mark.parametrize("seed,name,budget,policy,arg", CASES)
def test_02b_streaming_cache_equals_brute_force_mask(impl, seed, name, budget, policy, arg):
    model = labkit_from_hf(random_llama(seed, **MODELS[name]))
    ids = random_tokens(seed, 27, model.config.vocab_size)[None]
    mod = impl(SINKS)
    cache = mod.StreamingCache(model.config, budget, mod.SinkWindow(arg) if policy == "sinks" else mod.H2O(arg))
    got = mod.forward_streaming(model, ids, cache)
    expected, kept, score = brute_force(model, ids, budget, sink_victim(arg) if policy == "sinks" else h2o_victim(arg))
    where = f"seed={seed} model={name} budget={budget} {policy}({arg})"
    torch.testing.assert_close(
        got[0], expected, atol=1e-4, rtol=1e-4, msg=f"{where}: logits differ from the brute force"
    )
    for i, layer in enumerate(cache.layers):
        assert set(layer.pos.tolist()) == kept[i], (
            f"{where}: layer {i} keeps {sorted(layer.pos.tolist())}, not {sorted(kept[i])}"
        )
        # H2O's statistic: each kept token's softmax weight summed over query heads and every step since it came
        got_score = {int(p): float(s) for p, s in zip(layer.pos, layer.score, strict=True)}
        want_score = {p: score[i][p] for p in kept[i]}
        torch.testing.assert_close(
            got_score, want_score, atol=1e-4, rtol=1e-4, msg=f"{where}: layer {i} accumulated scores by position"
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_02b_sink_window_keeps_the_first_n_sink_and_the_last_tokens(impl, seed):
    g = torch.Generator().manual_seed(seed)
    n_sink, budget, n, D = (1, 2, 3)[seed], 6 + seed, 20 + 3 * seed, 4
    mod = impl(SINKS)
    layer = mod.StreamingLayerCache(2, budget, D, mod.SinkWindow(n_sink))
    ks = torch.randn(n, 1, 2, 1, D, generator=g)
    for t in range(n):
        layer.store(ks[t], -ks[t], float(torch.rand(1, generator=g)))
    expected = list(range(n_sink)) + list(range(n - budget + n_sink, n))
    slots = layer.kept()
    assert layer.pos[slots].tolist() == expected, f"seed={seed}: kept() should list {expected} in order"
    for slot in slots.tolist():
        p = int(layer.pos[slot])
        assert torch.equal(layer.k[:, :, slot], ks[p][:, :, 0]), (
            f"seed={seed}: slot {slot} must hold position {p}'s key"
        )
        assert torch.equal(layer.v[:, :, slot], -ks[p][:, :, 0]), (
            f"seed={seed}: slot {slot} must hold position {p}'s value"
        )


@pytest.mark.parametrize("seed", range(4))
def test_02b_victims_are_exactly_the_ones_the_policy_names(impl, seed):
    g = torch.Generator().manual_seed(seed)
    budget = 8 + seed
    pos = torch.randperm(40, generator=g)[:budget]  # a full cache, slots in any order
    score = torch.rand(budget, generator=g)
    score[torch.randperm(budget, generator=g)[:3]] = 0.25  # ties go to the oldest
    mod = impl(SINKS)
    kept, scores = set(pos.tolist()), dict(zip(pos.tolist(), score.tolist(), strict=True))
    for n_sink in (0, 2, 5):
        slot = mod.SinkWindow(n_sink).victim(pos.clone(), score.clone())
        assert int(pos[slot]) == sink_victim(n_sink)(kept, scores), (
            f"seed={seed} SinkWindow({n_sink}) evicted pos {pos[slot]}"
        )
    for n_recent in (0, 1, 4):
        slot = mod.H2O(n_recent).victim(pos.clone(), score.clone())
        assert int(pos[slot]) == h2o_victim(n_recent)(kept, scores), (
            f"seed={seed} H2O({n_recent}) evicted pos {pos[slot]}"
        )


@pytest.mark.in_process("the cache's own buffers: data_ptr, which a copy from a worker cannot keep")
def test_02b_memory_stays_bounded_past_the_model_context(impl):
    """A model with a 32-token context streams 3× that; the cache never reallocates or grows,
    and no RoPE position ever exceeds the budget."""
    config = Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=32)  # fmt: skip
    model = init_weights(Llama(config), seed=3).eval()
    mod = impl(SINKS)
    budget = 12
    for policy in (mod.SinkWindow(4), mod.H2O(6)):
        cache = mod.StreamingCache(config, budget, policy)
        buffers = [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers]
        nbytes = 2 * 2 * budget * 8 * 4 * 2  # K and V, 2 KV heads, budget slots, head_dim 8, fp32, 2 layers
        logits = mod.forward_streaming(model, random_tokens(7, 40, 61)[None], cache)
        for _ in range(2):
            logits = mod.forward_streaming(model, random_tokens(8, 28, 61)[None], cache)
            assert cache.nbytes == nbytes, f"{type(policy).__name__}: the cache grew to {cache.nbytes} bytes"
        assert cache.length == 96 > config.max_position_embeddings
        assert torch.isfinite(logits).all()
        assert [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers] == buffers, "the buffers moved"
        for layer in cache.layers:
            assert (layer.pos >= 0).sum() == budget and int(layer.pos.max()) == 95, "the newest token is kept"
