"""§4 warm-up: row_max_kernel, a loop over BLOCK-wide chunks with a mask, against torch.amax."""

import pytest
import torch

MODULE = "stage05_flashattention.row_max"


@pytest.mark.parametrize(
    "seed,n_rows,n_cols,block",
    [(0, 5, 300, 64), (1, 3, 100, 128), (2, 4, 257, 16), (3, 2, 64, 64), (4, 6, 1, 32)],
)
def test_row_max_kernel_matches_torch(impl, seed, n_rows, n_cols, block):
    x = torch.randn(n_rows, n_cols, generator=torch.Generator().manual_seed(seed)) * 5
    got = impl(MODULE).row_max(x, block=block)
    torch.testing.assert_close(
        got, x.amax(dim=-1), atol=0, rtol=0, msg=f"seed={seed}, n_rows={n_rows}, n_cols={n_cols}, block={block}"
    )


@pytest.mark.parametrize("seed", [5, 6])
def test_row_max_kernel_masked_lanes_never_win_on_negative_rows(impl, seed):
    # Every value is negative: a masked lane that loads 0 (tl.load's default `other`) would win.
    x = -(torch.rand(4, 37, generator=torch.Generator().manual_seed(seed)) + 1)
    got = impl(MODULE).row_max(x, block=16)
    torch.testing.assert_close(
        got, x.amax(dim=-1), atol=0, rtol=0, msg=f"seed={seed}: all-negative rows, 37 columns in blocks of 16"
    )


@pytest.mark.parametrize("seed", [7, 8])
def test_row_max_kernel_reads_the_last_partial_block_and_its_own_row(impl, seed):
    # Each row's max sits in its last, partial block, and differs from row to row.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 70, generator=g)
    x[torch.arange(5), 64 + torch.randint(0, 6, (5,), generator=g)] = 10.0 + torch.arange(5.0)
    got = impl(MODULE).row_max(x, block=16)
    torch.testing.assert_close(got, x.amax(dim=-1), atol=0, rtol=0, msg=f"seed={seed}: max in columns 64..69")


def test_row_max_kernel_float16_input(impl):
    x = (torch.randn(3, 90, generator=torch.Generator().manual_seed(9)) * 5).half()
    got = impl(MODULE).row_max(x, block=32)
    assert got.dtype == torch.float32, f"row_max returns float32 whatever the input dtype, got {got.dtype} (seed=9)"
    torch.testing.assert_close(got, x.float().amax(dim=-1), atol=0, rtol=0, msg="seed=9: float16 input")
