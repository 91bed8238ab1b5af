"""Part 2 §1–§5: Multi-head Latent Attention against transformers' DeepSeek-V3, the absorbed form
against a per-head loop, the latent-only cache, and the memory math of DeepSeek-V3 vs Llama-3-70B."""

import pytest
import torch

from labkit.tensor_memory import TensorWatch

MLA = "stage02_kv_cache.mla"

# Every shape a checkpoint varies: low-rank or full query, head counts (odd too), rope/nope/v head
# dims (v != nope), latent width, interleaved or half-split RoPE, θ, eps, biases, tied embeddings.
CONFIGS = {
    "q-full-interleave-bias": dict(
        q_lora_rank=None, num_attention_heads=3, kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10,
        v_head_dim=12, rope_interleave=True, attention_bias=True, rope_theta=500.0, rms_norm_eps=1e-5,
    ),
    "q-lora-halfsplit": dict(
        q_lora_rank=24, num_attention_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=6, rope_interleave=False, attention_bias=False, rope_theta=10_000.0, rms_norm_eps=1e-6,
    ),
    "q-lora-5heads-3layers-tied": dict(
        q_lora_rank=16, num_attention_heads=5, kv_lora_rank=32, qk_rope_head_dim=4, qk_nope_head_dim=12,
        v_head_dim=16, rope_interleave=True, attention_bias=False, rope_theta=2_000.0, rms_norm_eps=1e-5,
        num_hidden_layers=3, tie_word_embeddings=True,
    ),
}  # fmt: skip


# What DeepseekV3Config() (transformers 5.x) holds for DeepSeek-V3: the memory math's test builds the class itself
# and checks these first, so a drift in transformers' defaults shows as such, not as a wrong byte count.
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    head_dim=64, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    qk_head_dim=192,
)  # fmt: skip


