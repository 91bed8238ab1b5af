"""The Llama-style decoder in plain NumPy: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Same conventions as gpt2_numpy: one sequence, (T, D) activations, weights stored (d_in, d_out),
float32 everywhere. What changes from GPT-2 is four ideas, each a function below; the attention
itself (`attention`, `split_heads`, `merge_heads`) is reused unchanged.
"""

import os

import numpy as np

from .gpt2_numpy import attention, linear, merge_heads, split_heads


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Scale each vector to unit root-mean-square over the last axis, then by `weight`.

    x: (..., D); weight: (D,); returns (..., D). No mean subtraction and no bias, unlike layer_norm.
    """
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float = 10_000.0) -> np.ndarray:
    """Rotate query/key vectors by their absolute positions (HF's half-split pairing).

    x: (..., T, head_dim) float32, e.g. (n_heads, T, head_dim); positions: (T,) int, absolute, so a
    decode step at cache length L passes [L]. Dimension i (< head_dim/2) rotates together with
    i + head_dim/2 by the angle position · θ^(-2i/head_dim). returns the same shape as x.
    """
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float32) * 2 / x.shape[-1])  # (half,)
    angles = positions.astype(np.float32)[:, None] * inv_freq  # (T, half)
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def repeat_kv(x: np.ndarray, n_rep: int) -> np.ndarray:
    """Share each key/value head with n_rep query heads (grouped-query attention).

    x: (n_kv_heads, T, head_dim) -> (n_kv_heads · n_rep, T, head_dim); query head h reads kv head h // n_rep.
    """
    return np.repeat(x, n_rep, axis=-3)


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Llama's gated feed-forward: (silu(x @ w_gate) * (x @ w_up)) @ w_down, silu(z) = z·sigmoid(z).

    x: (T, D); w_gate, w_up: (D, F); w_down: (F, D); returns (T, D).
    """
    gate = x @ w_gate
    return (gate / (1.0 + np.exp(-gate)) * (x @ w_up)) @ w_down


def llama_attention(
    x: np.ndarray,
    wq: np.ndarray,
    wk: np.ndarray,
    wv: np.ndarray,
    wo: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    positions: np.ndarray,
    theta: float = 10_000.0,
) -> np.ndarray:
    """Causal grouped-query self-attention with RoPE on q and k (no biases).

    x: (T, D); wq: (D, n_heads·head_dim); wk, wv: (D, n_kv_heads·head_dim); wo: (n_heads·head_dim, D);
    positions: (T,) absolute positions of the rows of x. returns (T, D).
    """
    q = rope(split_heads(linear(x, wq), n_heads), positions, theta)  # (n_heads, T, head_dim)
    k = rope(split_heads(linear(x, wk), n_kv_heads), positions, theta)  # (n_kv_heads, T, head_dim)
    v = split_heads(linear(x, wv), n_kv_heads)
    n_rep = n_heads // n_kv_heads
    return linear(merge_heads(attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))), wo)


