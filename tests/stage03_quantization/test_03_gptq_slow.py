"""§6 step 1: the slow column-by-column GPTQ equals least squares solved afresh after every quantized column."""

import pytest
import torch

MOD = "stage03_quantization.gptq"


def grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (scale, zero) per row of w (out, g), over a range that includes 0."""
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    return scale, torch.round(-lo / scale)


def least_squares_gptq(W, H, bits, group_size, percdamp=0.01):
    """After quantizing column i, the free columns j > i are whatever minimises the output error
    (W0 - W_hat) H (W0 - W_hat)ᵀ with columns 0..i held at their quantized values: one linear solve
    per column, no inverse updates. float64."""
    W0, H = W.clone().double(), H.clone().double()
    dead = H.diag() == 0
    H[dead, dead] = 1
    W0[:, dead] = 0
    H = H + percdamp * H.diag().mean() * torch.eye(len(H), dtype=H.dtype)
    n, maxq = W0.shape[1], 2**bits - 1
    current, W_hat = W0.clone(), torch.zeros_like(W0)
    for i in range(n):
        if i % group_size == 0:
            scale, zero = grid(current[:, i : i + group_size], bits)
        W_hat[:, i] = scale * (torch.clamp(torch.round(current[:, i] / scale) + zero, 0, maxq) - zero)
        if i + 1 < n:
            fixed, free = slice(0, i + 1), slice(i + 1, n)
            delta = W0[:, fixed] - W_hat[:, fixed]  # d/dD_free: D_fixed H[fixed, free] + D_free H[free, free] = 0
            current[:, free] = W0[:, free] + torch.linalg.solve(H[free, free], (delta @ H[fixed, free]).T).T
    return W_hat


def inputs(seed: int, n: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) * torch.logspace(0, -2, dim, dtype=torch.float64)
    return torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix.T


@pytest.mark.parametrize("seed,bits,group_size,dim", [(0, 3, 8, 32), (1, 4, 16, 48), (2, 2, 8, 24), (3, 3, 24, 24)])
def test_slow_gptq_equals_sequential_least_squares(impl, seed, bits, group_size, dim):
    g = torch.Generator().manual_seed(200 + seed)
    W = torch.randn(5, dim, generator=g, dtype=torch.float64)
    x = inputs(seed, 300, dim)
    H = 2 / len(x) * x.T @ x
    got = impl(MOD).gptq_quantize_slow(W, H, bits=bits, group_size=group_size)
    expected = least_squares_gptq(W, H, bits, group_size)
    torch.testing.assert_close(
        got.double(), expected, atol=1e-8, rtol=1e-8, msg=f"seed={seed}, bits={bits}, group_size={group_size}"
    )


def test_slow_gptq_zeroes_dead_inputs_and_dampens(impl):
    g = torch.Generator().manual_seed(7)
    W = torch.randn(4, 16, generator=g, dtype=torch.float64)
    x = inputs(7, 200, 16)
    x[:, [3, 11]] = 0  # two inputs that never fire: H has zero rows and columns there
    H = 2 / len(x) * x.T @ x
    got = impl(MOD).gptq_quantize_slow(W, H, bits=3, group_size=8, percdamp=0.05)
    torch.testing.assert_close(
        got.double(), least_squares_gptq(W, H, 3, 8, percdamp=0.05), atol=1e-8, rtol=1e-8, msg="seed=7, dead inputs"
    )
    assert got[:, [3, 11]].abs().max() == 0, "seed=7: weights of dead inputs must be quantized to 0"
