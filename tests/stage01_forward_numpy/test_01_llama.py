"""Stage 01, part 2: the Llama-style decoder in NumPy against Hugging Face's LlamaForCausalLM."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

import labkit
from labkit.testing import (
    LLAMA_CONFIGS,
    capture,
    check_numpy_forward,
    check_numpy_greedy,
    hf_logits,
    random_llama,
    random_tokens,
)

MODULE = "stage01_forward_numpy.llama_numpy"
SEEDS = [0, 1, 2]
LENGTHS = {"mha-untied": 11, "gqa2-tied": 29, "gqa4-3layers": 47, "mqa-odd": 23}
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
LINEARS += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
NORMS = ["input_layernorm.weight", "post_attention_layernorm.weight"]


# What real checkpoints vary and random init does not: RoPE θ (Llama 3: 500 000), the RMSNorm epsilon,
# and norm weights (random init leaves them at 1, which hides a norm applied with the wrong weight).
CHECKPOINT = {
    "mha-untied": dict(rope_theta=500_000.0, rms_norm_eps=1e-6),
    "gqa2-tied": dict(rope_theta=10_000.0, rms_norm_eps=0.02),
    "gqa4-3layers": dict(rope_theta=1_000.0, rms_norm_eps=1e-5),
    "mqa-odd": dict(rope_theta=250_000.0, rms_norm_eps=0.05),
}


def llama(name: str, seed: int = 0):
    # No BOS/EOS ids: hf_greedy would otherwise forbid EOS, which plain argmax decoding does not.
    theta, eps = CHECKPOINT[name]["rope_theta"], CHECKPOINT[name]["rms_norm_eps"]
    hf = random_llama(
        seed,
        bos_token_id=None,
        eos_token_id=None,
        rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        **LLAMA_CONFIGS[name],
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return hf


def expected_params(hf) -> dict:
    """The params dict load_llama_params documents, built here from the HF model: linears as (in, out)."""
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    c = hf.config
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {f"{name}.weight": sd[f"{p}{name}.weight"].T for name in LINEARS}
        layers.append(layer | {name: sd[p + name] for name in NORMS})
    return {
        "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "embed_tokens": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "lm_head": sd["lm_head.weight"],
        "layers": layers,
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_rms_norm_matches_hf(impl, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 3.0, size=(13, 40)).astype(np.float32)
    w = rng.normal(size=(40,)).astype(np.float32)
    norm = hf_llama.LlamaRMSNorm(40, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        expected = norm(torch.from_numpy(x)).numpy()
    got = impl(MODULE).rms_norm(x, w, eps=1e-5)
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
def test_rope_matches_hf_with_a_position_offset(impl, seed, theta):
    rng = np.random.default_rng(seed)
    n_heads, T, head_dim, offset = 3, 9, 16, 5 + 40 * seed  # offset: the positions of a later chunk / decode step
    x = rng.normal(size=(n_heads, T, head_dim)).astype(np.float32)
    positions = np.arange(offset, offset + T)
    config = LlamaConfig(
        hidden_size=n_heads * head_dim,
        num_attention_heads=n_heads,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    xt = torch.from_numpy(x)[None]
    cos, sin = hf_llama.LlamaRotaryEmbedding(config)(xt, torch.from_numpy(positions)[None])
    expected, _ = hf_llama.apply_rotary_pos_emb(xt, xt, cos, sin)
    got = impl(MODULE).rope(x, positions, theta)
    np.testing.assert_allclose(
        got, expected[0].numpy(), atol=1e-5, err_msg=f"half-split pairing, positions {offset}.., seed={seed}"
    )


@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_repeat_kv_matches_hf(impl, n_rep):
    x = np.random.default_rng(n_rep).normal(size=(3, 7, 8)).astype(np.float32)
    expected = hf_llama.repeat_kv(torch.from_numpy(x)[None], n_rep)[0].numpy()
    got = impl(MODULE).repeat_kv(x, n_rep)
    np.testing.assert_array_equal(got, expected, err_msg=f"query head h reads kv head h // n_rep (n_rep={n_rep})")


@pytest.mark.parametrize("seed", SEEDS)
def test_swiglu_matches_hf_llama_mlp(impl, seed):
    hf = llama("gqa2-tied", seed)
    mlp = hf.model.layers[0].mlp
    x = np.random.default_rng(seed).normal(size=(15, 64)).astype(np.float32)
    with torch.no_grad():
        expected = mlp(torch.from_numpy(x)).numpy()
    w = [getattr(mlp, n).weight.detach().numpy().T for n in ("gate_proj", "up_proj", "down_proj")]
    got = impl(MODULE).swiglu(x, *w)
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_llama_attention_matches_hf_self_attn(impl, name):
    hf = llama(name, 3)
    ids = random_tokens(3, LENGTHS[name], hf.config.vocab_size)
    x, expected = capture(hf.model.layers[0].self_attn, lambda: hf(ids[None]))
    p, c = expected_params(hf)["layers"][0], hf.config
    w = [p[f"{n}.weight"] for n in LINEARS[:4]]
    got = impl(MODULE).llama_attention(
        x, *w, c.num_attention_heads, c.num_key_value_heads, np.arange(len(ids)), c.rope_parameters["rope_theta"]
    )
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{name} (seed=3)")


@pytest.mark.parametrize("name", ["gqa2-tied", "mqa-odd"])
def test_llama_block_matches_hf_decoder_layer(impl, name):
    hf = llama(name, 4)
    ids = random_tokens(4, LENGTHS[name], hf.config.vocab_size)
    x, expected = capture(hf.model.layers[1], lambda: hf(ids[None]))
    params = expected_params(hf)
    got = impl(MODULE).llama_block(x, params["layers"][1], params, np.arange(len(ids)))
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{name} (seed=4)")


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_llama_forward_matches_hf_logits(impl, name):
    seed = len(name)
    check_numpy_forward(impl(MODULE).llama_forward, expected_params, llama(name, seed), seed, LENGTHS[name], name)


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_llama_greedy_tokens_match_hf_generate(impl, name):
    seed, generate = len(name) + 1, impl("stage01_forward_numpy.sampling").generate
    check_numpy_greedy(generate, impl(MODULE).llama_forward, expected_params, llama(name, seed), seed, 4, name)


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_load_llama_params_transposes_the_linears(impl, name):
    hf = llama(name)
    got = impl(MODULE).load_llama_params(dict(hf.state_dict()), config=hf.config.to_dict())
    expected = expected_params(hf)
    for key in ("n_heads", "n_kv_heads", "head_dim", "eps", "rope_theta"):
        assert got[key] == pytest.approx(expected[key]), (
            f"{name}: params[{key!r}] = {got[key]}, expected {expected[key]}"
        )
    for key in ("embed_tokens", "norm.weight", "lm_head"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{name}: params[{key!r}]")
    for i, (g, e) in enumerate(zip(got["layers"], expected["layers"], strict=True)):
        for key in e:
            np.testing.assert_array_equal(
                g[key],
                e[key],
                err_msg=f"{name}: layers[{i}][{key!r}]; nn.Linear stores (out, in), params hold (in, out)",
            )


@pytest.mark.parametrize("name", ["gqa2-tied", "mqa-odd"])
def test_llama_runs_from_a_save_pretrained_folder(impl, name, tmp_path):
    hf = llama(name, 8)
    hf.save_pretrained(tmp_path)  # a tied model's file has no lm_head.weight
    mod = impl(MODULE)
    ids = random_tokens(8, 19, hf.config.vocab_size)
    got = mod.llama_forward(mod.load_llama_params(tmp_path), ids.numpy())
    delta = np.abs(got - hf_logits(hf, ids)).max()
    assert delta < 1e-4, f"{name} loaded from save_pretrained: max |Δlogits| = {delta:.2e} (seed=8)"


def test_llama_forward_runs_the_tiny_target(impl):
    from labkit.model import from_pretrained

    ids = random_tokens(5, 40, 2048)
    ids[0] = 1  # <s>
    with torch.no_grad():
        expected = from_pretrained(labkit.TARGET)(ids[None])[0].numpy()
    mod = impl(MODULE)
    got = mod.llama_forward(mod.load_llama_params(labkit.TARGET), ids.numpy())
    delta = np.abs(got - expected).max()
    assert delta < 1e-3 * max(1.0, np.abs(expected).max()), f"tiny target: max |Δlogits| = {delta:.2e} (seed=5)"
