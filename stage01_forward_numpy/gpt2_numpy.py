"""GPT-2's forward pass in plain NumPy: every matrix multiply of a decoder, nothing hidden.

Conventions used throughout the stage:
- one sequence at a time: token_ids (T,), activations (T, D), logits (T, V); the elementwise
  functions accept any leading dimensions;
- every weight matrix of a linear layer is stored (d_in, d_out), so a layer is `x @ W + b`;
- all arrays are float32, and every function returns float32.

The parameters are a plain dict (see `load_gpt2_params`), so any checkpoint that can be turned
into arrays runs here, and this module never imports torch.
"""

import os

import numpy as np


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x) / sum(exp(x)) along `axis`, without overflow for any finite input.

    x: (..., N) float32; returns the same shape, non-negative, summing to 1 along `axis`.
    """
    raise NotImplementedError("stage01: softmax — see lab.ipynb §1")


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Normalise each vector to mean 0 and variance 1 over the last axis, then scale and shift.

    x: (..., D); weight, bias: (D,); returns (..., D). The variance is the biased one (divide by D).
    """
    raise NotImplementedError("stage01: layer_norm — see lab.ipynb §2")


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU in the tanh approximation GPT-2 was trained with (HF "gelu_new").

    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); x: any shape, returns the same shape.
    """
    raise NotImplementedError("stage01: gelu — see lab.ipynb §2")


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """An affine layer: x @ weight + bias.

    x: (..., d_in); weight: (d_in, d_out); bias: (d_out,) or None; returns (..., d_out).
    """
    raise NotImplementedError("stage01: linear — see lab.ipynb §2")


def split_heads(x: np.ndarray, n_head: int) -> np.ndarray:
    """(T, n_head·head_dim) -> (n_head, T, head_dim): head h owns columns [h·head_dim, (h+1)·head_dim)."""
    raise NotImplementedError("stage01: split_heads — see lab.ipynb §3")


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(n_head, T, head_dim) -> (T, n_head·head_dim), the inverse of split_heads."""
    raise NotImplementedError("stage01: merge_heads — see lab.ipynb §3")


def attention_weights(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Causal attention probabilities softmax(q·kᵀ / √head_dim) with future keys masked out.

    q: (H, Tq, head_dim); k: (H, Tk, head_dim) with Tk >= Tq. The queries are the LAST Tq positions
    of the Tk keys, so query i sits at position Tk - Tq + i and sees keys 0 .. Tk - Tq + i.
    returns (H, Tq, Tk); each row sums to 1 and is exactly 0 on masked keys.
    """
    raise NotImplementedError("stage01: attention_weights — see lab.ipynb §3")


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal scaled dot-product attention: attention_weights(q, k) @ v.

    q: (H, Tq, head_dim); k, v: (H, Tk, head_dim), Tk >= Tq; returns (H, Tq, head_dim).
    """
    raise NotImplementedError("stage01: attention — see lab.ipynb §3")


def multi_head_attention(
    x: np.ndarray, w_qkv: np.ndarray, b_qkv: np.ndarray, w_out: np.ndarray, b_out: np.ndarray, n_head: int
) -> np.ndarray:
    """GPT-2's causal self-attention sublayer (HF `attn`): project, split heads, attend, merge, project.

    x: (T, D); w_qkv: (D, 3D), b_qkv: (3D,) produce q, k, v side by side in that order;
    w_out: (D, D), b_out: (D,); returns (T, D).
    """
    raise NotImplementedError("stage01: multi_head_attention — see lab.ipynb §3")


def mlp(x: np.ndarray, w_fc: np.ndarray, b_fc: np.ndarray, w_proj: np.ndarray, b_proj: np.ndarray) -> np.ndarray:
    """GPT-2's feed-forward sublayer: gelu(x @ w_fc + b_fc) @ w_proj + b_proj.

    x: (T, D); w_fc: (D, F), b_fc: (F,); w_proj: (F, D), b_proj: (D,); returns (T, D).
    """
    raise NotImplementedError("stage01: mlp — see lab.ipynb §4")


def transformer_block(x: np.ndarray, block: dict, n_head: int, eps: float = 1e-5) -> np.ndarray:
    """One pre-LayerNorm decoder block with both residual connections.

    x: (T, D); block: one entry of params["blocks"] (see load_gpt2_params); returns (T, D).
    x + attn(ln_1(x)), then x + mlp(ln_2(x)).
    """
    raise NotImplementedError("stage01: transformer_block — see lab.ipynb §4")


def gpt2_forward(params: dict, token_ids: np.ndarray) -> np.ndarray:
    """Logits for every position of one sequence.

    params: as returned by load_gpt2_params; token_ids: (T,) int.
    returns (T, vocab_size) float32: row t scores the token that follows token_ids[: t + 1].
    Raises ValueError, naming n_positions, when T is longer than the position table params["wpe"]:
    GPT-2 has no position beyond it, so there is nothing correct to compute.
    """
    raise NotImplementedError("stage01: gpt2_forward — see lab.ipynb §4")


BLOCK_KEYS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)


