"""llama.cpp's block formats, byte for byte: Q8_0, Q4_0 and the K-quants Q4_K and Q6_K.

A GGUF tensor is a sequence of fixed-size blocks laid end to end along each row. Every function
here maps float32 weights (rows, cols) to the exact bytes llama.cpp reads, shaped (rows, cols /
block_size * block_bytes) uint8 like `gguf.quants.quantize`, and back.

    Q8_0   32 weights:  d fp16 | 32 × int8                                      34 B =  8.5 bits/weight
    Q4_0   32 weights:  d fp16 | 16 B of nibbles (weight j low, j + 16 high)    18 B =  4.5 bits/weight
    Q4_K  256 weights:  d fp16 | dmin fp16 | 12 B: 8 × (6-bit scale, 6-bit min) | 128 B nibbles
                                                                                144 B =  4.5 bits/weight
    Q6_K  256 weights:  128 B low nibbles | 64 B high 2-bit pairs | 16 × int8 scale | d fp16
                                                                                210 B = 6.5625 bits/weight

The K-quants spend their bits on two levels of scales: a 256-weight super-block keeps one fp16
scale, and each sub-block (32 weights for Q4_K, 16 for Q6_K) a small integer multiple of it.
"""

import numpy as np

QK = 32  # weights per Q8_0 / Q4_0 block
QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {
    "Q8_0": 2 + QK,
    "Q4_0": 2 + QK // 2,
    "Q4_K": 2 + 2 + 12 + QK_K // 2,
    "Q6_K": QK_K // 2 + QK_K // 4 + QK_K // 16 + 2,
}
BLOCK_SIZE = {"Q8_0": QK, "Q4_0": QK, "Q4_K": QK_K, "Q6_K": QK_K}


# --- given plumbing: blocks in and out, fp16 bytes, C's rounding -----------------------------------


def as_blocks(x: np.ndarray, fmt: str) -> np.ndarray:
    """x (..., cols) float -> (n_blocks, block_size) float32, in row-major order.

    Raises ValueError unless cols is a multiple of fmt's block size: llama.cpp quantizes each row
    on its own, so a block never straddles two rows.
    """
    x = np.asarray(x)
    size = BLOCK_SIZE[fmt]
    if x.ndim == 0 or x.shape[-1] % size != 0:
        raise ValueError(
            f"{fmt} needs rows whose length is a multiple of {size}; got shape {x.shape}. "
            f"Keep such a tensor in F16/F32 or pad its rows to a multiple of {size}."
        )
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, size)


def from_blocks(blocks: np.ndarray, shape: tuple[int, ...], fmt: str) -> np.ndarray:
    """(n_blocks, block_bytes) uint8 -> (..., cols / block_size * block_bytes), rows as in `shape`."""
    assert blocks.dtype == np.uint8 and blocks.shape[1] == BLOCK_BYTES[fmt], (blocks.dtype, blocks.shape)
    return blocks.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE[fmt] * BLOCK_BYTES[fmt])


