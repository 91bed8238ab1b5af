"""FlashDecoding: attention for one new query token per sequence over a long KV cache.

At decode time B·H programs (one per query row) are too few to fill a GPU, and each would walk
the whole cache alone. Split-K also splits the keys: program (b·h, s) attends to chunk s only and
writes a partial output O_s (normalized within the chunk) and its log-sum-exp lse_s. A second,
tiny kernel merges the chunks exactly, as merge_states does for the (max, sum) pair:

    LSE = log Σ_s exp(lse_s),    O = Σ_s exp(lse_s − LSE) · O_s

The paged variant reads K/V through a block table, from a pool laid out like stage 04's:
(num_blocks, block_size, H_kv, D), logical page j of sequence b living in physical block
block_tables[b, j]. Loading the block id and adding block_id · stride to a base pointer is ordinary
pointer arithmetic, which the interpreter supports (what it lacks is dereferencing a loaded pointer).
"""

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2 e)


@triton.jit
def _attend_tile(q, k, v, keep, m_i, l_i, acc, qk_scale):
    """Fold one tile of keys into the running state of a single query row.

    q: (D,) float32; k, v: (N, D); keep: (N,) bool; m_i, l_i: scalars; acc: (D,) float32.
    A decode row is one query, so scores are a dot product per key, not a tl.dot (which needs 16 rows).
    """
    s = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every visited tile has at least one kept key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return m_new, l_i, acc


@triton.jit
def _store_partial(O_PART, LSE_PART, row, m_i, l_i, acc, offs_d, HEAD_DIM: tl.constexpr):
    """Write the chunk's normalized output and natural-log lse; an empty chunk writes 0 and -inf."""
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    o = acc / l_safe
    tl.store(O_PART + row * HEAD_DIM + offs_d, o)
    tl.store(LSE_PART + row, lse)