def llama_block(x: np.ndarray, layer: dict, params: dict, positions: np.ndarray) -> np.ndarray:
    """One pre-RMSNorm decoder block: x + attn(norm(x)), then x + swiglu(norm(x)).

    x: (T, D); layer: one entry of params["layers"]; params: for n_heads, n_kv_heads, eps, rope_theta.
    returns (T, D).
    """
    h = rms_norm(x, layer["input_layernorm.weight"], params["eps"])
    x = x + llama_attention(
        h,
        layer["self_attn.q_proj.weight"],
        layer["self_attn.k_proj.weight"],
        layer["self_attn.v_proj.weight"],
        layer["self_attn.o_proj.weight"],
        params["n_heads"],
        params["n_kv_heads"],
        positions,
        params["rope_theta"],
    )
    h = rms_norm(x, layer["post_attention_layernorm.weight"], params["eps"])
    return x + swiglu(h, layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"], layer["mlp.down_proj.weight"])


def llama_forward(params: dict, token_ids: np.ndarray) -> np.ndarray:
    """Logits for every position of one sequence: token_ids (T,) int -> (T, vocab_size) float32.

    There are no position embeddings: positions enter only through RoPE inside attention.
    """
    positions = np.arange(len(token_ids))
    x = params["embed_tokens"][token_ids]
    for layer in params["layers"]:
        x = llama_block(x, layer, params, positions)
    return rms_norm(x, params["norm.weight"], params["eps"]) @ params["lm_head"].T


LINEARS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def load_llama_params(source: str | os.PathLike | dict, config: dict | None = None) -> dict:
    """Llama-family weights as the dict `llama_forward` reads, from an HF folder or a state dict.

    source: a folder written by `save_pretrained` (e.g. labkit.TARGET), or a state dict
            {HF tensor name: array-like}; config: the HF config dict, required with a state dict.
            For a folder, `_read_folder` (given) returns (config, arrays).

    returns {
        "n_heads", "n_kv_heads", "head_dim": int, "eps": float (rms_norm_eps),
        "rope_theta": float (config["rope_parameters"]["rope_theta"], or a top-level "rope_theta"),
        "embed_tokens": (V, D), "norm.weight": (D,),
        "lm_head": (V, D)   the same array as "embed_tokens" when the file has no lm_head.weight,
        "layers": one dict per layer, keys LINEARS + NORMS named as in HF after "model.layers.{i}.",
    }, every array float32. HF's nn.Linear stores (d_out, d_in), so the seven LINEARS are
    transposed to the (d_in, d_out) layout `linear` expects.
    """
    if isinstance(source, dict):
        if config is None:
            raise ValueError("load_llama_params(state_dict) needs config= (the HF config dict)")
        state = source
    else:
        config, state = _read_folder(source)
    rope_parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or rope_parameters  # the Hub's 4.x files, or 5.x
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not implemented here; only default RoPE is")
    state = {k.removeprefix("model."): np.asarray(v, dtype=np.float32) for k, v in state.items()}
    n_heads = int(config["num_attention_heads"])
    return {
        "n_heads": n_heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or n_heads),
        "head_dim": int(config.get("head_dim") or config["hidden_size"] // n_heads),
        "eps": float(config["rms_norm_eps"]),
        "rope_theta": float(rope_parameters.get("rope_theta", config.get("rope_theta", 10_000.0))),
        "embed_tokens": state["embed_tokens.weight"],
        "norm.weight": state["norm.weight"],
        "lm_head": state.get("lm_head.weight", state["embed_tokens.weight"]),
        "layers": [
            {
                **{key: state[f"layers.{i}.{key}"].T for key in LINEARS},
                **{key: state[f"layers.{i}.{key}"] for key in NORMS},
            }
            for i in range(config["num_hidden_layers"])
        ],
    }


def _read_folder(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """config.json and float32 arrays of an HF folder (labkit reads safetensors, bf16 included),
    after check_plain_llama."""
    # Imported here, not at the top: labkit's reader uses torch, the forward pass must not.
    from labkit.checkpoint import check_unused, load_arrays, read_config
    from labkit.model import Config, expected_shapes

    config = read_config(path, family="llama")
    check_plain_llama(config)
    arrays = load_arrays(path)
    check_unused(arrays, {**expected_shapes(Config.from_hf(config)), "lm_head.weight": None}, path)
    return config, arrays


def check_plain_llama(config: dict) -> None:
    """Refuse a config.json with a feature llama_forward does not compute (given).

    Biases, qk-norm, scaled RoPE and a sliding window are real (Qwen2, Qwen3, Llama 3.1+, Mistral);
    families.py (given) runs them on top of your functions. Anything unknown is refused outright."""
    # Imported here for the same reason as in _read_folder.
    from labkit.model import Config

    c = Config.from_hf(config)  # refuses model types, activations and RoPE types nobody implements
    extras = {
        "attention_bias": c.attention_bias or c.o_proj_bias,
        "mlp_bias": c.mlp_bias,
        "qk_norm (model_type qwen3)": c.qk_norm,
        "sliding_window": c.sliding_window,
        "rope_scaling": c.rope_scaling,
    }
    for field, value in extras.items():
        if value:
            raise ValueError(
                f"config.json has {field}={value!r}, which llama_forward does not compute. Load this "
                "checkpoint with families.load_family_params and run families.family_forward (given)."
            )
