"""The GGUF export: llama.cpp's rotary row order, its Q4_K_M tensor mix, and a file of the tiny
target that gguf.GGUFReader reads back with every tensor's bytes intact."""

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

import labkit
from labkit.checkpoint import load_state_dict

MOD = "stage03_quantization.gguf_export"
SEEDS = [0, 1, 2]


def rope_half_split(x: np.ndarray, theta: float) -> np.ndarray:
    """HF Llama's rotary embedding: dimension i rotates with i + head_dim/2. x: (T, heads, head_dim)."""
    T, _, hd = x.shape
    angle = np.arange(T)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)  # (T, hd/2)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rope_interleaved(x: np.ndarray, theta: float) -> np.ndarray:
    """llama.cpp's rotary embedding for LLM_ARCH_LLAMA: dimension 2i rotates with 2i + 1."""
    T, _, hd = x.shape
    angle = np.arange(T)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("n_head", "n_kv", "head_dim"), [(8, 2, 32), (4, 4, 16), (6, 3, 64)])
def test_03b_permute_qk_keeps_attention_scores_under_llamacpp_rope(impl, seed, n_head, n_kv, head_dim):
    rng = np.random.default_rng(seed)
    d_in, T, theta = 40, 11, float(rng.choice([10_000.0, 500_000.0]))
    wq, wk = rng.standard_normal((n_head * head_dim, d_in)), rng.standard_normal((n_kv * head_dim, d_in))
    x = rng.standard_normal((T, d_in))
    permute = impl(MOD).permute_qk
    pq, pk = permute(wq, n_head), permute(wk, n_kv)
    assert pq.shape == wq.shape and pk.shape == wk.shape, f"seed={seed}: permute_qk must keep the weight's shape"
    rep = n_head // n_kv
    scores = []
    for (q_w, k_w), rope in (((wq, wk), rope_half_split), ((pq, pk), rope_interleaved)):
        q = rope((x @ q_w.T).reshape(T, n_head, head_dim), theta)
        k = np.repeat(rope((x @ k_w.T).reshape(T, n_kv, head_dim), theta), rep, axis=1)
        scores.append(np.einsum("thd,shd->hts", q, k))
    np.testing.assert_allclose(
        scores[1], scores[0], rtol=1e-9, atol=1e-9,
        err_msg=f"seed={seed}: q·k under llama.cpp's interleaved RoPE with your permuted weights must equal "
        "q·k under HF's half-split RoPE with the original weights",
    )  # fmt: skip
    assert not np.array_equal(pq, wq), f"seed={seed}: the rows must move (head_dim {head_dim} > 2)"


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp: the first and last eighth of the layers, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def expected_type(name: str, shape: tuple[int, ...], mix: str, n_layer: int, has_output: bool = False) -> str:
    """What llama.cpp's llama_tensor_get_type picks for a plain Llama (tied embeddings unless has_output)."""
    if len(shape) == 1 or mix == "F32":
        return "F32"
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return "Q8_0" if mix == "Q8_0" else "Q6_K"
    if mix != "Q4_K_M":
        return mix
    if name == "token_embd.weight":
        return "Q4_K"
    layer = int(name.split(".")[1])
    return "Q6_K" if name.split(".")[2] in ("attn_v", "ffn_down") and use_more_bits(layer, n_layer) else "Q4_K"