def byte_blocks(data: np.ndarray, fmt: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Quantized bytes (..., n_bytes) uint8 -> ((n_blocks, block_bytes) uint8, float shape (..., cols))."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.ndim == 0 or data.shape[-1] % BLOCK_BYTES[fmt] != 0:
        raise ValueError(f"{fmt} rows are whole {BLOCK_BYTES[fmt]}-byte blocks; got bytes of shape {data.shape}")
    shape = (*data.shape[:-1], data.shape[-1] // BLOCK_BYTES[fmt] * BLOCK_SIZE[fmt])
    return data.reshape(-1, BLOCK_BYTES[fmt]), shape


def fp16_bytes(v: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8: the value rounded to fp16 (to nearest even, as ggml does), little-endian."""
    return v.astype("<f2").view(np.uint8).reshape(len(v), 2)


def fp16_value(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n, 1) float32: the inverse of fp16_bytes."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32).reshape(len(b), 1)


def roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: to nearest, ties away from zero (np.round rounds ties to even), exactly in float32."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= 0.5, t + np.sign(v), t)


def inverse(d: np.ndarray) -> np.ndarray:
    """1 / d in float32, and 0 where d == 0 (an all-zero block), as ggml computes `id`."""
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b elementwise in float32, and 0 where b == 0 (a sub-block whose stored scale is 0)."""
    a, b = np.broadcast_arrays(a, b)
    return np.divide(a, b, out=np.zeros(a.shape, np.float32), where=b != 0)


def _better(blocks: np.ndarray, encodings: list[np.ndarray], dequantize) -> np.ndarray:
    """Per block, the encoding (n, block_bytes) whose dequantization has the least squared error (first on ties)."""
    err = np.stack([((dequantize(e) - blocks) ** 2).sum(axis=1) for e in encodings])
    return np.stack(encodings)[err.argmin(axis=0), np.arange(len(blocks))]


# --- Q8_0 ------------------------------------------------------------------------------------------


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0: per 32 weights, d = absmax / 127 and q = roundf(x · (1/d)) in int8 (so |q| ≤ 127).

    x: (..., cols) float32, cols % 32 == 0 -> (..., cols / 32 * 34) uint8, each block d fp16 then 32 int8.
    Bit for bit what ggml's quantize_row_q8_0_ref writes: 1/d is taken in float32 (`inverse`, 0 for an
    all-zero block) from the float32 d, not from its fp16 rounding.
    """
    blocks = as_blocks(x, "Q8_0")
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    q = roundf(blocks * inverse(d)).astype(np.int8)
    return from_blocks(np.concatenate([fp16_bytes(d), q.view(np.uint8)], axis=1), x.shape, "Q8_0")


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """(..., n_bytes) uint8 in Q8_0 -> (..., cols) float32: d · q."""
    blocks, shape = byte_blocks(data, "Q8_0")
    d, q = fp16_value(blocks[:, :2]), blocks[:, 2:].view(np.int8)
    return (d * q.astype(np.float32)).reshape(shape)


# --- Q4_0 ------------------------------------------------------------------------------------------


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """Q4_0: per 32 weights, the signed value m of largest magnitude sets d = m / -8, so m itself
    lands on code 0 (level -8) and the other side gets levels up to +7; q = min(15, trunc(x · (1/d) + 8.5)).

    x: (..., cols) float32, cols % 32 == 0 -> (..., cols / 32 * 18) uint8: d fp16, then byte j
    holds weight j in its low nibble and weight j + 16 in its high nibble.
    """
    blocks = as_blocks(x, "Q4_0")
    m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    d = m / np.float32(-8)
    q = np.minimum(15, np.trunc(blocks * inverse(d) + np.float32(8.5))).astype(np.uint8)
    qs = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return from_blocks(np.concatenate([fp16_bytes(d), qs], axis=1), x.shape, "Q4_0")


def dequantize_q4_0(data: np.ndarray) -> np.ndarray:
    """(..., n_bytes) uint8 in Q4_0 -> (..., cols) float32: d · (q - 8)."""
    blocks, shape = byte_blocks(data, "Q4_0")
    d, qs = fp16_value(blocks[:, :2]), blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * (q - 8)).reshape(shape)


# --- Q4_K ------------------------------------------------------------------------------------------


def fit_min_scale(
    x: np.ndarray, search: bool = True, nmax: int = 15, n_grid: int = 20
) -> tuple[np.ndarray, np.ndarray]:
    """Fit each row of x as x ≈ scale · q - m, q = clamp(round((x + m) / scale), 0, nmax), m ≥ 0.

    x: (n, group) float32 -> scale (n, 1), m (n, 1) float32, both ≥ 0.
    The plain fit (search=False) is min/max round-to-nearest: min = min(x, 0), scale = (max - min) / nmax,
    m = -min. A constant row takes scale 0 and m = -min (its value, if negative, rides on the min).
    With search=True, the scale search of llama.cpp's make_qkx2_quants, with unit weights: try grids
    of nmax - 1 + 0.1·i steps over [min, max] (i = 0 … n_grid); for each, take its rounded codes and
    solve least squares for (scale, min) (min clipped to ≤ 0, then the scale refitted alone); keep a
    candidate only if its squared error is below the plain fit's and every earlier candidate's.
    """
    lo = np.minimum(x.min(axis=1, keepdims=True), 0)
    span = x.max(axis=1, keepdims=True) - lo
    shifted = (x - lo) * inverse(span)  # in [0, 1]
    scale, mn = span / np.float32(nmax), lo
    if search:
        n, sum_x = x.shape[1], x.sum(-1, keepdims=True)
        best_err = ((scale * np.clip(np.rint(nmax * shifted), 0, nmax) + mn - x) ** 2).sum(-1, keepdims=True)
        for step in (nmax - 1 + 0.1 * np.arange(n_grid + 1)).astype(np.float32):
            q = np.clip(np.rint(step * shifted), 0, nmax)
            sum_q, sum_q2, sum_xq = (
                q.sum(-1, keepdims=True),
                (q * q).sum(-1, keepdims=True),
                (q * x).sum(-1, keepdims=True),
            )
            det = n * sum_q2 - sum_q * sum_q  # least squares for x ≈ c_scale · q + c_min
            safe = np.where(det > 0, det, 1)
            c_scale = (n * sum_xq - sum_x * sum_q) / safe
            c_min = (sum_q2 * sum_x - sum_q * sum_xq) / safe
            positive = c_min > 0  # the min must stay ≤ 0: refit the scale alone with min = 0
            c_scale = np.where(positive, sum_xq / np.where(sum_q2 > 0, sum_q2, 1), c_scale)
            c_min = np.where(positive, 0, c_min)
            c_err = ((c_scale * q + c_min - x) ** 2).sum(-1, keepdims=True)
            better = (c_err < best_err) & (det > 0)
            scale, mn, best_err = (
                np.where(better, c_scale, scale),
                np.where(better, c_min, mn),
                np.where(better, c_err, best_err),
            )
    flat = span == 0
    return np.where(flat, 0, scale).astype(np.float32), np.where(flat, -lo, -mn).astype(np.float32)


def pack_q4_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins per super-block -> 12 bytes (get_scale_min_k4's layout).

    ls, lm: (n, 8) uint8 in [0, 63] -> (n, 12) uint8:
      bytes 0-3:  ls[0:4] in the low 6 bits, the top 2 bits of ls[4:8] above them
      bytes 4-7:  lm[0:4] likewise, with the top 2 bits of lm[4:8]
      bytes 8-11: the low 4 bits of ls[4:8], and the low 4 bits of lm[4:8] in the high nibble
    """
    b = np.empty((len(ls), 12), dtype=np.uint8)
    b[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    b[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    b[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return b


def unpack_q4_k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) uint8 -> ls, lm (n, 8) uint8: the inverse of pack_q4_k_scales."""
    ls = np.concatenate([b[:, 0:4] & 0x3F, (b[:, 8:12] & 0x0F) | ((b[:, 0:4] >> 6) << 4)], axis=1)
    lm = np.concatenate([b[:, 4:8] & 0x3F, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def encode_q4_k(blocks: np.ndarray, scale: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks from weights and their float sub-block fits: weight = d·ls_j · q - dmin·lm_j, q in [0, 15].

    blocks: (n, 256) float32; scale, m: (n, 8) float32 ≥ 0, sub-block j ≈ scale_j · q - m_j.
    1. ls_j = round(63 · scale_j / max scale), lm_j = round(63 · m_j / max m), both ≤ 63; d = max scale / 63,
       dmin = max m / 63, stored in fp16 (a zero max gives 0 and zero codes);
    2. each weight: q = clamp(round((x + dmin·lm_j) / (d·ls_j)), 0, 15) with the stored (rounded) scales.
    returns (n, 144) uint8: d fp16 | dmin fp16 | 12 B packed scales | 128 B: byte l of chunk c holds
    sub-block 2c's weight l in its low nibble and sub-block 2c+1's weight l in its high nibble.
    """
    n = len(blocks)
    max_scale, max_m = scale.max(axis=1, keepdims=True), m.max(axis=1, keepdims=True)
    ls = np.minimum(63, np.rint(scale * (np.float32(63) * inverse(max_scale)))).astype(np.uint8)
    lm = np.minimum(63, np.rint(m * (np.float32(63) * inverse(max_m)))).astype(np.uint8)
    d_bytes, dmin_bytes = fp16_bytes(max_scale / np.float32(63)), fp16_bytes(max_m / np.float32(63))
    step = fp16_value(d_bytes) * ls  # (n, 8): what the decoder will multiply by
    offset = fp16_value(dmin_bytes) * lm
    sub = blocks.reshape(n, 8, 32)
    q = np.clip(np.rint(divide(sub + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    return np.concatenate([d_bytes, dmin_bytes, pack_q4_k_scales(ls, lm), qs], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K: 256-weight super-blocks of 8 sub-blocks of 32, each sub-block fitted by the scale search.

    x: (..., cols) float32, cols % 256 == 0 -> (..., cols / 256 * 144) uint8 (layout in encode_q4_k).
    Rounding the 8 fitted scales to 6 bits can, rarely, undo the search's gain, so each super-block
    is also encoded from the plain min/max fits and keeps whichever of the two reconstructs it
    better: never worse than round-to-nearest, block by block.
    """
    blocks = as_blocks(x, "Q4_K")
    sub = blocks.reshape(-1, 32)
    best = _better(
        blocks,
        [encode_q4_k(blocks, *(v.reshape(-1, 8) for v in fit_min_scale(sub, search=s))) for s in (True, False)],
        dequantize_q4_k,
    )
    return from_blocks(best, x.shape, "Q4_K")


def dequantize_q4_k(data: np.ndarray) -> np.ndarray:
    """(..., n_bytes) uint8 in Q4_K -> (..., cols) float32: d·ls_j · q - dmin·lm_j per sub-block j."""
    blocks, shape = byte_blocks(data, "Q4_K")
    n = len(blocks)
    d, dmin = fp16_value(blocks[:, 0:2]), fp16_value(blocks[:, 2:4])
    ls, lm = unpack_q4_k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return ((d * ls)[..., None] * q - (dmin * lm)[..., None]).reshape(shape)


# --- Q6_K ------------------------------------------------------------------------------------------


def fit_symmetric_scale(x: np.ndarray, search: bool = True, nmax: int = 32, n_grid: int = 9) -> np.ndarray:
    """Fit each row of x as x ≈ s · q, q = clamp(round(x / s), -nmax, nmax - 1), s signed.

    x: (n, group) float32 -> s (n, 1) float32 (0 for an all-zero row).
    The plain fit (search=False) is absmax round-to-nearest: s = m / -nmax, m the signed value of
    largest magnitude, so m lands on -nmax exactly (as in Q4_0) and the other side gets nmax - 1 levels.
    With search=True, the scale search of llama.cpp's make_qx_quants, with unit weights: try grids of
    nmax + 0.1·i steps (i = -n_grid … n_grid); for each, take its rounded codes and the least-squares
    s = Σ x·q / Σ q²; keep a candidate only if its squared error is below the plain fit's and every earlier one's.
    """
    m = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    inv_m = inverse(m)
    scale = m / np.float32(-nmax)
    if search:
        best_err = ((scale * np.clip(np.rint(-nmax * inv_m * x), -nmax, nmax - 1) - x) ** 2).sum(-1, keepdims=True)
        for step in (nmax + 0.1 * np.arange(-n_grid, n_grid + 1)).astype(np.float32):
            q = np.clip(np.rint(-step * inv_m * x), -nmax, nmax - 1)
            sum_q2 = (q * q).sum(-1, keepdims=True)
            c_scale = (q * x).sum(-1, keepdims=True) / np.where(sum_q2 > 0, sum_q2, 1)
            c_err = ((c_scale * q - x) ** 2).sum(-1, keepdims=True)
            better = (c_err < best_err) & (sum_q2 > 0)
            scale, best_err = np.where(better, c_scale, scale), np.where(better, c_err, best_err)
    return scale.astype(np.float32)


def encode_q6_k(blocks: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks from weights and their signed sub-block scales: weight = d · sc_j · (q - 32), q in [0, 63].

    blocks: (n, 256) float32; s: (n, 16) float32, sub-block j ≈ s_j · (q - 32).
    1. with s_max the s_j of largest magnitude, iscale = -128 / s_max, sc_j = min(127, round(iscale · s_j))
       int8 and d = 1 / iscale in fp16 (an all-zero super-block gives d = 0 and zero scales);
    2. each weight: q = clamp(round(x / (d·sc_j)), -32, 31) + 32 with the stored scales.
    returns (n, 210) uint8: ql 128 B | qh 64 B | sc 16 × int8 | d fp16. In each 128-weight half h,
    weight l + 32k (l < 32, k < 4) keeps its low 4 bits in ql[64h + l + 32(k % 2)] (low nibble for
    k < 2, high for k ≥ 2) and its top 2 bits at bit 2k of qh[32h + l].
    """
    n = len(blocks)
    s_max = np.take_along_axis(s, np.abs(s).argmax(axis=1)[:, None], axis=1)
    iscale = np.float32(-128) * inverse(s_max)
    sc = np.minimum(127, np.rint(s * iscale)).astype(np.int8)
    d_bytes = fp16_bytes(inverse(iscale))
    step = fp16_value(d_bytes) * sc
    sub = blocks.reshape(n, 16, 16)
    q = (np.clip(np.rint(divide(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    low = q & 0x0F
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: 256-weight super-blocks of 16 sub-blocks of 16, each sub-block's scale from the search.

    x: (..., cols) float32, cols % 256 == 0 -> (..., cols / 256 * 210) uint8 (layout in encode_q6_k).
    As in Q4_K, each super-block keeps the better of the searched and the plain absmax encoding.
    """
    blocks = as_blocks(x, "Q6_K")
    sub = blocks.reshape(-1, 16)
    best = _better(
        blocks,
        [encode_q6_k(blocks, fit_symmetric_scale(sub, search=s).reshape(-1, 16)) for s in (True, False)],
        dequantize_q6_k,
    )
    return from_blocks(best, x.shape, "Q6_K")


def dequantize_q6_k(data: np.ndarray) -> np.ndarray:
    """(..., n_bytes) uint8 in Q6_K -> (..., cols) float32: d · sc_j · (q - 32) per sub-block j."""
    blocks, shape = byte_blocks(data, "Q6_K")
    n = len(blocks)
    ql, qh = blocks[:, :128].reshape(n, 2, 1, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
    sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), fp16_value(blocks[:, 208:210])
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # k = 0, 1 low; 2, 3 high
    high = np.concatenate([(qh >> (2 * k)) & 0x03 for k in range(4)], axis=2)  # (n, 2, 4, 32)
    q = (low | (high << 4)).astype(np.float32).reshape(n, 16, 16) - 32
    return ((d * sc)[..., None] * q).reshape(shape)
