"""llama.cpp's block formats against the `gguf` package that llama.cpp maintains.

Q8_0 and Q4_0 bytes must equal gguf.quants.quantize bit for bit. For every format, the learner's
bytes must dequantize through gguf.quants.dequantize to exactly the learner's own values (the
layout is llama.cpp's). For the K-quants, the scale search must beat a slow, obvious round-to-nearest
with the same super-block structure, in every block and clearly overall.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

MOD = "stage03_quantization.llamacpp_quants"
SEEDS = [0, 1, 2]
FORMATS = ["Q8_0", "Q4_0", "Q4_K", "Q6_K"]
BYTES_PER_BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def weights(seed: int, rows: int = 6, cols: int = 768) -> np.ndarray:
    """Gaussian or heavy-tailed rows of different magnitudes, 1 % outliers ×20, an all-zero
    super-block, constant blocks of either sign, a row that is all positive, and two blocks whose
    scale is exactly 1 so that rounding ties really happen."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) if seed % 2 == 0 else rng.standard_t(3, (rows, cols))
    x *= np.logspace(-2, 0.5, rows)[rng.permutation(rows), None]
    x[rng.random(x.shape) < 0.01] *= 20
    x[0, 256:512] = 0.0
    x[1, :32], x[1, 32:64], x[1, 64:256] = 0.25, -0.75, 1.5
    x[2] = np.abs(x[2]) + 0.1
    if rows > 3:  # exact ties: with d = 1, x / d lands on k + 0.5, where roundf and trunc(x + 8.5) differ from np.round
        halves = rng.permutation(np.arange(-7, 7) + 0.5)
        x[3, :32] = np.concatenate([[127.0], halves, -halves, [0.0, 126.5, -126.5]])[:32]
        x[3, 32:64] = np.concatenate([[-8.0], halves, -halves, [0.0, 7.0, -7.5]])[:32]
    return x.astype(np.float32)


