"""FlashAttention-2 forward in Triton: a Q tile stays on chip while K/V tiles stream past it.

One program per (Q tile, batch·head). It loads its BLOCK_M queries once, then for each BLOCK_N
keys computes the score tile, folds it into a running (max, sum, output) with the online softmax
in base 2 (exp2 is the native instruction; log2(e) is folded into the scale), and never writes
the scores to memory. GQA: query head h reads KV head h // (H // H_KV). Any T: key columns and
query rows past T are masked, so T need not be a multiple of the block sizes.
"""

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2 e)


@triton.jit
def flash_attention_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    sm_scale,
    H,
    H_KV,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Q, O: (B, H, T, HEAD_DIM); K, V: (B, H_KV, T, HEAD_DIM), all contiguous; LSE: (B, H, T) float32.

    grid (cdiv(T, BLOCK_M), B * H). Writes O = softmax(Q Kᵀ · sm_scale) V and LSE = natural-log log-sum-exp.
    """
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    kv_head = (bh % H) // (H // H_KV)
    q_ptr = Q + bh.to(tl.int64) * T * HEAD_DIM
    k_ptr = K + (b * H_KV + kv_head).to(tl.int64) * T * HEAD_DIM
    v_ptr = V + (b * H_KV + kv_head).to(tl.int64) * T * HEAD_DIM

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)

    qk_scale = sm_scale * LOG2E  # scores in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Causal: key tiles past this Q tile's last row are all masked; don't even load them.
    hi = tl.minimum((start_m + 1) * BLOCK_M, T) if CAUSAL else T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_offs = cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=cols[:, None] < T, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), float32
        keep = cols[None, :] < T
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(keep, qk, float("-inf"))
        # Every row sees key 0 in the first tile, so m_new is finite and exp2 never meets -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_offs, mask=cols[:, None] < T, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(O + bh.to(tl.int64) * T * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
    lse = (m_i + tl.log2(l_i)) / LOG2E  # back to natural log
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with flash_attention_kernel, softmax scale 1/√D.

    q: (B, H, T, D); k, v: (B, H_kv, T, D); H a multiple of H_kv; D in {16, 32, 64, 128}
    dtype float32 or float16 (bfloat16 on a GPU only: the interpreter has no bf16 arithmetic), all
    the same, contiguous, on one device; block_m, block_n: powers of two ≥ 16 (tl.dot's minimum)
    returns o: (B, H, T, D) in q's dtype and lse: (B, H, T) float32 (natural log)
    raises ValueError naming the offending argument for anything else
    """
    _check(q, k, v)
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two ≥ 16 (tl.dot's minimum tile), got {block}")
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, block_m), B * H)
    flash_attention_kernel[grid](
        q, k, v, o, lse, D**-0.5, H, k.shape[1], T,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
    )  # fmt: skip
    return o, lse


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D")
    if H % k.shape[1]:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({k.shape[1]})")
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128, got {D}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v must share one dtype among float32/float16/bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("q, k, v must be contiguous: the kernel computes offsets from the shape")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
