"""Warm-up for §4: the maximum of each row, for rows longer than one block.

It has the two things the §4 worked kernel (vector add) does not show and softmax_kernel needs:
a program that loops over its row BLOCK columns at a time, and a mask whose `other=` value must
not change the answer.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def row_max_kernel(X, OUT, n_cols, BLOCK: tl.constexpr):
    """X: (n_rows, n_cols) contiguous float32 or float16; OUT: (n_rows,) float32; grid (n_rows,).

    Program r writes max(X[r, :]) to OUT[r], reading the row in BLOCK-wide chunks (n_cols need not
    be a multiple of BLOCK). Lanes past n_cols must not win the max, even when every value is negative.
    """
    tl.static_assert(False, "stage05: row_max_kernel — see lab.ipynb §4")


def row_max(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The maximum of each row with row_max_kernel (given: the wrapper pattern of §4's worked kernel).

    x: (n_rows, n_cols) float32 or float16, contiguous, n_cols >= 1; block: a power of two
    returns (n_rows,) float32
    """
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"row_max expects a 2-D tensor (n_rows, n_cols >= 1), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"row_max supports float32 and float16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("row_max needs a contiguous tensor: call .contiguous() first")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two (tl.arange needs one), got {block}")
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    row_max_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=block)
    return out
