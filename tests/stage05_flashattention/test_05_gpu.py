"""On a CUDA GPU: the compiled kernels at realistic shapes (skipped on a CPU-only machine)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,D", [(1024, 64), (4096, 128), (8192, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_on_gpu_matches_sdpa(impl, dtype, T, D, causal):
    g = torch.Generator(device="cuda").manual_seed(T + D)
    q, k, v = (torch.randn(4, 32, T, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    o, _ = impl("stage05_flashattention.flash_attention").flash_attention(q, k, v, causal=causal)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    atol = 1e-2 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(
        o, expected, atol=atol, rtol=0, msg=f"seed={T + D}, T={T}, D={D}, {dtype}, causal={causal}"
    )


@pytest.mark.parametrize("S,D", [(4096, 128), (8192, 64)])
def test_flash_decode_on_gpu_matches_sdpa(impl, S, D):
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(4, 32, D, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(4, 8, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    seq_lens = torch.full((4,), S, dtype=torch.int32, device="cuda")
    got = impl("stage05_flashattention.flash_decoding").flash_decode(q, k, v, seq_lens, num_splits=16)
    expected = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=0, msg=f"seed={S}, S={S}, D={D}")