def functions(impl, fmt: str):
    mod = impl(MOD)
    return getattr(mod, f"quantize_{fmt.lower()}"), getattr(mod, f"dequantize_{fmt.lower()}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_03b_q8_0_and_q4_0_bytes_equal_gguf(impl, fmt, seed):
    x = weights(seed)
    got = functions(impl, fmt)[0](x)
    expected = quantize(x, GGMLQuantizationType[fmt])
    assert got.dtype == np.uint8 and got.shape == expected.shape, (
        f"seed={seed}: {fmt} bytes must be uint8 shaped {expected.shape} (rows, cols / block * block bytes); "
        f"got {got.dtype} {got.shape}"
    )
    bad = np.argwhere(got != expected)
    assert len(bad) == 0, (
        f"seed={seed}: {len(bad)} of {got.size} {fmt} bytes differ from gguf.quants.quantize; first at "
        f"(row, byte) {tuple(bad[0])}, byte {bad[0][1] % expected.shape[1] % BYTES_PER_BLOCK[fmt][1]} of its block "
        "(bytes 0-1 are the fp16 scale)"
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_03b_bytes_decode_in_gguf_to_your_dequantized_values(impl, fmt, seed):
    x = weights(seed)
    quantize_fn, dequantize_fn = functions(impl, fmt)
    data = quantize_fn(x)
    block, nbytes = BYTES_PER_BLOCK[fmt]
    assert data.dtype == np.uint8 and data.shape == (x.shape[0], x.shape[1] // block * nbytes), (
        f"seed={seed}: {fmt} stores {nbytes} bytes per {block} weights; expected uint8 "
        f"{(x.shape[0], x.shape[1] // block * nbytes)}, got {data.dtype} {data.shape}"
    )
    theirs = dequantize(data, GGMLQuantizationType[fmt])
    mine = dequantize_fn(data)
    assert mine.dtype == np.float32 and mine.shape == x.shape, f"seed={seed}: dequantize must give float32 {x.shape}"
    bad = np.argwhere(mine != theirs)
    assert len(bad) == 0, (
        f"seed={seed}: llama.cpp (gguf.quants.dequantize) reads your {fmt} bytes differently from your own "
        f"dequantize at {len(bad)} weights, first at {tuple(bad[0])}: {theirs[tuple(bad[0])]} vs {mine[tuple(bad[0])]}"
    )
    # and the values are a quantization of x, not any self-consistent bytes
    rel = np.linalg.norm(mine - x) / np.linalg.norm(x)
    bound = {"Q8_0": 0.02, "Q6_K": 0.06, "Q4_0": 0.3, "Q4_K": 0.25}[fmt]
    assert rel < bound, f"seed={seed}: {fmt} relative reconstruction error {rel:.3g} is above {bound}"
    assert (theirs[0, 256:512] == 0).all(), f"seed={seed}: an all-zero block must decode to exact zeros"


def _f16(v: float) -> float:
    return float(np.float32(np.float16(v)))


def rtn_q4_k(x: np.ndarray) -> np.ndarray:
    """Slow Q4_K by plain round-to-nearest: each 32-weight sub-block's min (≤ 0) and max set
    scale = (max - min) / 15; the 8 scales and 8 -mins become 6-bit multiples of fp16 d and dmin
    (the largest maps to 63); each weight rounds to the nearest of the 16 levels they define."""
    out = np.zeros(x.size, dtype=np.float64)
    flat = x.reshape(-1).astype(np.float64)
    for b in range(0, x.size, 256):
        scales, mins = [], []
        for j in range(8):
            sub = flat[b + 32 * j : b + 32 * j + 32]
            lo = min(sub.min(), 0.0)
            scales.append((sub.max() - lo) / 15)
            mins.append(-lo)
        d, dmin = _f16(max(scales) / 63), _f16(max(mins) / 63)
        for j in range(8):
            ls = min(63, round(scales[j] / d)) if d > 0 else 0
            lm = min(63, round(mins[j] / dmin)) if dmin > 0 else 0
            step, offset = d * ls, dmin * lm
            for i in range(b + 32 * j, b + 32 * j + 32):
                q = min(15, max(0, round((flat[i] + offset) / step))) if step > 0 else 0
                out[i] = step * q - offset
    return out.reshape(x.shape)


def rtn_q6_k(x: np.ndarray) -> np.ndarray:
    """Slow Q6_K by plain round-to-nearest: each 16-weight sub-block's signed absmax m gives
    scale m / -32; the 16 scales become int8 multiples of fp16 d (the largest maps to -128, at most
    127 otherwise); each weight rounds to the nearest of the levels d·sc·(-32 … 31)."""
    out = np.zeros(x.size, dtype=np.float64)
    flat = x.reshape(-1).astype(np.float64)
    for b in range(0, x.size, 256):
        scales = []
        for j in range(16):
            sub = flat[b + 16 * j : b + 16 * j + 16]
            scales.append(sub[np.abs(sub).argmax()] / -32)
        biggest = scales[int(np.abs(scales).argmax())]
        d = _f16(biggest / -128)
        for j in range(16):
            step = d * min(127, round(scales[j] / d)) if d != 0 else 0.0
            for i in range(b + 16 * j, b + 16 * j + 16):
                q = min(31, max(-32, round(flat[i] / step))) if step != 0 else 0
                out[i] = step * q
    return out.reshape(x.shape)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_03b_k_quant_scale_search_beats_round_to_nearest(impl, fmt, seed):
    x = weights(seed, rows=4, cols=512)
    got = dequantize(functions(impl, fmt)[0](x), GGMLQuantizationType[fmt]).astype(np.float64)
    rtn = (rtn_q4_k if fmt == "Q4_K" else rtn_q6_k)(x)
    err = ((got - x) ** 2).reshape(-1, 256).sum(1)
    err_rtn = ((rtn - x) ** 2).reshape(-1, 256).sum(1)
    worse = np.flatnonzero(err > err_rtn * (1 + 1e-4) + 1e-12)
    assert len(worse) == 0, (
        f"seed={seed}: in {len(worse)} of {len(err)} super-blocks your {fmt} reconstructs worse than plain "
        f"round-to-nearest (block {worse[0]}: squared error {err[worse[0]]:.4g} vs {err_rtn[worse[0]]:.4g}); "
        "the search must start from the min/max (absmax) fit and keep a candidate only if it lowers the error"
    )
    ratio = (err / np.where(err_rtn > 0, err_rtn, 1))[err_rtn > 0]  # blocks that round-to-nearest gets wrong
    assert ratio.mean() <= 0.98, (
        f"seed={seed}: your {fmt} error is on average {ratio.mean():.3f} × round-to-nearest's per super-block; "
        "the scale search (grids of nmax ± 0.1·i steps, each refitted by least squares) should cut it by more than 2 %"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_03b_rows_must_be_whole_blocks(impl, fmt):
    quantize_fn, dequantize_fn = functions(impl, fmt)
    block, _ = BYTES_PER_BLOCK[fmt]
    x = weights(0, rows=3, cols=512)
    np.testing.assert_array_equal(
        dequantize_fn(quantize_fn(x[:, :256])),
        dequantize_fn(quantize_fn(x))[:, :256],
        err_msg=f"{fmt}: blocks are independent, so the first 256 columns quantize alone to the same values",
    )
    for cols in (block + 16, 3 * block // 2):
        with pytest.raises(ValueError, match=str(block)):
            quantize_fn(np.ones((2, cols), dtype=np.float32))
