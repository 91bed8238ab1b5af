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


# --- the TODO helpers on their own, against the spec in exact (float64) arithmetic ------------------


def sub_blocks(seed: int, group: int) -> np.ndarray:
    """Rows of `group` weights from weights(seed): mixed signs, all-positive, constant and all-zero ones."""
    return weights(seed).reshape(-1, group)


def min_scale_error(x: np.ndarray, scale: np.ndarray, m: np.ndarray, nmax: int = 15) -> np.ndarray:
    """Per row, the squared error of x ≈ scale · q - m with each q the nearest of 0 … nmax."""
    x = np.asarray(x, dtype=np.float64)
    scale, m = (np.asarray(v, dtype=np.float64).reshape(-1, 1) for v in (scale, m))
    safe = np.where(scale > 0, scale, 1)
    q = np.where(scale > 0, np.clip(np.rint((x + m) / safe), 0, nmax), 0)
    return ((scale * q - m - x) ** 2).sum(-1)


def symmetric_error(x: np.ndarray, s: np.ndarray, nmax: int = 32) -> np.ndarray:
    """Per row, the squared error of x ≈ s · q with each q the nearest of -nmax … nmax - 1."""
    x, s = np.asarray(x, dtype=np.float64), np.asarray(s, dtype=np.float64).reshape(-1, 1)
    safe = np.where(s != 0, s, 1)
    q = np.where(s != 0, np.clip(np.rint(x / safe), -nmax, nmax - 1), 0)
    return ((s * q - x) ** 2).sum(-1)


def slow_make_qkx2(row: np.ndarray, nmax: int = 15, n_grid: int = 20) -> tuple[float, float]:
    """llama.cpp's make_qkx2_quants with unit weights, one row at a time in float64: (scale, m)."""
    x = row.astype(np.float64)
    lo, hi = min(x.min(), 0.0), x.max()
    if hi == lo:
        return 0.0, -lo
    scale, mn = (hi - lo) / nmax, lo
    best = ((scale * np.clip(np.rint((x - lo) / scale), 0, nmax) + mn - x) ** 2).sum()
    for i in range(n_grid + 1):
        q = np.clip(np.rint((nmax - 1 + 0.1 * i) * (x - lo) / (hi - lo)), 0, nmax)
        n, sq, sq2, sx, sxq = len(x), q.sum(), (q * q).sum(), x.sum(), (x * q).sum()
        det = n * sq2 - sq * sq
        if det <= 0:
            continue
        a, b = (n * sxq - sx * sq) / det, (sq2 * sx - sq * sxq) / det
        if b > 0:
            a, b = sxq / sq2, 0.0
        err = ((a * q + b - x) ** 2).sum()
        if err < best:
            scale, mn, best = a, b, err
    return scale, -mn


def slow_make_qx(row: np.ndarray, nmax: int = 32, n_grid: int = 9) -> float:
    """llama.cpp's make_qx_quants with unit weights, one row at a time in float64: the signed scale."""
    x = row.astype(np.float64)
    m = x[np.abs(x).argmax()]
    if m == 0:
        return 0.0
    scale = m / -nmax
    best = ((scale * np.clip(np.rint(x / scale), -nmax, nmax - 1) - x) ** 2).sum()
    for i in range(-n_grid, n_grid + 1):
        q = np.clip(np.rint(-(nmax + 0.1 * i) * x / m), -nmax, nmax - 1)
        if (q * q).sum() == 0:
            continue
        c = (x * q).sum() / (q * q).sum()
        err = ((c * q - x) ** 2).sum()
        if err < best:
            scale, best = c, err
    return scale