@triton.jit
def decode_split_kernel(
    Q,
    K,
    V,
    SEQ_LENS,
    O_PART,
    LSE_PART,
    sm_scale,
    H,
    H_KV,
    S_MAX,
    NUM_SPLITS,
    SPLIT_SIZE,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Q: (B, H, D); K, V: (B, H_KV, S_MAX, D) with keys [0, SEQ_LENS[b]) valid; SEQ_LENS: (B,) int32.

    grid (B * H, NUM_SPLITS). Program (bh, s) attends to keys [s·SPLIT_SIZE, (s+1)·SPLIT_SIZE) ∩ [0, len)
    and writes O_PART[bh, s]: (D,) float32 and LSE_PART[bh, s] float32.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    kv_head = (bh % H) // (H // H_KV)
    seq_len = tl.load(SEQ_LENS + b)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + bh.to(tl.int64) * HEAD_DIM + offs_d).to(tl.float32)
    kv_ptr = (b * H_KV + kv_head).to(tl.int64) * S_MAX * HEAD_DIM

    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    lo = split * SPLIT_SIZE
    hi = tl.minimum(lo + SPLIT_SIZE, seq_len)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        keep = cols < hi
        offs = kv_ptr + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + offs, mask=keep[:, None], other=0.0)
        v = tl.load(V + offs, mask=keep[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, keep, m_i, l_i, acc, sm_scale * LOG2E)
    _store_partial(O_PART, LSE_PART, bh.to(tl.int64) * NUM_SPLITS + split, m_i, l_i, acc, offs_d, HEAD_DIM)


@triton.jit
def paged_decode_split_kernel(
    Q,
    K_POOL,
    V_POOL,
    BLOCK_TABLES,
    SEQ_LENS,
    O_PART,
    LSE_PART,
    sm_scale,
    H,
    H_KV,
    MAX_BLOCKS,
    NUM_SPLITS,
    PAGES_PER_SPLIT,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Q: (B, H, D); K_POOL, V_POOL: (num_blocks, PAGE_SIZE, H_KV, D); BLOCK_TABLES: (B, MAX_BLOCKS) int32.

    grid (B * H, NUM_SPLITS). Program (bh, s) attends to logical pages [s·PAGES_PER_SPLIT, (s+1)·PAGES_PER_SPLIT)
    of sequence b, one page per step, each found through the block table.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    kv_head = (bh % H) // (H // H_KV)
    seq_len = tl.load(SEQ_LENS + b)
    offs_n = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + bh.to(tl.int64) * HEAD_DIM + offs_d).to(tl.float32)
    token_stride = H_KV * HEAD_DIM

    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    first = split * PAGES_PER_SPLIT
    last = tl.minimum(first + PAGES_PER_SPLIT, tl.cdiv(seq_len, PAGE_SIZE))
    for page in range(first, last):
        block = tl.load(BLOCK_TABLES + b.to(tl.int64) * MAX_BLOCKS + page).to(tl.int64)
        keep = page * PAGE_SIZE + offs_n < seq_len
        offs = (block * PAGE_SIZE + offs_n[:, None]) * token_stride + kv_head * HEAD_DIM + offs_d[None, :]
        k = tl.load(K_POOL + offs, mask=keep[:, None], other=0.0)
        v = tl.load(V_POOL + offs, mask=keep[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, keep, m_i, l_i, acc, sm_scale * LOG2E)
    _store_partial(O_PART, LSE_PART, bh.to(tl.int64) * NUM_SPLITS + split, m_i, l_i, acc, offs_d, HEAD_DIM)


@triton.jit
def decode_reduce_kernel(O_PART, LSE_PART, O, NUM_SPLITS, HEAD_DIM: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """O_PART: (B·H, NUM_SPLITS, D) float32, LSE_PART: (B·H, NUM_SPLITS) float32 -> O: (B·H, D). grid (B·H,)."""
    bh = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE_PART + bh * NUM_SPLITS + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))  # exp(lse_s − LSE) up to the common factor Σ weights
    parts = tl.load(O_PART + (bh * NUM_SPLITS + splits[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=splits[:, None] < NUM_SPLITS, other=0.0)  # fmt: skip
    o = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    tl.store(O + bh * HEAD_DIM + offs_d, o.to(O.dtype.element_ty))


def flash_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, num_splits: int = 4, block_n: int = 64
) -> torch.Tensor:
    """One decode step of attention over a contiguous cache, split-K then reduce.

    q: (B, H, D); k, v: (B, H_kv, S_max, D); seq_lens: (B,) int32, 1 ≤ seq_lens[b] ≤ S_max
    dtype float32 or float16 (shared by q, k, v), contiguous; D in {16, 32, 64, 128}
    returns (B, H, D) in q's dtype: sequence b attends to its keys [0, seq_lens[b]), scale 1/√D
    raises ValueError naming the offending argument for anything else
    """
    _check_q(q)
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[2]:
        raise ValueError(f"k, v must both be (B, H_kv, S_max, D) matching q {tuple(q.shape)}, got {tuple(k.shape)}")
    _check_kv(q, k, v, k.shape[1])
    _check_lens(seq_lens, q.shape[0], k.shape[2])
    if num_splits < 1 or block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"num_splits must be ≥ 1 and block_n a power of two, got {num_splits}, {block_n}")
    B, H, D = q.shape
    split_size = triton.cdiv(triton.cdiv(k.shape[2], num_splits), block_n) * block_n
    o_part, lse_part = _partials(q, num_splits)
    decode_split_kernel[(B * H, num_splits)](
        q, k, v, seq_lens, o_part, lse_part, D**-0.5, H, k.shape[1], k.shape[2], num_splits, split_size,
        HEAD_DIM=D, BLOCK_N=block_n,
    )  # fmt: skip
    return _reduce(q, o_part, lse_part)


def paged_flash_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int = 4,
) -> torch.Tensor:
    """flash_decode over a paged cache: keys of sequence b at position t live in
    pool[block_tables[b, t // block_size], t % block_size].

    q: (B, H, D); k_pool, v_pool: (num_blocks, block_size, H_kv, D), block_size a power of two;
    block_tables: (B, max_blocks) int32; seq_lens: (B,) int32, 1 ≤ seq_lens[b] ≤ max_blocks · block_size
    returns (B, H, D) in q's dtype; entries of block_tables past a sequence's last page are never read
    raises ValueError naming the offending argument for anything else
    """
    _check_q(q)
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape or k_pool.shape[3] != q.shape[2]:
        raise ValueError(
            f"k_pool, v_pool must both be (num_blocks, block_size, H_kv, D) with D = {q.shape[2]}, "
            f"got {tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    _check_kv(q, k_pool, v_pool, k_pool.shape[2])
    page_size = k_pool.shape[1]
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"block_size (k_pool.shape[1]) must be a power of two, got {page_size}")
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0] or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be (B, max_blocks) int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if not block_tables.is_contiguous():
        raise ValueError("block_tables must be contiguous")
    _check_lens(seq_lens, q.shape[0], block_tables.shape[1] * page_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be ≥ 1, got {num_splits}")
    B, H, D = q.shape
    pages_per_split = triton.cdiv(block_tables.shape[1], num_splits)
    o_part, lse_part = _partials(q, num_splits)
    paged_decode_split_kernel[(B * H, num_splits)](
        q, k_pool, v_pool, block_tables, seq_lens, o_part, lse_part, D**-0.5, H, k_pool.shape[2],
        block_tables.shape[1], num_splits, pages_per_split, HEAD_DIM=D, PAGE_SIZE=page_size,
    )  # fmt: skip
    return _reduce(q, o_part, lse_part)


def _partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, D = q.shape
    o_part = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    return o_part, lse_part


def _reduce(q: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor) -> torch.Tensor:
    B, H, num_splits, D = o_part.shape
    o = torch.empty_like(q)
    decode_reduce_kernel[(B * H,)](
        o_part, lse_part, o, num_splits, HEAD_DIM=D, SPLITS_POW2=triton.next_power_of_2(num_splits)
    )
    return o


def _check_q(q: torch.Tensor) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be (B, H, D), one query token per sequence, got {tuple(q.shape)}")
    if q.shape[2] not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128, got {q.shape[2]}")
    if q.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"q must be float32 or float16, got {q.dtype}")


def _check_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h_kv: int) -> None:
    if q.shape[1] % h_kv:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({h_kv})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("q and the K/V cache must be contiguous: the kernel computes offsets from the shape")


def _check_lens(seq_lens: torch.Tensor, batch: int, capacity: int) -> None:
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be ({batch},) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > capacity:
        raise ValueError(f"seq_lens must lie in [1, {capacity}], got {seq_lens.tolist()}")
