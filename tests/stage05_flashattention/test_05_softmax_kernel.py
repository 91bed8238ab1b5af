"""§4: the Triton row softmax with online normalization, for rows longer than one block."""

import pytest
import torch

MODULE = "stage05_flashattention.softmax_kernel"


@pytest.mark.parametrize("seed,n_cols,block", [(0, 300, 64), (1, 100, 128), (2, 257, 16)])
def test_softmax_kernel_matches_torch_fp32(impl, seed, n_cols, block):
    x = torch.randn(4, n_cols, generator=torch.Generator().manual_seed(seed)) * 5
    got = impl(MODULE).softmax(x, block=block)
    torch.testing.assert_close(
        got, torch.softmax(x, dim=-1), atol=1e-5, rtol=1e-5, msg=f"seed={seed}, n_cols={n_cols}, block={block}"
    )


def test_softmax_kernel_keeps_the_running_max_across_blocks(impl):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 300, generator=g) - 150
    x[:, :5] += 300  # the row max is in the first block, every later block ~300 below it
    got = impl(MODULE).softmax(x, block=64)
    torch.testing.assert_close(got, torch.softmax(x, dim=-1), atol=1e-6, rtol=1e-5, msg="seed=6: max in block 0")


def test_softmax_kernel_matches_torch_fp16(impl):
    x = (torch.randn(3, 200, generator=torch.Generator().manual_seed(3)) * 5).half()
    got = impl(MODULE).softmax(x, block=64)
    assert got.dtype == torch.float16, f"expected float16 output for float16 input, got {got.dtype} (seed=3)"
    torch.testing.assert_close(got.float(), torch.softmax(x.float(), dim=-1), atol=1e-2, rtol=0, msg="seed=3")


@pytest.mark.parametrize(
    "bad,why",
    [
        (lambda: torch.randn(2, 3, 8), "3-D input"),
        (lambda: torch.randn(8, 4).t(), "non-contiguous input"),
        (lambda: torch.arange(12).reshape(3, 4), "integer dtype"),
        (lambda: torch.randn(3, 4).bfloat16(), "bfloat16 (the CPU interpreter has no bf16 arithmetic)"),
    ],
)
def test_softmax_wrapper_rejects_bad_input(impl, bad, why):
    with pytest.raises(ValueError):
        impl(MODULE).softmax(bad(), block=16)


@pytest.mark.parametrize("block", [0, 48, 96])
def test_softmax_wrapper_rejects_a_block_that_is_not_a_power_of_two(impl, block):
    with pytest.raises(ValueError, match="power of two"):
        impl(MODULE).softmax(torch.randn(2, 100), block=block)