@pytest.mark.parametrize("seed", SEEDS)
def test_03b_fit_min_scale_plain_fit_and_search(impl, seed):
    fit = impl(MOD).fit_min_scale
    x = sub_blocks(seed, 32)
    lo, hi = np.minimum(x.min(1), 0).astype(np.float64), x.max(1).astype(np.float64)
    scale, m = fit(x, search=False)
    assert scale.shape == m.shape == (len(x), 1), f"seed={seed}: scale and m are (n, 1); got {scale.shape}, {m.shape}"
    np.testing.assert_allclose(
        scale[:, 0], (hi - lo) / 15, rtol=1e-5, atol=1e-12,
        err_msg=f"seed={seed}: the plain fit's scale is (max - min(min, 0)) / 15 (0 for a constant row)",
    )  # fmt: skip
    np.testing.assert_allclose(
        m[:, 0], -lo, rtol=1e-6, atol=0, err_msg=f"seed={seed}: the plain fit's m is -min(min, 0)"
    )
    scale, m = fit(x, search=True)
    assert (scale >= 0).all() and (m >= 0).all(), (
        f"seed={seed}: the searched scale and m must both be ≥ 0 (Q4_K stores them unsigned); rows "
        f"{np.flatnonzero((scale < 0) | (m < 0))[:5]} are not (clip the least-squares min to ≤ 0)"
    )
    err = min_scale_error(x, scale[:, 0], m[:, 0])
    ref = np.array([slow_make_qkx2(r) for r in x])
    err_ref = min_scale_error(x, ref[:, 0], ref[:, 1])
    bad = np.flatnonzero(~np.isclose(err, err_ref, rtol=1e-3, atol=1e-10))
    assert len(bad) == 0, (
        f"seed={seed}: in {len(bad)} of {len(x)} rows the searched fit's squared error differs from "
        f"make_qkx2_quants' (row {bad[0]}: {err[bad[0]]:.5g} vs {err_ref[bad[0]]:.5g}); try every grid "
        "nmax - 1 + 0.1·i, i = 0 … n_grid, and keep a candidate only if it beats all before it"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_03b_fit_symmetric_scale_plain_fit_and_search(impl, seed):
    fit = impl(MOD).fit_symmetric_scale
    x = sub_blocks(seed, 16)
    m = x[np.arange(len(x)), np.abs(x).argmax(1)].astype(np.float64)
    s = fit(x, search=False)
    assert s.shape == (len(x), 1), f"seed={seed}: s is (n, 1); got {s.shape}"
    np.testing.assert_allclose(
        s[:, 0], m / -32, rtol=1e-6, atol=0,
        err_msg=f"seed={seed}: the plain fit is s = m / -32, m the signed value of largest magnitude",
    )  # fmt: skip
    s = fit(x, search=True)
    err = symmetric_error(x, s[:, 0])
    err_ref = symmetric_error(x, np.array([slow_make_qx(r) for r in x]))
    bad = np.flatnonzero(~np.isclose(err, err_ref, rtol=1e-3, atol=1e-10))
    assert len(bad) == 0, (
        f"seed={seed}: in {len(bad)} of {len(x)} rows the searched scale's squared error differs from "
        f"make_qx_quants' (row {bad[0]}: {err[bad[0]]:.5g} vs {err_ref[bad[0]]:.5g}); try every grid "
        "nmax + 0.1·i, i = -n_grid … n_grid, and keep a candidate only if it beats all before it"
    )


def get_scale_min_k4(q: np.ndarray, j: int) -> tuple[int, int]:
    """ggml-quants.c's get_scale_min_k4, verbatim: sub-block j's 6-bit scale and min from the 12 bytes q."""
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def test_03b_q4_k_scales_pack_like_get_scale_min_k4(impl):
    mod = impl(MOD)
    rng = np.random.default_rng(0)
    ls, lm = (rng.integers(0, 64, (64, 8)).astype(np.uint8) for _ in range(2))
    ls[0], lm[0] = 63, 0
    packed = mod.pack_q4_k_scales(ls, lm)
    assert packed.dtype == np.uint8 and packed.shape == (64, 12), f"12 uint8 per super-block; got {packed.shape}"
    for i in range(len(ls)):
        for j in range(8):
            got = get_scale_min_k4(packed[i], j)
            assert got == (ls[i, j], lm[i, j]), (
                f"row {i}, sub-block {j}: get_scale_min_k4 reads (scale, min) {got} from your bytes, "
                f"expected {(int(ls[i, j]), int(lm[i, j]))}"
            )
    b = rng.integers(0, 256, (64, 12)).astype(np.uint8)  # any 12 bytes, high bits included
    got_ls, got_lm = mod.unpack_q4_k_scales(b)
    want = np.array([[get_scale_min_k4(row, j) for j in range(8)] for row in b])
    np.testing.assert_array_equal(got_ls, want[..., 0], err_msg="unpack_q4_k_scales: scales as get_scale_min_k4")
    np.testing.assert_array_equal(got_lm, want[..., 1], err_msg="unpack_q4_k_scales: mins as get_scale_min_k4")


def nearest_level_misses(x: np.ndarray, got: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Indices of the weights (x, got: (n, group); levels: (n, L)) whose decoded value is not the
    level nearest to x (up to a rounding tie)."""
    dist = np.abs(x[..., None].astype(np.float64) - levels[:, None, :])
    mine = np.abs(x.astype(np.float64) - got)
    return np.argwhere(mine > dist.min(-1) + 1e-6 * np.abs(levels).max(-1, keepdims=True) + 1e-30)


def test_03b_encode_q4_k_scales_and_codes_follow_spec(impl):
    encode = impl(MOD).encode_q4_k
    rng = np.random.default_rng(0)
    n = 8
    blocks = (rng.standard_normal((n, 256)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)
    sub = blocks.reshape(n, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(-1), 0)
    scale = ((sub.max(-1) - lo) / 15 * rng.uniform(0.6, 1.1, (n, 8))).astype(np.float32)
    m = (-lo * rng.uniform(0.6, 1.1, (n, 8))).astype(np.float32)
    m[1] = 0  # a super-block with no min: dmin = 0, every lm = 0
    data = encode(blocks, scale, m)
    assert data.dtype == np.uint8 and data.shape == (n, 144), f"(n, 144) uint8 per super-block; got {data.shape}"
    d, dmin = (data[:, k : k + 2].copy().view("<f2").astype(np.float64)[:, 0] for k in (0, 2))
    s64, m64 = scale.astype(np.float64), m.astype(np.float64)
    np.testing.assert_array_equal(d, np.float16(s64.max(1) / 63), err_msg="d = fp16(max scale / 63)")
    np.testing.assert_array_equal(dmin, np.float16(m64.max(1) / 63), err_msg="dmin = fp16(max m / 63)")
    sm = np.array([[get_scale_min_k4(data[i, 4:16], j) for j in range(8)] for i in range(n)])
    want_ls = np.minimum(63, np.round(63 * s64 / s64.max(1, keepdims=True)))
    mmax = m64.max(1, keepdims=True)
    want_lm = np.minimum(63, np.round(63 * m64 / np.where(mmax > 0, mmax, 1)))
    np.testing.assert_array_equal(sm[..., 0], want_ls, err_msg="ls_j = round(63 · scale_j / max scale)")
    np.testing.assert_array_equal(sm[..., 1], want_lm, err_msg="lm_j = round(63 · m_j / max m) (0 when max m = 0)")
    step, offset = (d[:, None] * sm[..., 0]).reshape(-1, 1), (dmin[:, None] * sm[..., 1]).reshape(-1, 1)
    levels = step * np.arange(16) - offset  # (n·8, 16): the values the stored scales can decode to
    got = dequantize(data, GGMLQuantizationType.Q4_K).reshape(-1, 32)
    miss = nearest_level_misses(blocks.reshape(-1, 32), got, levels)
    assert len(miss) == 0, (
        f"{len(miss)} of {blocks.size} weights decode to a level that is not their nearest; each q must be "
        "round((x + dmin·lm_j) / (d·ls_j)) with the fp16-rounded d and dmin the decoder reads"
    )


def test_03b_encode_q6_k_scales_and_codes_follow_spec(impl):
    encode = impl(MOD).encode_q6_k
    rng = np.random.default_rng(0)
    n = 8
    blocks = (rng.standard_normal((n, 256)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)
    sub = blocks.reshape(n, 16, 16)
    s = (sub[np.arange(n)[:, None], np.arange(16), np.abs(sub).argmax(-1)] / -32).astype(np.float32)
    s *= rng.uniform(0.7, 1.1, (n, 16)).astype(np.float32)
    s[2, 3] = s[2, np.abs(s[2]).argmax()] * np.float32(-1)  # -s_max: 128 must clamp to 127, not wrap
    blocks[5], s[5] = 0, 0  # an all-zero super-block: d = 0, every scale 0
    data = encode(blocks, s)
    assert data.dtype == np.uint8 and data.shape == (n, 210), f"(n, 210) uint8 per super-block; got {data.shape}"
    d = data[:, 208:210].copy().view("<f2").astype(np.float64)[:, 0]
    sc = data[:, 192:208].view(np.int8).astype(np.float64)
    s64 = s.astype(np.float64)
    s_max = s64[np.arange(n), np.abs(s64).argmax(1)]
    safe = np.where(s_max != 0, s_max, 1)
    np.testing.assert_array_equal(d, np.float16(-s_max / 128), err_msg="d = fp16(s_max / -128)")
    want_sc = np.where(s_max[:, None] != 0, np.minimum(127, np.round(-128 * s64 / safe[:, None])), 0)
    np.testing.assert_array_equal(sc, want_sc, err_msg="sc_j = min(127, round(-128 · s_j / s_max)) as int8")
    levels = (d[:, None] * sc).reshape(-1, 1) * np.arange(-32, 32)  # (n·16, 64)
    got = dequantize(data, GGMLQuantizationType.Q6_K).reshape(-1, 16)
    miss = nearest_level_misses(blocks.reshape(-1, 16), got, levels)
    assert len(miss) == 0, (
        f"{len(miss)} of {blocks.size} weights decode to a level that is not their nearest; each q must be "
        "round(x / (d·sc_j)) with the fp16-rounded d the decoder reads"
    )
