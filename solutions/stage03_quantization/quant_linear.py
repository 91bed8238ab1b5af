"""A Linear layer that stores only its quantized weight, and the swap that puts it into a model.

`QuantLinear` keeps packed codes and scales as buffers and rebuilds a float weight in every
`forward` (dequantize-on-the-fly, as weight-only INT4 kernels do, only fused on a GPU). Its
`weight_bytes()` counts exactly what it holds, so the memory column of the stage's table is honest.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .primitives import (
    FP8_DTYPES,
    dequantize_fp8,
    dequantize_groupwise,
    dequantize_int8,
    dequantize_nf4,
    double_dequantize,
    double_quantize,
    pack,
    quantize_fp8,
    quantize_groupwise,
    quantize_int8,
    quantize_nf4,
    unpack,
)

# Data-free formats: int8 (per-channel absmax), fp8_e4m3 / fp8_e5m2 (per-tensor), nf4 (block 64),
# nf4_dq (nf4 + double-quantized absmax), rtn (group-wise asymmetric INT-`bits`, round to nearest).
METHODS = ("int8", "fp8_e4m3", "fp8_e5m2", "nf4", "nf4_dq", "rtn")


class QuantLinear(nn.Module):
    """y = x @ W_hatᵀ + b, where W_hat (out, in) is dequantized from buffers on every call.

    fmt is one of "int8", "fp8_e4m3", "fp8_e5m2", "nf4", "nf4_dq", "int" (group-wise asymmetric;
    "rtn", GPTQ and AWQ all produce it). Buffers per format:
      int8:   codes (out, in) int8, scale (out, 1) float32
      fp8_*:  codes (out, in) float8, scale () float32
      nf4:    packed (out*in/2,) uint8, absmax (out*in/64,) float32
      nf4_dq: packed, absmax_codes int8, absmax_scales float32, absmax_offset () float32
      int:    packed (ceil(out*in/8)*bits,) uint8, scales (out, in/g) float16, zeros (out, in/g) uint8
    bias: the replaced Linear's bias (out,), kept in float as GPTQ and AWQ checkpoints keep it, or None.
    """

    def __init__(
        self, in_features: int, out_features: int, fmt: str, bits: int, bias: torch.Tensor | None = None, **buffers
    ):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.bits = in_features, out_features, fmt, bits
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        for name, t in buffers.items():
            self.register_buffer(name, t)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, method: str, bits: int = 4, group_size: int = 128, bias: torch.Tensor | None = None
    ) -> "QuantLinear":
        """Quantize a float weight (out, in) with one of METHODS (round to nearest, no calibration); bias as is."""
        out, n = weight.shape
        w = weight.detach().float()
        if method == "int8":
            codes, scale = quantize_int8(w, per_row=True)
            return cls(n, out, "int8", 8, bias, codes=codes, scale=scale)
        if method.startswith("fp8_"):
            codes, scale = quantize_fp8(w, FP8_DTYPES[method.removeprefix("fp8_")])
            return cls(n, out, method, 8, bias, codes=codes, scale=scale)
        if method == "nf4":
            codes, absmax = quantize_nf4(w)
            return cls(n, out, "nf4", 4, bias, packed=pack(codes, 4), absmax=absmax)
        if method == "nf4_dq":
            codes, absmax = quantize_nf4(w)
            a_codes, a_scales, a_offset = double_quantize(absmax)
            return cls(
                n, out, "nf4_dq", 4, bias,
                packed=pack(codes, 4), absmax_codes=a_codes, absmax_scales=a_scales, absmax_offset=a_offset,
            )  # fmt: skip
        if method == "rtn":
            if n % group_size:
                raise ValueError(
                    f"group_size={group_size} does not divide this layer's input width {n}: a group would "
                    f"straddle two rows. Pick a group size that divides it, such as {_group_that_fits(n, group_size)}."
                )
            return cls.from_groupwise(*quantize_groupwise(w, bits, group_size), bits=bits, bias=bias)
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")

    @classmethod
    def from_groupwise(
        cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, bias: torch.Tensor | None = None
    ) -> "QuantLinear":
        """Store group-wise codes (out, in) uint8 with scales/zeros (out, n_groups) (from RTN, GPTQ or AWQ)."""
        out, n = codes.shape
        return cls(n, out, "int", bits, bias, packed=pack(codes, bits), scales=scales.half(), zeros=zeros)

    def dequantize_weight(self) -> torch.Tensor:
        """The float32 weight (out, in) this layer stands for, rebuilt from its buffers."""
        shape, numel = (self.out_features, self.in_features), self.out_features * self.in_features
        if self.fmt == "int8":
            return dequantize_int8(self.codes, self.scale)
        if self.fmt.startswith("fp8_"):
            return dequantize_fp8(self.codes, self.scale)
        if self.fmt == "nf4":
            return dequantize_nf4(unpack(self.packed, 4, numel).view(shape), self.absmax)
        if self.fmt == "nf4_dq":
            absmax = double_dequantize(self.absmax_codes, self.absmax_scales, self.absmax_offset)
            return dequantize_nf4(unpack(self.packed, 4, numel).view(shape), absmax)
        if self.fmt == "int":
            return dequantize_groupwise(unpack(self.packed, self.bits, numel).view(shape), self.scales, self.zeros)
        raise ValueError(f"unknown format {self.fmt!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize_weight().to(x.dtype), bias)

    def weight_bytes(self) -> int:
        """Bytes of everything this layer stores (codes, scales, zeros, bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, bits={self.bits}"


def check_group_size(model: nn.Module, group_size: int, skip: tuple[str, ...] = ("lm_head",)) -> None:
    """Refuse, before any work, a group size that does not divide the input width of every Linear
    that will be quantized (those whose name does not end with an entry of `skip`)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and not name.endswith(skip)}
    common = math.gcd(*(m.in_features for m in linears.values()))
    for name, m in linears.items():
        if m.in_features % group_size:
            raise ValueError(
                f"group_size={group_size} does not divide the input width {m.in_features} of {name}: a group "
                f"would straddle two rows. Pick a group size that divides every layer's width, such as "
                f"{_group_that_fits(common, group_size)}."
            )


def _group_that_fits(width: int, group_size: int) -> int:
    """The largest power of two that divides `width` and is at most `group_size` (64 for 576 and 128)."""
    return math.gcd(width & -width, 1 << (group_size.bit_length() - 1))


def quantize_model(
    model: nn.Module, method: str, bits: int = 4, group_size: int = 128, skip: tuple[str, ...] = ("lm_head",)
) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` whose name does not end with an entry of `skip`
    by QuantLinear.from_weight(...), which keeps the Linear's bias (Qwen2's q/k/v have one). Returns the model.

    lm_head is skipped by default: it is the most sensitive matrix, and with tied embeddings it is
    the embedding table itself, which must stay float for the lookup.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith(skip):
            model.set_submodule(name, QuantLinear.from_weight(module.weight, method, bits, group_size, module.bias))
    return model
