"""Quantization primitives: a float tensor becomes small codes plus the scales that map them back.

Every format is a pair: `quantize_x(t) -> (codes, scales[, zeros])` and `dequantize_x(...) -> t_hat`.
The round-trip error is the whole story: absmax INT8 errs by at most scale/2 per element; group-wise
INT4 shrinks the scale by giving each group of 32-128 weights its own; NF4 spends its 16 levels
where normally distributed weights actually are; FP8 keeps a relative (not absolute) precision.
"""

import torch
import torch.nn.functional as F

# bitsandbytes builds NF4 from normal quantiles between 1 - offset and offset (create_normal_map).
NF4_OFFSET = 0.9677083
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# --- INT8 absmax (symmetric) ---------------------------------------------------------------------


def quantize_int8(x: torch.Tensor, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8: the largest |x| maps to 127, zero maps to 0 exactly.

    x:       (..., D) float — a weight (out, in) or activations (tokens, D)
    per_row: one scale per row (an output channel of a weight, a token of activations)
             instead of one for the whole tensor
    returns  codes int8 shaped like x, in [-127, 127];
             scale float32, () or (..., 1), with x ≈ codes * scale and |x - codes * scale| ≤ scale / 2
    """
    absmax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
    scale = absmax.float().clamp(min=1e-12) / 127  # an all-zero row still gets a usable scale
    codes = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes int8, scale () or (..., 1) -> float32 tensor shaped like codes."""
    return codes.float() * scale


# --- group-wise asymmetric INT-k and bit packing --------------------------------------------------


def quantize_groupwise(
    w: torch.Tensor, bits: int = 4, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization with one (scale, zero) per `group_size` consecutive inputs.

    w:       (out, in) float32 or float64, in % group_size == 0
    returns  codes (out, in) uint8 in [0, 2^bits - 1],
             scales (out, in // group_size) in w's dtype, zeros (out, in // group_size) uint8,
             with w ≈ (codes - zero) * scale and |w - w_hat| ≤ scale / 2 for its group.
    The range [min, max] is widened to contain 0, so 0 is exactly representable (as GPTQ/AWQ do).
    """
    out, n = w.shape
    maxq = 2**bits - 1
    g = w.reshape(out, n // group_size, group_size)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / maxq).clamp(min=1e-8)
    zeros = torch.round(-lo / scales)
    codes = torch.clamp(torch.round(g / scales[..., None]) + zeros[..., None], 0, maxq)
    return codes.reshape(out, n).to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """codes (out, in) uint8, scales/zeros (out, n_groups) -> (out, in) float32; group size = in / n_groups."""
    out, n = codes.shape
    g = codes.float().reshape(out, scales.shape[1], -1)
    return ((g - zeros.float()[..., None]) * scales.float()[..., None]).reshape(out, n)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `bits`-bit codes densely, most significant bit first: every 8 codes fill `bits` bytes.

    codes: any shape, uint8 < 2^bits -> (ceil(numel / 8) * bits,) uint8
    For bits=4 this is two codes per byte, the first in the high nibble (bitsandbytes' order).
    """
    c = F.pad(codes.reshape(-1).long(), (0, (-codes.numel()) % 8)).view(-1, 8)
    word = (c << (bits * torch.arange(7, -1, -1))).sum(1, keepdim=True)  # 8 codes in one 8·bits-bit int
    return ((word >> (8 * torch.arange(bits - 1, -1, -1))) & 0xFF).to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack`: (ceil(numel / 8) * bits,) uint8 -> (numel,) uint8 codes."""
    b = packed.long().view(-1, bits)
    word = (b << (8 * torch.arange(bits - 1, -1, -1))).sum(1, keepdim=True)
    codes = (word >> (bits * torch.arange(7, -1, -1))) & (2**bits - 1)
    return codes.to(torch.uint8).reshape(-1)[:numel]


# --- NF4 (QLoRA / bitsandbytes) ------------------------------------------------------------------


def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 levels, ascending in [-1, 1]: 8 positive and 7 negative standard-normal quantiles
    (evenly spaced probabilities from 0.5 to NF4_OFFSET), an exact 0, each side scaled so its
    extreme is ±1. Returns (16,) float32 equal to bitsandbytes' table."""
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    code = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return (code / code.max()).float()


def quantize_nf4(w: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise NF4: each block of `block_size` consecutive elements (row-major) is divided by its
    absmax and each value takes the index of the nearest NF4 level (decided by midpoints).

    w:       any shape float, numel % block_size == 0
    returns  codes uint8 shaped like w, in [0, 15]; absmax (numel // block_size,) float32
    """
    code = nf4_codebook()
    blocks = w.float().reshape(-1, block_size)
    absmax = blocks.abs().amax(1).clamp(min=1e-12)
    midpoints = (code[1:] + code[:-1]) / 2
    codes = torch.bucketize(blocks / absmax[:, None], midpoints)
    return codes.to(torch.uint8).reshape(w.shape), absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """codes uint8 (any shape), absmax (n_blocks,) -> float32 shaped like codes: level[code] * absmax."""
    values = nf4_codebook()[codes.long()].reshape(len(absmax), -1)
    return (values * absmax[:, None]).reshape(codes.shape)


def double_quantize(absmax: torch.Tensor, block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the absmax vector itself (QLoRA's double quantization): subtract its mean, then
    absmax-INT8 each block of `block_size` entries.

    absmax:  (n,) float32 -> codes (n,) int8, scales (ceil(n / block_size), 1) float32, offset () float32
    """
    offset = absmax.mean()
    centered = F.pad(absmax - offset, (0, (-len(absmax)) % block_size))
    codes, scales = quantize_int8(centered.view(-1, block_size), per_row=True)
    return codes.reshape(-1)[: len(absmax)], scales, offset


def double_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor, block_size: int = 256
) -> torch.Tensor:
    """Inverse of `double_quantize` -> (n,) float32 absmax."""
    padded = F.pad(codes, (0, (-len(codes)) % block_size)).view(-1, block_size)
    return dequantize_int8(padded, scales).reshape(-1)[: len(codes)] + offset


# --- FP8 -----------------------------------------------------------------------------------------


def quantize_fp8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled FP8 (E4M3: max 448, 3 mantissa bits; E5M2: max 57344, 2 mantissa bits).

    x:       any shape float
    scale:   by default absmax / max(dtype), so the largest |x| lands on the largest finite code
    returns  codes of `dtype` shaped like x, scale () float32, with x ≈ codes * scale.
    Values beyond ±max·scale saturate to ±max (a bare cast gives inf for E5M2).
    """
    fmax = torch.finfo(dtype).max
    if scale is None:
        scale = x.abs().amax().float().clamp(min=1e-12) / fmax
    scale = torch.as_tensor(scale, dtype=torch.float32)
    codes = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes float8, scale () -> float32 shaped like codes."""
    return codes.float() * scale
