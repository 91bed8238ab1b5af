"""Stage 01, part 1: GPT-2 in NumPy, each piece against PyTorch or Hugging Face's GPT2LMHeadModel."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from labkit.testing import capture, check_numpy_forward, check_numpy_greedy, hf_logits, random_gpt2, random_tokens

MODULE = "stage01_forward_numpy.gpt2_numpy"
SEEDS = [0, 1, 2]
# Odd head counts, tied and untied output embeddings, a non-default MLP width, vocabularies of odd size,
# and LayerNorm epsilons other than the default 1e-5 (large enough to show in the logits).
GPT2_CONFIGS = {
    "3heads-tied": dict(n_embd=48, n_head=3, n_layer=2, vocab_size=101),
    "5heads-untied": dict(
        n_embd=60, n_head=5, n_layer=3, vocab_size=97, tie_word_embeddings=False, layer_norm_epsilon=0.02
    ),
    "7heads-ninner": dict(n_embd=56, n_head=7, n_layer=1, n_inner=100, vocab_size=67, layer_norm_epsilon=0.05),
}
LENGTHS = {"3heads-tied": 37, "5heads-untied": 61, "7heads-ninner": 13}
BLOCK_KEYS = [
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
]  # fmt: skip


def gpt2(name: str, seed: int = 0):
    # No BOS/EOS ids: hf_greedy would otherwise forbid EOS, which plain argmax decoding does not.
    return trained_norms(random_gpt2(seed, bos_token_id=None, eos_token_id=None, **GPT2_CONFIGS[name]), seed)


def trained_norms(hf, seed: int):
    """Random init leaves every LayerNorm at weight 1, bias 0, which hides a norm applied with the
    wrong weights; a trained checkpoint's are anything but. Draw them around 1 and 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return hf


