"""GPTQ (Frantar et al., 2022): quantize a weight one input column at a time and push each column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss ||WX - W_hat X||². With calibration inputs X, that Hessian is H = 2/n Σ x xᵀ.
"""

import math  # noqa: F401

import torch
from torch import nn

from labkit.calibration import record_inputs

from .primitives import quantize_groupwise  # noqa: F401
from .quant_linear import QuantLinear, check_group_size


class Hessian:
    """Running H = 2/n Σ x xᵀ over every calibration token seen so far (n tokens in total)."""

    def __init__(self, in_features: int):
        self.H = torch.zeros(in_features, in_features)
        self.n = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x: (..., in_features) — the inputs of one forward call; every row is one token.

        Keeps H equal to 2/n Σ x xᵀ over all tokens so far, whatever the batch sizes were.
        """
        raise NotImplementedError("stage03: Hessian.add_batch — see lab.ipynb §6")


@torch.no_grad()
def gptq_quantize_slow(
    W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128, percdamp: float = 0.01
) -> torch.Tensor:
    """GPTQ the long way (Optimal Brain Quantization): step 1 of lab.ipynb §6, before gptq_quantize.

    Dead inputs and damping as in gptq_quantize, then an explicit H⁻¹ and, for each column i in order:
    at the start of a group fit the group's grid on its current weights (quantize_groupwise), round
    column i on it, move its rounding error onto the later columns with the update that keeps the
    layer's output error smallest, and remove column i from the problem. No Cholesky, no blocks.

    W: (out, in) float, H: (in, in) float; group_size divides in; arithmetic in float64
    returns W_hat (out, in) float64, the dequantized weights (gptq_quantize's, up to rounding)
    """
    raise NotImplementedError("stage03: gptq_quantize_slow — see lab.ipynb §6")


@torch.no_grad()
def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    block_size: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W column by column with error feedback through the upper Cholesky factor of H⁻¹.

    W: (out, in) float, H: (in, in) float (same dtype; float64 in, float64 arithmetic)
    group_size divides in; block_size and group_size divide one another
    act_order: visit columns by decreasing H_ii; the group grids are then fixed up front ("static
               groups") so that scales stay in the original column order
    returns codes (out, in) uint8, scales (out, in // group_size), zeros (out, in // group_size),
            in the original column order, ready for QuantLinear.from_groupwise
    """
    raise NotImplementedError("stage03: gptq_quantize — see lab.ipynb §6")


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module, calib: torch.Tensor, bits: int = 4, group_size: int = 128, act_order: bool = False
) -> nn.Module:
    """Quantize every Linear of every decoder layer with GPTQ, in place (lm_head stays float).

    calib: (B, T) int64 calibration windows. Layers are done in order; each layer's Hessians come
    from the outputs of the already-quantized layers before it, as in the GPTQ paper.
    """
    check_group_size(model, group_size)
    x, cos, sin, mask = model.layer_inputs(calib)
    for layer in model.model.layers:
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        with record_inputs(linears) as inputs:
            layer(x, cos, sin, mask)
        for name, linear in linears.items():
            h = Hessian(linear.in_features)
            for batch in inputs[name]:
                h.add_batch(batch)
            codes, scales, zeros = gptq_quantize(linear.weight.float(), h.H, bits, group_size, act_order=act_order)
            layer.set_submodule(name, QuantLinear.from_groupwise(codes, scales, zeros, bits, linear.bias))
        x = layer(x, cos, sin, mask)
    return model