def load_gpt2_params(source: str | os.PathLike | dict, config: dict | None = None) -> dict:
    """GPT-2 weights as the dict `gpt2_forward` reads, from an HF folder or a state dict.

    source: a folder written by `save_pretrained` (config.json + model.safetensors), or a state
            dict {HF tensor name: array-like}, with or without the "transformer." prefix.
    config: the HF config dict; required with a state dict. For a folder, `_read_folder` (given)
            returns (config, arrays).

    returns {
        "n_head": int, "eps": float (config's layer_norm_epsilon),
        "wte": (V, D), "wpe": (n_positions, D), "ln_f.weight": (D,), "ln_f.bias": (D,),
        "lm_head": (V, D)   the output embedding; the same array as "wte" when the file has none,
        "blocks": one dict per layer with the keys BLOCK_KEYS, named as in HF after "h.{i}.",
    }, every array float32. HF's Conv1D stores its weight (d_in, d_out), the layout `linear`
    expects, so c_attn, c_proj and c_fc need no transpose (an nn.Linear would).
    """
    raise NotImplementedError("stage01: load_gpt2_params — see lab.ipynb §5")


def _read_folder(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """config.json and float32 arrays of an HF folder (labkit reads safetensors), after check_config."""
    # Imported here, not at the top: labkit's reader uses torch, the forward pass must not.
    from labkit.checkpoint import load_arrays, read_config

    config = read_config(path, family="gpt2")
    check_config(config)
    arrays = load_arrays(path)
    check_tensors(arrays, config)
    return config, arrays


# The GPT-2 config.json flags this file implements, with the one value each may take (every GPT-2
# size, small to xl, uses these). "gelu_pytorch_tanh" is the same tanh formula as "gelu_new".
FLAGS = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
}


def check_tensors(arrays: dict, config: dict) -> None:
    """Refuse a file holding a tensor gpt2_forward would not read: a feature it does not implement.
    Old checkpoints' causal-mask buffers (attn.bias, attn.masked_bias) are not weights and may stay."""
    names = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"}
    names |= {f"h.{i}.{key}" for i in range(config["n_layer"]) for key in BLOCK_KEYS}
    names |= {f"h.{i}.attn.{buf}" for i in range(config["n_layer"]) for buf in ("bias", "masked_bias")}
    unused = sorted(k for k in arrays if k.removeprefix("transformer.") not in names)
    if unused:
        raise ValueError(f"the checkpoint holds tensors gpt2_forward does not use: {unused[:5]}; it is not plain GPT-2")


def check_config(config: dict) -> None:
    """Refuse a config.json whose flags change the maths away from what gpt2_forward computes."""
    defaults = {"activation_function": "gelu_new", "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}
    for field, allowed in FLAGS.items():
        value = config.get(field, defaults[field])
        if value not in allowed:
            raise ValueError(
                f"config.json has {field}={value!r}, which gpt2_numpy does not implement (supported: "
                f"{' or '.join(map(repr, allowed))}); its logits would not match Hugging Face's."
            )
