"""The Llama-style decoder in plain NumPy: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Same conventions as gpt2_numpy: one sequence, (T, D) activations, weights stored (d_in, d_out),
float32 everywhere. What changes from GPT-2 is four ideas, each a function below; the attention
itself (`attention`, `split_heads`, `merge_heads`) is reused unchanged.
"""

import os

import numpy as np

# Part 1's attention and linear layer work unchanged here.
from .gpt2_numpy import attention, linear, merge_heads, split_heads  # noqa: F401


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Scale each vector to unit root-mean-square over the last axis, then by `weight`.

    x: (..., D); weight: (D,); returns (..., D). No mean subtraction and no bias, unlike layer_norm.
    """
    raise NotImplementedError("stage01: rms_norm — see lab.ipynb §7")


def rope(x: np.ndarray, positions: np.ndarray, theta: float = 10_000.0) -> np.ndarray:
    """Rotate query/key vectors by their absolute positions (HF's half-split pairing).

    x: (..., T, head_dim) float32, e.g. (n_heads, T, head_dim); positions: (T,) int, absolute, so a
    decode step at cache length L passes [L]. Dimension i (< head_dim/2) rotates together with
    i + head_dim/2 by the angle position · θ^(-2i/head_dim). returns the same shape as x.
    """
    raise NotImplementedError("stage01: rope — see lab.ipynb §8")


def repeat_kv(x: np.ndarray, n_rep: int) -> np.ndarray:
    """Share each key/value head with n_rep query heads (grouped-query attention).

    x: (n_kv_heads, T, head_dim) -> (n_kv_heads · n_rep, T, head_dim); query head h reads kv head h // n_rep.
    """
    raise NotImplementedError("stage01: repeat_kv — see lab.ipynb §9")


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Llama's gated feed-forward: (silu(x @ w_gate) * (x @ w_up)) @ w_down, silu(z) = z·sigmoid(z).

    x: (T, D); w_gate, w_up: (D, F); w_down: (F, D); returns (T, D).
    """
    raise NotImplementedError("stage01: swiglu — see lab.ipynb §7")


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
    raise NotImplementedError("stage01: llama_attention — see lab.ipynb §9")


def llama_block(x: np.ndarray, layer: dict, params: dict, positions: np.ndarray) -> np.ndarray:
    """One pre-RMSNorm decoder block: x + attn(norm(x)), then x + swiglu(norm(x)).

    x: (T, D); layer: one entry of params["layers"]; params: for n_heads, n_kv_heads, eps, rope_theta.
    returns (T, D).
    """
    raise NotImplementedError("stage01: llama_block — see lab.ipynb §9")


def llama_forward(params: dict, token_ids: np.ndarray) -> np.ndarray:
    """Logits for every position of one sequence: token_ids (T,) int -> (T, vocab_size) float32.

    There are no position embeddings: positions enter only through RoPE inside attention.
    """
    raise NotImplementedError("stage01: llama_forward — see lab.ipynb §9")


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
    raise NotImplementedError("stage01: load_llama_params — see lab.ipynb §10")


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
