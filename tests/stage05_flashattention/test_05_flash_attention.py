"""§5: the FlashAttention-2 forward kernel, under the interpreter on small shapes, against SDPA."""

import pytest
import torch
from stage05_helpers import peaked, qkv, reference_lse, sdpa

MODULE = "stage05_flashattention.flash_attention"


# seed, H, H_kv, T, D, BLOCK_M, BLOCK_N, causal: GQA 1/2/4, T off the block grid (and below one block), and
# causal Q tiles taller than K tiles (a Q tile's diagonal then spans several K tiles, so the last one it needs
# ends at its own last row, not at BLOCK_N past its first)
CASES = [
    (0, 2, 2, 37, 16, 16, 16, True),
    (1, 4, 2, 45, 32, 32, 16, False),
    (2, 4, 1, 50, 16, 16, 32, True),
    (3, 2, 1, 20, 64, 32, 32, False),
    (4, 4, 1, 33, 32, 16, 16, False),
    (5, 2, 1, 70, 16, 32, 16, True),
    (6, 4, 2, 40, 32, 64, 16, True),
]


@pytest.mark.parametrize("seed,H,H_kv,T,D,block_m,block_n,causal", CASES)
def test_flash_attention_matches_sdpa_fp32(impl, seed, H, H_kv, T, D, block_m, block_n, causal):
    q, k, v = qkv(seed, 1, H, H_kv, T, D)
    o, _ = impl(MODULE).flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    expected = sdpa(q, k, v, causal)
    torch.testing.assert_close(
        o, expected, atol=1e-5, rtol=1e-5,
        msg=f"seed={seed}, H={H}, H_kv={H_kv}, T={T}, D={D}, blocks=({block_m},{block_n}), causal={causal}",
    )  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_keeps_the_running_max_across_tiles(impl, causal):
    q, k, v = peaked(9, 1, 2, 1, 45, 16)
    o, _ = impl(MODULE).flash_attention(q, k, v, causal=causal, block_m=16, block_n=16)
    torch.testing.assert_close(
        o, sdpa(q, k, v, causal), atol=1e-5, rtol=1e-5, msg=f"seed=9 causal={causal}: max in the first tile"
    )


@pytest.mark.parametrize("seed,causal,block_m,block_n", [(5, True, 16, 16), (6, False, 16, 16), (10, True, 32, 16)])
def test_flash_attention_returns_logsumexp(impl, seed, causal, block_m, block_n):
    q, k, v = qkv(seed, 1, 4, 2, 40, 16)
    _, lse = impl(MODULE).flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert lse.shape == (1, 4, 40) and lse.dtype == torch.float32, (
        f"lse must be (B, H, T) float32, got {lse.shape} {lse.dtype}"
    )
    torch.testing.assert_close(
        lse,
        reference_lse(q, k, causal),
        atol=1e-5,
        rtol=1e-5,
        msg=f"natural-log lse (seed={seed}, blocks=({block_m},{block_n}))",
    )


@pytest.mark.parametrize("seed,causal,D", [(7, True, 32), (8, False, 128)])
def test_flash_attention_matches_sdpa_fp16(impl, seed, causal, D):
    q, k, v = qkv(seed, 1, 2, 1, 40, D, torch.float16)
    o, _ = impl(MODULE).flash_attention(q, k, v, causal=causal, block_m=16, block_n=32)
    assert o.dtype == torch.float16, f"output dtype must follow the input (float16), got {o.dtype}"
    expected = sdpa(q, k, v, causal)
    torch.testing.assert_close(o.float(), expected, atol=1e-2, rtol=0, msg=f"seed={seed}, causal={causal}, D={D}")


BAD_INPUTS = {
    "head_dim 24": lambda: qkv(0, 1, 2, 2, 16, 24),
    "H not a multiple of H_kv": lambda: qkv(0, 1, 3, 2, 16, 16),
    "mixed dtypes": lambda: (lambda q, k, v: (q, k.half(), v))(*qkv(0, 1, 2, 2, 16, 16)),
    "non-contiguous q": lambda: (lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v))(
        *qkv(0, 1, 2, 2, 16, 16)
    ),
    "3-D q": lambda: (lambda q, k, v: (q[0], k, v))(*qkv(0, 1, 2, 2, 16, 16)),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_flash_attention_wrapper_rejects_bad_input(impl, case):
    with pytest.raises(ValueError):
        impl(MODULE).flash_attention(*BAD_INPUTS[case](), block_m=16, block_n=16)


@pytest.mark.parametrize("block_m,block_n", [(48, 16), (16, 24), (8, 16)])
def test_flash_attention_rejects_blocks_that_tl_dot_cannot_tile(impl, block_m, block_n):
    with pytest.raises(ValueError, match="block"):
        impl(MODULE).flash_attention(*qkv(0, 1, 2, 2, 16, 16), block_m=block_m, block_n=block_n)