def random_deepseek(seed: int, name: str):
    """A random-init transformers DeepseekV3ForCausalLM (dense MLPs), float32, norms not all ones."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(CONFIGS[name])
    theta = kw.pop("rope_theta")
    layers = kw.pop("num_hidden_layers", 2)
    config = DeepseekV3Config(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # dense MLPs everywhere: no MoE routing
        num_key_value_heads=kw["num_attention_heads"],
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        max_position_embeddings=256,
        **kw,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)  # a norm weight of ones would hide a missing RMSNorm
            else:
                p.normal_(0.0, 0.08)
    return model


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def causal_mask(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_02b_mla_block_output_matches_hf_attention(impl, name, absorbed):
    seed = len(name)
    hf = random_deepseek(seed, name)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(seed))
    seen = {}
    hook = hf.model.layers[1].self_attn.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(x=kwargs["hidden_states"], y=out[0]), with_kwargs=True
    )
    with torch.no_grad():
        hf(ids)
    hook.remove()
    mla = impl(MLA)
    with torch.no_grad():
        got = mla.mla_block(hf.model.layers[1].self_attn, seen["x"], torch.arange(11), causal_mask(11), None, absorbed)
    err = relative_error(got, seen["y"])
    assert err < 1e-4, f"seed={seed} config={name} absorbed={absorbed}: layer-1 attention output rel. err {err:.2e}"


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_02b_mla_logits_with_cached_decode_match_hf(impl, name, absorbed):
    seed = 10 + len(name)
    hf = random_deepseek(seed, name)
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = hf(ids).logits
    mla = impl(MLA)
    full = mla.forward(hf, ids, absorbed=absorbed)
    err = relative_error(full, expected)
    assert err < 1e-4, f"seed={seed} config={name} absorbed={absorbed}: uncached logits rel. err {err:.2e}"

    cache = mla.MLACache(hf.config, 2, 20)
    steps = [mla.forward(hf, ids[:, :9], cache, absorbed=absorbed)]
    steps += [mla.forward(hf, ids[:, t : t + 1], cache, absorbed=absorbed) for t in range(9, 17)]
    err = relative_error(torch.cat(steps, dim=1), expected)
    assert cache.length == 17, f"seed={seed} config={name}: cache.length {cache.length} after 17 tokens"
    assert err < 1e-4, (
        f"seed={seed} config={name} absorbed={absorbed}: prefill 9 + 8 cached decode steps, logits rel. err {err:.2e}"
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_02b_mla_cache_holds_only_the_normed_latent_and_rotated_rope_key(impl, name):
    """transformers 5.23 caches the same two things: keys = normalised c_kv, values = rotated k_pe."""
    from transformers import DynamicCache

    seed = 20 + len(name)
    hf = random_deepseek(seed, name)
    c = hf.config
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(seed))
    hf_cache = DynamicCache(config=c)
    with torch.no_grad():
        hf(ids, past_key_values=hf_cache, use_cache=True)
    mla = impl(MLA)
    cache = mla.MLACache(c, 1, 16)
    mla.forward(hf, ids[:, :6], cache)
    mla.forward(hf, ids[:, 6:], cache)
    for i, layer in enumerate(cache.layers):
        assert layer.c_kv.shape == (1, 16, c.kv_lora_rank) and layer.k_pe.shape == (1, 16, c.qk_rope_head_dim)
        assert layer.nbytes == 16 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4, "the cache holds c_kv and k_pe only"
        for got, ref, what in (
            (layer.c_kv, hf_cache.layers[i].keys, "c_kv"),
            (layer.k_pe, hf_cache.layers[i].values, "k_pe"),
        ):
            err = relative_error(got[:, :13], ref[:, 0])
            assert err < 1e-4, f"seed={seed} config={name} layer {i}: cached {what} rel. err {err:.2e} vs transformers"
    with pytest.raises(ValueError, match="max_seq_len"):
        mla.forward(hf, ids[:, :4], cache)


def per_head_reference(W_UK, W_UV, q_nope, q_pe, c_kv, k_pe, scale, mask):
    """The obvious form, one head at a time: build K_h, V_h from the latent, then attend."""
    out = []
    for h in range(q_nope.shape[1]):
        K = torch.cat([c_kv @ W_UK[h].T, k_pe], dim=-1)  # (B, S, n + p)
        V = c_kv @ W_UV[h].T  # (B, S, v)
        q = torch.cat([q_nope[:, h], q_pe[:, h]], dim=-1)  # (B, T, n + p)
        scores = (q @ K.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out.append(scores.softmax(-1) @ V)
    return torch.cat(out, dim=-1)  # (B, T, H·v)


@pytest.mark.parametrize("T,S", [(1, 23), (5, 12)])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_02b_absorbed_equals_expanded_and_a_per_head_loop(impl, name, T, S):
    seed = 30 + len(name) + S
    hf = random_deepseek(seed, name)
    attn, c = hf.model.layers[0].self_attn, hf.config
    g = torch.Generator().manual_seed(seed)
    B, H = 2, c.num_attention_heads
    q_nope = torch.randn(B, H, T, c.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(B, H, T, c.qk_rope_head_dim, generator=g)
    c_kv, k_pe = torch.randn(B, S, c.kv_lora_rank, generator=g), torch.randn(B, S, c.qk_rope_head_dim, generator=g)
    mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    W = attn.kv_b_proj.weight.detach().view(H, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    W_UK, W_UV = W[:, : c.qk_nope_head_dim], W[:, c.qk_nope_head_dim :]
    expected = per_head_reference(W_UK, W_UV, q_nope, q_pe, c_kv, k_pe, c.qk_head_dim**-0.5, mask)
    mla = impl(MLA)
    with torch.no_grad():
        for fn in (mla.attend_expanded, mla.attend_absorbed):
            got = fn(attn, q_nope, q_pe, c_kv, k_pe, mask)
            err = relative_error(got, expected)
            assert err < 1e-5, f"seed={seed} config={name} T={T} S={S}: {fn.__name__} rel. err {err:.2e}"


@pytest.mark.parametrize("name", ["q-full-interleave-bias", "q-lora-5heads-3layers-tied"])
def test_02b_absorbed_decode_never_builds_per_head_kv(impl, name):
    """With S cached tokens, a per-head key or value has at least H·S·min(n, v) numbers; nothing
    the absorbed decode step creates may be that large (the latent, scores and weights are smaller)."""
    seed = 40 + len(name)
    hf = random_deepseek(seed, name)
    c = hf.config
    S = 300
    mla = impl(MLA)
    cache = mla.MLACache(c, 1, S + 1)
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:  # a filled cache: decode cost does not depend on how it was filled
        layer.c_kv.copy_(torch.randn(layer.c_kv.shape, generator=g))
        layer.k_pe.copy_(torch.randn(layer.k_pe.shape, generator=g))
        layer.length = S
    per_head = c.num_attention_heads * S * min(c.qk_nope_head_dim, c.v_head_dim)
    with TensorWatch() as watch:
        logits = mla.forward(hf, torch.tensor([[7]]), cache, absorbed=True)
    assert torch.isfinite(logits).all()
    assert watch.largest_numel < per_head, (
        f"seed={seed} config={name}: absorbed decode created a tensor of shape {watch.largest_shape}, as large as "
        f"per-head K or V over {S} cached tokens ({per_head} numbers): fold W_UK into the query and W_UV into the "
        "output instead of expanding the latent, and contract with einsum (matmul broadcasts c_kv to every head)"
    )


def test_02b_memory_math_deepseek_v3_against_llama3_70b(impl):
    """Exact bytes per token, bf16. DeepSeek-V3: 61 layers, 128 heads, kv_lora_rank 512, rope 64, nope 128,
    v 128. Llama-3-70B: 80 layers, 64 query heads, 8 KV heads, head_dim 128; the same shape with 64 KV heads
    (MHA) or 1 (MQA). Qwen3-4B: 36 layers, 32 query heads, 8 KV heads, head_dim 128 on a hidden size of 2560.

    Each config is transformers' own class for that model (DeepseekV3Config() is DeepSeek-V3, with its derived
    head_dim = rope dim and KV heads = heads), so that a formula reading a field the real class lacks, or a
    drift in the class, fails here."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    mla = impl(MLA)
    v3 = DeepseekV3Config()
    drift = {k: (getattr(v3, k, None), v) for k, v in DEEPSEEK_V3.items() if getattr(v3, k, None) != v}
    assert not drift, f"transformers' DeepseekV3Config() is no longer DeepSeek-V3 as this test knows it: {drift}"
    assert mla.kv_bytes_per_token(v3) == 61 * (512 + 64) * 2 == 70_272, "MLA caches c_kv and k_pe per layer"
    assert mla.expanded_bytes_per_token(v3) == 61 * 128 * (128 + 64 + 128) * 2 == 4_997_120
    assert mla.kv_bytes_per_token(v3, dtype_bytes=1) == 35_136, "fp8 halves it"

    def llama70b(kv_heads):
        return LlamaConfig(
            hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=kv_heads, head_dim=128
        )

    assert mla.kv_bytes_per_token(llama70b(64)) == 2 * 80 * 64 * 128 * 2 == 2_621_440, "MHA: every head has K and V"
    assert mla.kv_bytes_per_token(llama70b(8)) == 2 * 80 * 8 * 128 * 2 == 327_680, "GQA: Llama-3-70B's 8 KV heads"
    assert mla.kv_bytes_per_token(llama70b(1)) == 2 * 80 * 1 * 128 * 2 == 40_960, "MQA: one KV head"
    assert mla.kv_bytes_per_token(llama70b(8), dtype_bytes=4) == 655_360
    # head_dim 128 although hidden_size / heads = 80: read config.head_dim
    qwen3_4b = Qwen3Config(
        hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128
    )
    assert mla.kv_bytes_per_token(qwen3_4b) == 2 * 36 * 8 * 128 * 2 == 147_456, "Qwen3-4B: head_dim != hidden / heads"

    lite = DeepseekV3Config(num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None)
    assert mla.kv_bytes_per_token(lite) == 27 * 576 * 2 == 31_104
    assert mla.expanded_bytes_per_token(lite, dtype_bytes=4) == 27 * 16 * 320 * 4 == 552_960
