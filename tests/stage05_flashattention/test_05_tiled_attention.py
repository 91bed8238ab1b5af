"""§3: tiled attention in PyTorch equals SDPA, and never holds a T×T score matrix."""

import pytest
import torch
import torch.nn.functional as F
from stage05_helpers import peaked, qkv, reference_lse, sdpa

from labkit.device import pin_threads
from labkit.tensor_memory import TensorWatch

MODULE = "stage05_flashattention.tiled_attention"


@pytest.fixture
def one_thread():
    """Memory tests count bytes, not seconds: one thread avoids OpenMP stalls on a shared, busy CPU."""
    with pin_threads(1):
        yield


CASES = [  # seed, H, H_kv, T, block_q, block_k, causal: GQA ratios 1/2/4, T not a multiple of the blocks
    (0, 2, 2, 45, 16, 16, True),
    (1, 4, 2, 45, 16, 32, False),
    (2, 4, 1, 70, 32, 16, True),
    (3, 4, 1, 33, 64, 64, False),
    (4, 2, 1, 23, 5, 4, True),  # blocks that do not divide each other: a key tile starts on a query tile's last row
]


@pytest.mark.parametrize("seed,H,H_kv,T,block_q,block_k,causal", CASES)
def test_tiled_attention_matches_sdpa(impl, seed, H, H_kv, T, block_q, block_k, causal):
    q, k, v = qkv(seed, 2, H, H_kv, T, 16)
    o, lse = impl(MODULE).tiled_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    expected = sdpa(q, k, v, causal)
    where = f"seed={seed}, H={H}, H_kv={H_kv}, T={T}, blocks=({block_q},{block_k}), causal={causal}"
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5, msg=f"output differs from SDPA ({where})")
    torch.testing.assert_close(lse, reference_lse(q, k, causal), atol=1e-5, rtol=1e-5, msg=f"lse differs ({where})")


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_attention_keeps_the_running_max_across_tiles(impl, causal):
    q, k, v = peaked(5, 1, 4, 2, 50, 16)
    o, lse = impl(MODULE).tiled_attention(q, k, v, causal=causal, block_q=16, block_k=16)
    what = f"seed=5 causal={causal}"
    torch.testing.assert_close(o, sdpa(q, k, v, causal), atol=1e-5, rtol=1e-5, msg=f"{what}: max in the first tile")
    torch.testing.assert_close(lse, reference_lse(q, k, causal), atol=1e-4, rtol=1e-5, msg=what)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_attention_never_creates_a_TxT_tensor(impl, one_thread, causal):
    T = 512
    q, k, v = qkv(0, 1, 2, 2, T, 32)
    with TensorWatch() as watch:
        impl(MODULE).tiled_attention(q, k, v, causal=causal, block_q=64, block_k=64)
    assert watch.largest_numel < T * T, (
        f"tiled_attention created a tensor of shape {watch.largest_shape} ({watch.largest_numel} elements), "
        f"as large as a full {T}×{T} score matrix: only (block_q, block_k) tiles of scores may exist (causal={causal})"
    )


def test_tiled_attention_peak_memory_far_below_naive_at_T4096(impl, one_thread):
    T = 4096
    q, k, v = qkv(0, 1, 1, 1, T, 32)
    with TensorWatch() as naive:
        F.softmax(q @ k.transpose(-1, -2) / 32**0.5, dim=-1) @ v
    with TensorWatch() as tiled:
        impl(MODULE).tiled_attention(q, k, v, block_q=512, block_k=512)
    assert tiled.peak_bytes * 10 < naive.peak_bytes, (
        f"at T={T} the tiled version peaked at {tiled.peak_bytes / 2**20:.1f} MiB, the naive one at "
        f"{naive.peak_bytes / 2**20:.1f} MiB: expected at least 10x less (O(T·D) instead of O(T²))"
    )
