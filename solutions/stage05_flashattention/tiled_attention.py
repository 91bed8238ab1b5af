"""Attention on the CPU two ways: the textbook version and the tiled one FlashAttention computes.

Both take q: (B, H, T, D) and k, v: (B, H_kv, T, D) with H a multiple of H_kv (GQA: query head h
reads KV head h // (H // H_kv)). The naive version materializes the (T, T) scores of every head;
the tiled version only ever holds one (block_q, block_k) tile of them per head.
"""

import math

import torch

from labkit.model import repeat_kv


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √D) v with the full (T, T) score matrix: O(T²) memory per head.

    q: (B, H, T, D), k, v: (B, H_kv, T, D) float32 -> (B, H, T, D)
    """
    n_rep = q.shape[1] // k.shape[1]
    scores = q @ repeat_kv(k, n_rep).transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        T = q.shape[2]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(dim=-1) @ repeat_kv(v, n_rep)


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's algorithm in PyTorch: Q tiles outer loop, K/V tiles inner loop, online softmax.

    q: (B, H, T, D), k, v: (B, H_kv, T, D) float32; T need not be a multiple of the block sizes
    causal: query t attends to keys 0..t (torch's is_causal); key tiles wholly above the diagonal are skipped
    returns o: (B, H, T, D) and lse: (B, H, T) float32, lse = log Σ_j exp(q·k_j / √D) over attended keys
    invariant: no tensor with T×T elements is ever created; peak memory is O(T·D + block_q·block_k) per head
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    scale = 1.0 / math.sqrt(D)
    # Group query heads by the KV head they read, so K/V tiles broadcast instead of being copied.
    qg = q.reshape(B, H_kv, H // H_kv, T, D)
    o = torch.empty_like(qg)
    lse = torch.empty(B, H_kv, H // H_kv, T, dtype=q.dtype)
    for i in range(0, T, block_q):
        q_tile = qg[..., i : i + block_q, :] * scale  # (B, H_kv, G, bq, D)
        rows = torch.arange(i, i + q_tile.shape[-2])
        m = torch.full(q_tile.shape[:-1], float("-inf"))
        l = torch.zeros(q_tile.shape[:-1])
        acc = torch.zeros_like(q_tile)
        k_end = min(T, i + block_q) if causal else T
        for j in range(0, k_end, block_k):
            k_tile = k[:, :, None, j : j + block_k, :]  # (B, H_kv, 1, bk, D)
            v_tile = v[:, :, None, j : j + block_k, :]
            s = q_tile @ k_tile.transpose(-1, -2)  # (B, H_kv, G, bq, bk)
            if causal and j + block_k > i:  # the tile touches the diagonal
                cols = torch.arange(j, j + k_tile.shape[-2])
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v_tile
            m = m_new
        o[..., i : i + block_q, :] = acc / l[..., None]
        lse[..., i : i + block_q] = m + torch.log(l)
    return o.reshape(B, H, T, D), lse.reshape(B, H, T)
