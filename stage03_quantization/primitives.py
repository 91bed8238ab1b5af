"""Quantization primitives: a float tensor becomes small codes plus the scales that map them back.

Every format is a pair: `quantize_x(t) -> (codes, scales[, zeros])` and `dequantize_x(...) -> t_hat`.
The round-trip error is the whole story: absmax INT8 errs by at most scale/2 per element; group-wise
INT4 shrinks the scale by giving each group of 32-128 weights its own; NF4 spends its 16 levels
where normally distributed weights actually are; FP8 keeps a relative (not absolute) precision.
"""

import torch
import torch.nn.functional as F  # noqa: F401

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
    raise NotImplementedError("stage03: quantize_int8 — see lab.ipynb §1")


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes int8, scale () or (..., 1) -> float32 tensor shaped like codes."""
    raise NotImplementedError("stage03: dequantize_int8 — see lab.ipynb §1")


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
    raise NotImplementedError("stage03: quantize_groupwise — see lab.ipynb §2")


def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """codes (out, in) uint8, scales/zeros (out, n_groups) -> (out, in) float32; group size = in / n_groups."""
    raise NotImplementedError("stage03: dequantize_groupwise — see lab.ipynb §2")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `bits`-bit codes densely, most significant bit first: every 8 codes fill `bits` bytes.

    codes: any shape, uint8 < 2^bits -> (ceil(numel / 8) * bits,) uint8
    For bits=4 this is two codes per byte, the first in the high nibble (bitsandbytes' order).
    """
    raise NotImplementedError("stage03: pack — see lab.ipynb §2")


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack`: (ceil(numel / 8) * bits,) uint8 -> (numel,) uint8 codes."""
    raise NotImplementedError("stage03: unpack — see lab.ipynb §2")


# --- NF4 (QLoRA / bitsandbytes) ------------------------------------------------------------------


def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 levels, ascending in [-1, 1]: 8 positive and 7 negative standard-normal quantiles
    (evenly spaced probabilities from 0.5 to NF4_OFFSET), an exact 0, each side scaled so its
    extreme is ±1. Returns (16,) float32 equal to bitsandbytes' table."""
    raise NotImplementedError("stage03: nf4_codebook — see lab.ipynb §3")


def quantize_nf4(w: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise NF4: each block of `block_size` consecutive elements (row-major) is divided by its
    absmax and each value takes the index of the nearest NF4 level (decided by midpoints).

    w:       any shape float, numel % block_size == 0
    returns  codes uint8 shaped like w, in [0, 15]; absmax (numel // block_size,) float32
    """
    raise NotImplementedError("stage03: quantize_nf4 — see lab.ipynb §3")


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """codes uint8 (any shape), absmax (n_blocks,) -> float32 shaped like codes: level[code] * absmax."""
    raise NotImplementedError("stage03: dequantize_nf4 — see lab.ipynb §3")


def double_quantize(absmax: torch.Tensor, block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the absmax vector itself (QLoRA's double quantization): subtract its mean, then
    absmax-INT8 each block of `block_size` entries.

    absmax:  (n,) float32 -> codes (n,) int8, scales (ceil(n / block_size), 1) float32, offset () float32
    """
    raise NotImplementedError("stage03: double_quantize — see lab.ipynb §3")


def double_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor, block_size: int = 256
) -> torch.Tensor:
    """Inverse of `double_quantize` -> (n,) float32 absmax."""
    raise NotImplementedError("stage03: double_dequantize — see lab.ipynb §3")


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
    raise NotImplementedError("stage03: quantize_fp8 — see lab.ipynb §4")


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes float8, scale () -> float32 shaped like codes."""
    raise NotImplementedError("stage03: dequantize_fp8 — see lab.ipynb §4")
