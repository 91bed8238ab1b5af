"""A Llama forward pass that reads and writes your KV cache.

The weights and the unchanged parts of the block (embeddings, RMSNorm, MLP, lm_head, the RoPE
tables) come from a loaded `labkit.model.Llama`; the attention, where the cache lives, is yours.

One convention runs through the file: every token has an absolute position, and padding has
position -1. Positions drive both RoPE and the mask, so a decode step, a prefill chunk, a
left-padded batch and (in sliding_window.py) a ring buffer all use the same code.
"""

import math

import torch

from labkit.model import Attention, Llama, apply_rope, refuse_extras, repeat_kv, rope_cos_sin


def token_positions(start: int, T: int, pad: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute positions of T tokens that follow `start` cached slots.

    start: how many slots each row's cache already holds (0 for a prefill, cache length for a decode step)
    pad:   (B,) int64 number of left-padding slots of each row, or None (no padding, B = 1)
    returns (B, T) int64: slot start + t of row b holds position start + t - pad[b], or -1 for padding.
    """
    slots = torch.arange(start, start + T)[None, :]  # (1, T)
    if pad is None:
        return slots
    positions = slots - pad[:, None]
    return positions.masked_fill(positions < 0, -1)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to.

    q_pos: (B, T) int64 positions of the queries; k_pos: (B, S) int64 positions of the keys (-1 = padding)
    window: if set, a query at p sees only keys in (p - window, p] (Mistral's sliding window)
    returns (B, 1, T, S) bool, True = attend: the key is not padding and not in the query's future.
    """
    q, k = q_pos[:, None, :, None], k_pos[:, None, None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= k > q - window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(head_dim) + mask) v, with grouped-query heads.

    q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, S, head_dim) float32, n_heads a multiple of n_kv_heads
    mask: (B, 1, T, S) bool (True = attend) or None (every key visible: a single decode query)
    returns (B, n_heads, T, head_dim). Query head h reads KV head h // (n_heads // n_kv_heads).
    A query row with no visible key (a padding slot) must come out finite, not NaN.
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if mask is not None:
        # The most negative finite number, not -inf: an all-masked row becomes uniform instead of 0/0.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ v


def attention_block(attn: Attention, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache=None):
    """Self-attention of one layer with a KV cache.

    attn:      a `labkit.model.Attention` (q_proj, k_proj, v_proj, o_proj; its config is attn.c)
    x:         (B, T, hidden) float32, already normalised by input_layernorm
    positions: (B or 1, T) int64 absolute positions of the T new tokens (see token_positions)
    mask:      (B, 1, T, S) bool over every key attention will see, or None
    cache:     a LayerCache (anything with append(k, v) -> all keys, values) or None
    returns    (B, T, hidden). Keys are rotated before they are cached, so a cached key is
               never rotated again; the cache stores n_kv_heads heads, not n_heads.
    """
    c = attn.c
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)  # (B, T, head_dim)
    q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    if cache is not None:
        k, v = cache.append(k, v)
    y = attention(q, k, v, mask)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def decoder(model: Llama, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache=None):
    """The rest of the Llama forward pass around attention_block (given). Returns logits (B, T, vocab)."""
    x = model.model.embed_tokens(input_ids)
    for i, layer in enumerate(model.model.layers):
        layer_cache = cache.layers[i] if cache is not None else None
        x = x + attention_block(layer.self_attn, layer.input_layernorm(x), positions, mask, layer_cache)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


@torch.no_grad()
def forward(model: Llama, input_ids: torch.Tensor, cache=None, pad: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, vocab) for input_ids (B, T) that follow what `cache` holds (given).

    Without a cache this is the plain full forward pass. With one, the T tokens are appended;
    pad (B,) gives each row's number of left-padding slots (generate_batched).
    """
    # Biases live in the projections and a sliding window in the mask; the other extras of real
    # checkpoints (Qwen3's qk-norm, scaled RoPE) are not in attention_block, so they are refused.
    c = model.config
    refuse_extras(c, "stage02's cached_llama", ("attention_bias", "o_proj_bias", "mlp_bias", "sliding_window"))
    T = input_ids.shape[1]
    start = 0 if cache is None else cache.length
    q_pos = token_positions(start, T, pad)
    # A single query with nothing padded and no window sees every cached key: no mask needed.
    if T == 1 and pad is None and c.sliding_window is None:
        mask = None
    else:
        mask = attention_mask(q_pos, token_positions(0, start + T, pad), c.sliding_window)
    return decoder(model, input_ids, q_pos, mask, cache)
