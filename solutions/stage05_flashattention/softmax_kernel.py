"""Row softmax in Triton, for rows longer than one block: the online (max, sum) in a kernel.

One program per row. Pass 1 streams the row in BLOCK-wide chunks and keeps the running max and
sum (online normalization); pass 2 streams it again and writes exp(x - m) / l. Two reads and one
write of the row, whatever its length, instead of the three passes of max, sum and normalize.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(X, Y, n_cols, BLOCK: tl.constexpr):
    """X, Y: (n_rows, n_cols) contiguous, same dtype; grid (n_rows,). Arithmetic in float32."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * n_cols
    y_row = Y + row * n_cols
    cols = tl.arange(0, BLOCK)
    m = float("-inf")  # running max and sum of exp(x - m) over the columns read so far
    l = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite from the first block on: it holds column 0
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m) / l
        tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Softmax over the last dim of a 2-D tensor with softmax_kernel.

    x: (n_rows, n_cols) float32 or float16, contiguous; block: a power of two, may be < n_cols
    returns (n_rows, n_cols), same dtype as x
    raises ValueError for any other rank, dtype, layout or block
    """
    if x.ndim != 2:
        raise ValueError(f"softmax expects a 2-D tensor (n_rows, n_cols), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"softmax supports float32 and float16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("softmax needs a contiguous tensor: call .contiguous() first")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two (tl.arange needs one), got {block}")
    y = torch.empty_like(x)
    softmax_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=block)
    return y