@pytest.mark.parametrize("has_output", [False, True])
@pytest.mark.parametrize("n_layer", [8, 26, 32])
def test_03b_tensor_type_follows_llamacpp_mixes(impl, n_layer, has_output):
    tensor_type = impl(MOD).tensor_type
    names = ["token_embd.weight", "output_norm.weight"] + (["output.weight"] if has_output else [])
    for i in range(n_layer):
        names += [f"blk.{i}.{t}.weight" for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")]
        names += [f"blk.{i}.{t}.weight" for t in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    for mix in ("F32", "Q8_0", "Q4_0", "Q4_K_M"):
        for name in names:
            shape = (512,) if "norm" in name else (512, 768)
            want = expected_type(name, shape, mix, n_layer, has_output)
            got = tensor_type(name, shape, mix, n_layer, has_output)
            assert got == want, f"n_layer={n_layer}, has_output={has_output}, {mix}: {name} should be {want}, got {got}"
    assert tensor_type("blk.0.attn_q.weight", (64, 320), "Q4_K_M", n_layer) == "F32", (
        "a row of 320 is not a whole number of 256-weight super-blocks: that tensor must stay F32"
    )
    for shape, mix, want in (((320, 512), "Q4_K_M", "Q4_K"), ((40, 64), "Q4_0", "Q4_0"), ((64, 48), "Q8_0", "F32")):
        got = tensor_type("blk.0.attn_q.weight", shape, mix, n_layer)
        assert got == want, (
            f"{mix}: a (rows, cols) = {shape} matrix should be {want}, got {got}; blocks run along a row, "
            "so the row length (cols, the last dimension) must be a multiple of the block, whatever the row count"
        )


def reference_tensors() -> dict[str, np.ndarray]:
    """The tiny target's weights under llama.cpp's names, q/k rows permuted as convert_hf_to_gguf.py does."""
    config = json.loads((labkit.TARGET / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    short = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    out = {}
    for name, t in load_state_dict(labkit.TARGET).items():
        w = t.float().numpy()
        proj = name.split(".")[-2]
        if proj in heads:
            n = heads[proj]
            w = w.reshape(n, 2, w.shape[0] // n // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            out[f"blk.{layer}.{short[rest]}.weight"] = w
    return out


@pytest.mark.parametrize("mix", ["F32", "Q8_0", "Q4_K_M"])
def test_03b_export_tiny_target_reads_back(impl, tmp_path, mix):
    path = impl(MOD).export_gguf(labkit.TARGET, tmp_path / f"tiny-{mix}.gguf", mix)
    reader = GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    config = json.loads((labkit.TARGET / "config.json").read_text())
    tok = json.loads((labkit.TARGET / "tokenizer.json").read_text())
    assert field("general.architecture") == "llama", f"{mix}: general.architecture must be 'llama'"
    for key, value in {
        "llama.block_count": config["num_hidden_layers"], "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"], "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"], "llama.context_length": config["max_position_embeddings"],
    }.items():  # fmt: skip
        assert field(key) == value, f"{mix}: {key} is {field(key)}, the config says {value}"
    assert abs(field("llama.attention.layer_norm_rms_epsilon") - config["rms_norm_eps"]) < 1e-12, f"{mix}: rms eps"
    assert field("llama.rope.freq_base") == config["rope_parameters"]["rope_theta"], f"{mix}: rope theta"
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2", (
        f"{mix}: llama.cpp knows this byte-level BPE as model 'gpt2' with pre-tokenizer 'gpt-2'"
    )
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"], f"{mix}: one token per embedding row ({config['vocab_size']})"
    for text, i in tok["model"]["vocab"].items():
        assert tokens[i] == text, f"{mix}: token {i} must be {text!r}, got {tokens[i]!r}"
    assert len(field("tokenizer.ggml.merges")) == len(tok["model"]["merges"]), f"{mix}: every BPE merge"
    assert (field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")) == (1, 2), f"{mix}: <s>, </s>"

    expected = reference_tensors()
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(expected), (
        f"{mix}: missing {set(expected) - set(got)}, unexpected {set(got) - set(expected)}"
    )
    quants = impl("stage03_quantization.llamacpp_quants")
    for name, w in expected.items():
        t, kind = got[name], expected_type(name, w.shape, mix, config["num_hidden_layers"])
        assert t.tensor_type.name == kind, f"{mix}: {name} should be {kind}, the file has {t.tensor_type.name}"
        assert tuple(int(d) for d in t.shape) == w.shape[::-1], f"{mix}: {name} has ggml shape (cols, rows)"
        data = np.asarray(t.data).reshape(w.shape[0], -1) if w.ndim == 2 else np.asarray(t.data)
        if kind == "F32":
            np.testing.assert_array_equal(data, w, err_msg=f"{mix}: {name} must hold the weights unchanged")
            continue
        if kind in ("Q8_0", "Q4_0"):
            reference = quantize(w, GGMLQuantizationType[kind])
        else:
            reference = getattr(quants, f"quantize_{kind.lower()}")(w)
        np.testing.assert_array_equal(data, reference, err_msg=f"{mix}: {name}'s {kind} bytes did not round-trip")
        back = dequantize(data, GGMLQuantizationType[kind])
        rel = np.linalg.norm(back - w) / np.linalg.norm(w)
        assert rel < 0.1, f"{mix}: {name} decodes {rel:.3g} away from the weights (relative)"
