"""§5–§6 on the real model's attention shapes: SmolLM2-135M has 9 query heads sharing 3 KV heads
(GQA 3:1) of head_dim 64. The toy's shapes are powers of two; a kernel that assumes a head count,
a GQA ratio of 2 or D = 32 fails here. Random tensors of those shapes, against SDPA."""

import pytest
import torch
from stage05_helpers import qkv, sdpa

from labkit.checkpoint import read_config, require_real_model

# The shapes as the real model's config.json states them (make setup converts it).
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def shape():
    c = read_config(require_real_model())
    return c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]


@pytest.mark.parametrize("seed,T,causal", [(0, 45, True), (1, 33, False)])
def test_tiled_attention_on_real_shapes(impl, shape, seed, T, causal):
    H, H_kv, D = shape
    q, k, v = qkv(seed, 1, H, H_kv, T, D)
    o, _ = impl("stage05_flashattention.tiled_attention").tiled_attention(
        q, k, v, causal=causal, block_q=16, block_k=16
    )
    where = f"seed={seed}, H={H}, H_kv={H_kv}, D={D}, T={T}, causal={causal}"
    torch.testing.assert_close(o, sdpa(q, k, v, causal), atol=1e-5, rtol=1e-5, msg=where)


@pytest.mark.parametrize("seed,T,causal", [(2, 40, True), (3, 21, False)])
def test_flash_attention_on_real_shapes(impl, shape, seed, T, causal):
    H, H_kv, D = shape
    q, k, v = qkv(seed, 1, H, H_kv, T, D)
    o, _ = impl("stage05_flashattention.flash_attention").flash_attention(
        q, k, v, causal=causal, block_m=16, block_n=16
    )
    where = f"seed={seed}, H={H}, H_kv={H_kv}, D={D}, T={T}, causal={causal}"
    torch.testing.assert_close(o, sdpa(q, k, v, causal), atol=1e-5, rtol=1e-5, msg=where)


def test_flash_decode_on_real_shapes(impl, shape):
    H, H_kv, D = shape
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, H, D, generator=g)
    k, v = (torch.randn(2, H_kv, 50, D, generator=g) for _ in range(2))
    seq_lens = torch.tensor([50, 19], dtype=torch.int32)
    got = impl("stage05_flashattention.flash_decoding").flash_decode(q, k, v, seq_lens, num_splits=3, block_n=16)
    for b, n in enumerate(seq_lens.tolist()):
        want = sdpa(q[b, :, None], k[b, :, :n], v[b, :, :n], causal=False)[:, 0]
        torch.testing.assert_close(
            got[b], want, atol=1e-5, rtol=1e-5, msg=f"seed=4, H={H}, H_kv={H_kv}, D={D}, row {b}"
        )