def expected_params(hf) -> dict:
    """The params dict load_gpt2_params documents, built here straight from the HF model."""
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    c = hf.config
    return {
        "n_head": c.n_head,
        "eps": c.layer_norm_epsilon,
        "wte": sd["transformer.wte.weight"],
        "wpe": sd["transformer.wpe.weight"],
        "ln_f.weight": sd["transformer.ln_f.weight"],
        "ln_f.bias": sd["transformer.ln_f.bias"],
        "lm_head": sd["lm_head.weight"],
        "blocks": [{k: sd[f"transformer.h.{i}.{k}"] for k in BLOCK_KEYS} for i in range(c.n_layer)],
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_softmax_matches_torch(impl, seed):
    x = np.random.default_rng(seed).normal(0, 3, size=(4, 7, 33)).astype(np.float32)
    mod = impl(MODULE)
    for axis in (-1, 0):
        got = mod.softmax(x, axis=axis)
        expected = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"softmax(axis={axis}) seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_softmax_is_stable_on_huge_logits(impl, seed):
    rng = np.random.default_rng(seed)
    x = rng.choice([-1e4, 1e4], size=(5, 16)).astype(np.float32) + rng.normal(size=(5, 16)).astype(np.float32)
    got = impl(MODULE).softmax(x)
    assert np.isfinite(got).all(), f"softmax of logits of size ±1e4 produced inf/nan (seed={seed}): subtract the max"
    expected = torch.softmax(torch.from_numpy(x), dim=-1).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_layer_norm_matches_torch(impl, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(2.0, 3.0, size=(11, 24)).astype(np.float32)
    w, b = rng.normal(size=(2, 24)).astype(np.float32)
    got = impl(MODULE).layer_norm(x, w, b, eps=1e-5)
    expected = F.layer_norm(torch.from_numpy(x), (24,), torch.from_numpy(w), torch.from_numpy(b), eps=1e-5).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_gelu_is_the_tanh_form(impl, seed):
    x = np.random.default_rng(seed).normal(0, 3, size=(200,)).astype(np.float32)
    got = impl(MODULE).gelu(x)
    expected = F.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(
        got, expected, atol=1e-6, err_msg=f"GPT-2 uses the tanh approximation, not the erf GELU (seed={seed})"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_linear_matches_torch(impl, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(9, 20)).astype(np.float32)
    w = rng.normal(size=(20, 13)).astype(np.float32)  # (d_in, d_out), as GPT-2's Conv1D stores it
    b = rng.normal(size=(13,)).astype(np.float32)
    mod = impl(MODULE)
    expected = F.linear(torch.from_numpy(x), torch.from_numpy(w.T), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(mod.linear(x, w, b), expected, atol=1e-5, err_msg=f"with bias, seed={seed}")
    np.testing.assert_allclose(mod.linear(x, w), expected - b, atol=1e-5, err_msg=f"bias=None, seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_split_and_merge_heads_use_gpt2_layout(impl, seed):
    T, n_head, head_dim = 7 + seed, 3 + 2 * seed, 5
    x = np.random.default_rng(seed).normal(size=(T, n_head * head_dim)).astype(np.float32)
    mod = impl(MODULE)
    heads = mod.split_heads(x, n_head)
    expected = torch.from_numpy(x).view(T, n_head, head_dim).transpose(0, 1).numpy()  # HF: view, then transpose
    np.testing.assert_array_equal(heads, expected, err_msg=f"split_heads: head h owns columns h*head_dim.. seed={seed}")
    np.testing.assert_array_equal(mod.merge_heads(heads), x, err_msg=f"merge_heads(split_heads(x)) != x, seed={seed}")


def causal_reference(q, k):
    """softmax(q kᵀ/√d + mask): queries are the last Tq of Tk positions, written out in torch."""
    q, k = torch.from_numpy(q), torch.from_numpy(k)
    Tq, Tk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).numpy()


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_weights_are_a_causal_softmax(impl, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, 3, 10, 8)).astype(np.float32)
    w = impl(MODULE).attention_weights(q, k)
    assert w.shape == (3, 10, 10), f"expected (H, Tq, Tk) = (3, 10, 10), got {w.shape}"
    nan_rows = np.flatnonzero(np.isnan(w).any(axis=(0, 2))).tolist()  # (H, Tq, Tk): rows are queries
    assert not nan_rows, (
        f"query rows {nan_rows} are NaN (seed={seed}): every key of those rows is masked, so their softmax "
        "divides 0 by 0; a query must see its own key: mask only above the diagonal"
    )
    assert (np.triu(w, k=1) == 0).all(), f"a query attends to a future key (seed={seed}): mask above the diagonal"
    np.testing.assert_allclose(w, causal_reference(q, k), atol=1e-6, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_weights_mask_exactly_whatever_the_score_scale(impl, seed):
    rng = np.random.default_rng(seed)
    q, k = (300 * rng.normal(size=(2, 2, 6, 8))).astype(np.float32)  # scores of order ±1e5
    w = impl(MODULE).attention_weights(q, k)
    assert np.isfinite(w).all(), f"seed={seed}: rows must stay finite at any score scale"
    np.testing.assert_allclose(w, causal_reference(q, k), atol=1e-6, err_msg=f"seed={seed}: mask with -inf")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("Tq", [1, 3])
def test_attention_weights_of_a_decode_step_see_the_whole_prefix(impl, seed, Tq):
    """Tq < Tk (a decode step after a prefix): query i sits at position Tk - Tq + i, so the mask's
    diagonal is offset by Tk - Tq; a mask built for Tq = Tk hides keys the queries may see."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, Tq, 8)).astype(np.float32)
    k = rng.normal(size=(2, 11, 8)).astype(np.float32)
    w = impl(MODULE).attention_weights(q, k)
    assert w.shape == (2, Tq, 11), f"expected (H, Tq, Tk) = (2, {Tq}, 11), got {w.shape}"
    np.testing.assert_allclose(
        w, causal_reference(q, k), atol=1e-6, err_msg=f"Tq={Tq} queries at positions {11 - Tq}..10, seed={seed}"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_matches_torch_sdpa(impl, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(3, 5, 19, 16)).astype(np.float32)
    got = impl(MODULE).attention(q, k, v)
    t = [torch.from_numpy(a) for a in (q, k, v)]
    expected = F.scaled_dot_product_attention(*t, is_causal=True).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_with_fewer_queries_than_keys(impl, seed):
    """The decode case: the last Tq positions attend to all Tk keys up to their own position."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, 3, 8)).astype(np.float32)
    k, v = rng.normal(size=(2, 2, 11, 8)).astype(np.float32)
    got = impl(MODULE).attention(q, k, v)
    allowed = torch.ones(3, 11, dtype=torch.bool).tril(diagonal=8)
    t = [torch.from_numpy(a) for a in (q, k, v)]
    expected = F.scaled_dot_product_attention(*t, attn_mask=allowed).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"Tq=3 queries at positions 8..10, seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_multi_head_attention_matches_hf_gpt2_attn(impl, seed):
    hf = gpt2("5heads-untied", seed)
    ids = random_tokens(seed, 23, hf.config.vocab_size)
    attn = hf.transformer.h[1].attn
    x, expected = capture(attn, lambda: hf(ids[None]))
    b = expected_params(hf)["blocks"][1]
    got = impl(MODULE).multi_head_attention(
        x, b["attn.c_attn.weight"], b["attn.c_attn.bias"], b["attn.c_proj.weight"], b["attn.c_proj.bias"], 5
    )
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_mlp_matches_hf_gpt2_mlp(impl, seed):
    hf = gpt2("7heads-ninner", seed)
    x = np.random.default_rng(seed).normal(size=(17, 56)).astype(np.float32)
    with torch.no_grad():
        expected = hf.transformer.h[0].mlp(torch.from_numpy(x)).numpy()
    b = expected_params(hf)["blocks"][0]
    got = impl(MODULE).mlp(x, b["mlp.c_fc.weight"], b["mlp.c_fc.bias"], b["mlp.c_proj.weight"], b["mlp.c_proj.bias"])
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_transformer_block_matches_hf_gpt2_block(impl, seed):
    hf = gpt2("7heads-ninner" if seed == 2 else "3heads-tied", seed)
    ids = random_tokens(seed, 29, hf.config.vocab_size)
    x, expected = capture(hf.transformer.h[-1], lambda: hf(ids[None]))
    block = expected_params(hf)["blocks"][-1]
    got = impl(MODULE).transformer_block(x, block, n_head=hf.config.n_head, eps=hf.config.layer_norm_epsilon)
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize("name", GPT2_CONFIGS)
def test_gpt2_forward_matches_hf_logits(impl, name):
    seed = len(name)
    check_numpy_forward(impl(MODULE).gpt2_forward, expected_params, gpt2(name, seed), seed, LENGTHS[name], name)


@pytest.mark.parametrize("name", GPT2_CONFIGS)
def test_gpt2_greedy_tokens_match_hf_generate(impl, name):
    seed, generate = len(name) + 1, impl("stage01_forward_numpy.sampling").generate
    check_numpy_greedy(generate, impl(MODULE).gpt2_forward, expected_params, gpt2(name, seed), seed, 5, name)


def assert_same_params(got: dict, expected: dict, what: str):
    for key in ("n_head", "eps"):
        assert got[key] == pytest.approx(expected[key]), (
            f"{what}: params[{key!r}] = {got[key]}, expected {expected[key]}"
        )
    for key in ("wte", "wpe", "ln_f.weight", "ln_f.bias", "lm_head"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{what}: params[{key!r}]")
    assert len(got["blocks"]) == len(expected["blocks"]), f"{what}: wrong number of blocks"
    for i, (g, e) in enumerate(zip(got["blocks"], expected["blocks"], strict=True)):
        for key in BLOCK_KEYS:
            assert g[key].dtype == np.float32, f"{what}: blocks[{i}][{key!r}] is {g[key].dtype}, expected float32"
            np.testing.assert_array_equal(g[key], e[key], err_msg=f"{what}: blocks[{i}][{key!r}] (Conv1D is (in, out))")


@pytest.mark.parametrize("name", GPT2_CONFIGS)
def test_load_gpt2_params_from_a_state_dict(impl, name):
    hf = gpt2(name)
    got = impl(MODULE).load_gpt2_params(dict(hf.state_dict()), config=hf.config.to_dict())
    assert_same_params(got, expected_params(hf), f"{name} from hf.state_dict()")


def test_load_gpt2_params_reads_hub_style_names(impl):
    """The Hub's gpt2 checkpoint names tensors without 'transformer.', has no lm_head and keeps attn.bias buffers."""
    hf = gpt2("3heads-tied")
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    n = hf.config.n_positions
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(n, n).tril().view(1, 1, n, n)
    got = impl(MODULE).load_gpt2_params(state, config=hf.config.to_dict())
    assert_same_params(got, expected_params(hf), "Hub-style names")


@pytest.mark.parametrize("name", ["3heads-tied", "5heads-untied"])
def test_gpt2_runs_from_a_save_pretrained_folder(impl, name, tmp_path):
    hf = gpt2(name, 7)
    hf.save_pretrained(tmp_path)
    mod = impl(MODULE)
    ids = random_tokens(7, 21, hf.config.vocab_size)
    got = mod.gpt2_forward(mod.load_gpt2_params(tmp_path), ids.numpy())
    delta = np.abs(got - hf_logits(hf, ids)).max()
    assert delta < 1e-4, f"{name} loaded from save_pretrained: max |Δlogits| = {delta:.2e} (seed=7)"
