"""Given, not graded as yours: the Llama family's relatives, built on your llama_numpy functions.

Real checkpoints add a few extras to the decoder you wrote; each is a small given piece here,
and everything else (rms_norm, rope, repeat_kv, swiglu, attention) is your code:
- q/k/v biases (Qwen2/2.5, Llama's attention_bias also on o_proj, Qwen3's attention_bias), MLP biases;
- qk-norm: an RMSNorm over head_dim on every query and key head, before RoPE (Qwen3);
- scaled RoPE: "linear" divides every frequency by a factor, "llama3" only the low ones (Llama 3.1/3.2);
- a sliding window: a query sees only the last `window` keys (Mistral).
load_family_params refuses any config field it does not implement, so a checkpoint either runs
exactly as Hugging Face runs it or fails with the field's name.
"""

import math
import os

import numpy as np

from .gpt2_numpy import attention, linear, merge_heads, softmax, split_heads
from .llama_numpy import LINEARS, NORMS, repeat_kv, rms_norm, rope, swiglu

BIASES = tuple(name.replace(".weight", ".bias") for name in LINEARS)
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def load_family_params(source: str | os.PathLike | dict, config: dict | None = None) -> dict:
    """Weights of any labkit-supported Llama-family checkpoint (labkit.model.ARCHITECTURES), strictly.

    source: an HF folder, or a state dict {HF tensor name: array-like} with config= its config dict.
    returns load_llama_params's dict without "rope_theta", plus
        "inv_freq": (head_dim/2,) float32 RoPE frequencies, scaling applied (None: plain RoPE, use theta),
        "rope_theta": float, "window": int or None,
        and in each layer the biases (BIASES) and qk-norm weights (QK_NORMS) the checkpoint has.
    A tensor the model would not read is an error: it is a feature this file does not implement.
    """
    # Imported here: labkit's reader and config checks use torch, the forward pass must not.
    import torch

    from labkit import checkpoint
    from labkit.model import Config, expected_shapes, num_params, rope_inv_freq

    if isinstance(source, dict):
        if config is None:
            raise ValueError("load_family_params(state_dict) needs config= (the HF config dict)")
        where, state = "state dict", {k: np.asarray(v, dtype=np.float32) for k, v in source.items()}
        c = Config.from_hf(config)  # refuses every field labkit.model does not implement, by name
    else:
        where, config = source, checkpoint.read_config(source, family="llama")
        c = Config.from_hf(config)
        checkpoint.check_fits(source, num_params(c), torch.float32, config)
        state = checkpoint.load_arrays(source)
    checkpoint.check_state(state, expected_shapes(c), c.tie_word_embeddings, where)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    per_layer = LINEARS + NORMS + BIASES + QK_NORMS
    return {
        "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "inv_freq": None if c.rope_scaling is None else rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).numpy(),
        "window": c.sliding_window,
        "embed_tokens": state["embed_tokens.weight"],
        "norm.weight": state["norm.weight"],
        "lm_head": state.get("lm_head.weight", state["embed_tokens.weight"]),
        "layers": [
            {
                key: state[f"layers.{i}.{key}"].T if key in LINEARS else state[f"layers.{i}.{key}"]
                for key in per_layer
                if f"layers.{i}.{key}" in state
            }
            for i in range(c.num_hidden_layers)
        ],
    }


def rope_scaled(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Your rope, with the frequencies given instead of derived from θ (they are scaled).

    x: (..., T, head_dim); positions: (T,); inv_freq: (head_dim/2,). returns the same shape as x."""
    half = x.shape[-1] // 2
    angles = positions.astype(np.float32)[:, None] * inv_freq  # (T, half)
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def windowed_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None) -> np.ndarray:
    """Causal attention in which the query at position p sees only keys in (p - window, p].

    q: (H, Tq, head_dim); k, v: (H, Tk, head_dim), queries are the last Tq positions; returns (H, Tq, head_dim).
    Without a window this is your `attention`."""
    if window is None:
        return attention(q, k, v)
    Tq, Tk = q.shape[-2], k.shape[-2]
    q_pos, k_pos = np.arange(Tk - Tq, Tk)[:, None], np.arange(Tk)[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # (Tq, Tk)
    scores = q @ k.swapaxes(-1, -2) / np.float32(math.sqrt(q.shape[-1]))
    return softmax(np.where(visible, scores, -np.inf), axis=-1) @ v


def family_attention(x: np.ndarray, layer: dict, params: dict, positions: np.ndarray) -> np.ndarray:
    """Grouped-query attention with the checkpoint's extras. x: (T, D) normalised; returns (T, D)."""
    n_heads, n_kv = params["n_heads"], params["n_kv_heads"]
    q, k, v = (
        split_heads(linear(x, layer[f"self_attn.{n}_proj.weight"], layer.get(f"self_attn.{n}_proj.bias")), heads)
        for n, heads in (("q", n_heads), ("k", n_kv), ("v", n_kv))
    )
    if "self_attn.q_norm.weight" in layer:  # Qwen3: normalise each head before rotating it
        q = rms_norm(q, layer["self_attn.q_norm.weight"], params["eps"])
        k = rms_norm(k, layer["self_attn.k_norm.weight"], params["eps"])
    if params["inv_freq"] is None:
        q, k = rope(q, positions, params["rope_theta"]), rope(k, positions, params["rope_theta"])
    else:
        q, k = rope_scaled(q, positions, params["inv_freq"]), rope_scaled(k, positions, params["inv_freq"])
    n_rep = n_heads // n_kv
    y = windowed_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), params["window"])
    return linear(merge_heads(y), layer["self_attn.o_proj.weight"], layer.get("self_attn.o_proj.bias"))


def family_mlp(x: np.ndarray, layer: dict) -> np.ndarray:
    """Your swiglu, or with Llama's mlp_bias the same gate with a bias on each of the three linears."""
    w = {n: layer[f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")}
    if "mlp.gate_proj.bias" not in layer:
        return swiglu(x, w["gate"], w["up"], w["down"])
    gate = linear(x, w["gate"], layer["mlp.gate_proj.bias"])
    return linear(
        gate / (1.0 + np.exp(-gate)) * linear(x, w["up"], layer["mlp.up_proj.bias"]),
        w["down"],
        layer["mlp.down_proj.bias"],
    )


def family_forward(params: dict, token_ids: np.ndarray) -> np.ndarray:
    """llama_forward for any checkpoint load_family_params accepts: token_ids (T,) -> logits (T, vocab)."""
    positions = np.arange(len(token_ids))
    x = params["embed_tokens"][token_ids]
    for layer in params["layers"]:
        x = x + family_attention(rms_norm(x, layer["input_layernorm.weight"], params["eps"]), layer, params, positions)
        x = x + family_mlp(rms_norm(x, layer["post_attention_layernorm.weight"], params["eps"]), layer)
    return rms_norm(x, params["norm.weight"], params["eps"]) @ params["lm_head"].T
