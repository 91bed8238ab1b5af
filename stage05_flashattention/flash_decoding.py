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
    tl.static_assert(False, "stage05: _attend_tile — see lab.ipynb §6")


@triton.jit
def _store_partial(O_PART, LSE_PART, row, m_i, l_i, acc, offs_d, HEAD_DIM: tl.constexpr):
    """Write the chunk's normalized output and natural-log lse; an empty chunk writes 0 and -inf."""
    tl.static_assert(False, "stage05: _store_partial — see lab.ipynb §6")


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
    tl.static_assert(False, "stage05: decode_split_kernel — see lab.ipynb §6")


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
    tl.static_assert(False, "stage05: paged_decode_split_kernel — see lab.ipynb §7")


@triton.jit
def decode_reduce_kernel(O_PART, LSE_PART, O, NUM_SPLITS, HEAD_DIM: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """O_PART: (B·H, NUM_SPLITS, D) float32, LSE_PART: (B·H, NUM_SPLITS) float32 -> O: (B·H, D). grid (B·H,)."""
    tl.static_assert(False, "stage05: decode_reduce_kernel — see lab.ipynb §6")


def flash_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, num_splits: int = 4, block_n: int = 64
) -> torch.Tensor:
    """One decode step of attention over a contiguous cache, split-K then reduce.

    q: (B, H, D); k, v: (B, H_kv, S_max, D); seq_lens: (B,) int32, 1 ≤ seq_lens[b] ≤ S_max
    dtype float32 or float16 (shared by q, k, v), contiguous; D in {16, 32, 64, 128}
    returns (B, H, D) in q's dtype: sequence b attends to its keys [0, seq_lens[b]), scale 1/√D
    raises ValueError naming the offending argument for anything else
    """
    raise NotImplementedError("stage05: flash_decode — see lab.ipynb §6")


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
    raise NotImplementedError("stage05: paged_flash_decode — see lab.ipynb §7")


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
