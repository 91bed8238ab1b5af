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
    raise NotImplementedError("stage05: tiled_attention — see lab.ipynb §3")
