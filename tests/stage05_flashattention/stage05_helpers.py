"""Helpers for the stage-05 tests (a module name no other stage uses)."""

import torch
import torch.nn.functional as F


def qkv(seed: int, B: int, H: int, H_kv: int, T: int, D: int, dtype=torch.float32):
    """Seeded standard-normal q (B, H, T, D) and k, v (B, H_kv, T, D) in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, T, D, generator=g).to(dtype) for h in (H, H_kv, H_kv))


def peaked(seed: int, B: int, H: int, H_kv: int, T: int, D: int):
    """q, k, v whose key 0 scores about +120 for every query and every later key about -120: the
    maximum sits in the first tile and the later tiles are so far below it that a running max
    that forgets the first tile makes exp overflow (exp(240) is past float32's range)."""
    g = torch.Generator().manual_seed(seed)
    q = 1 + 0.1 * torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H_kv, T, D, generator=g) - 30
    k[:, :, 0] += 60
    return q, k, torch.randn(B, H_kv, T, D, generator=g)


def sdpa(q, k, v, causal: bool) -> torch.Tensor:
    """The reference output: PyTorch's scaled_dot_product_attention in float32, GQA heads shared."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)


def reference_lse(q, k, causal: bool) -> torch.Tensor:
    """log Σ_j exp(q·k_j/√D) over the attended keys, from the full score matrix: (B, H, T)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.logsumexp(s, dim=-1)
