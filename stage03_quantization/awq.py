"""AWQ (Lin et al., 2023): a few input channels carry large activations, and the weights that read
them matter most. Scaling those weight columns up by s before quantizing (and the activation down
by s, folded into the op before) shrinks their relative rounding error. s = mean|x|^α, with α picked
per layer group by a 20-point grid search on the group's output error.
"""

from collections.abc import Callable

import torch
from torch import nn

from labkit.calibration import record_inputs

from .primitives import dequantize_groupwise, quantize_groupwise
from .quant_linear import check_group_size, quantize_model
from .smoothquant import fold_scale


def pseudo_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round-trip w (out, in) through group-wise asymmetric INT-`bits` (the float weight RTN would serve)."""
    return dequantize_groupwise(*quantize_groupwise(w, bits, group_size))


@torch.no_grad()
def search_scale(
    block: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    linears: list[nn.Linear],
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
) -> tuple[torch.Tensor, float]:
    """Grid-search α ∈ {0, 1/n_grid, ..., (n_grid-1)/n_grid} for s = mean|x|^α.

    block:   the float function of x that contains `linears` (the attention, the MLP, one Linear)
    x:       (..., in) its calibration input; linears: the nn.Linear(s) reading x, weights (*, in)
    For each α, s is clamped to ≥ 1e-4 and normalised by sqrt(max(s)·min(s)); each weight becomes
    pseudo_quantize(W·diag(s)) / s and the loss is the MSE between block(x) before and after.
    Returns (s (in,), α) of the lowest loss; the linears' weights are left as they were.
    """
    raise NotImplementedError("stage03: search_scale — see lab.ipynb §8")


def _scaling_groups(layer: nn.Module, cos, sin, mask):
    """(prev op, linears, block function, name of the linear whose input feeds the block) of a Llama layer."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj],
         lambda h: attn(h, cos, sin, mask), "self_attn.q_proj"),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], mlp, "mlp.gate_proj"),
        (mlp.up_proj, [mlp.down_proj], mlp.down_proj, "mlp.down_proj"),
    ]  # fmt: skip
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # v -> o folds one-to-one only without GQA
        groups.append((attn.v_proj, [attn.o_proj], attn.o_proj, "self_attn.o_proj"))
    return groups


@torch.no_grad()
def awq_scale_model(
    model: nn.Module, calib: torch.Tensor, bits: int = 4, group_size: int = 128, n_grid: int = 20
) -> nn.Module:
    """Search and fold AWQ scales into every decoder layer, in place. Still float and still exactly
    the same function: only the distribution of magnitudes between ops has changed."""
    check_group_size(model, group_size)
    x, cos, sin, mask = model.layer_inputs(calib)
    for layer in model.model.layers:
        groups = _scaling_groups(layer, cos, sin, mask)
        with record_inputs({name: layer.get_submodule(name) for *_, name in groups}) as inputs:
            layer(x, cos, sin, mask)
        for prev, linears, block, name in groups:
            s, _ = search_scale(block, torch.cat(inputs[name]), linears, bits, group_size, n_grid)
            fold_scale(prev, linears, s)
        x = layer(x, cos, sin, mask)
    return model


def awq_quantize_model(model: nn.Module, calib: torch.Tensor, bits: int = 4, group_size: int = 128) -> nn.Module:
    """AWQ = fold the searched scales, then plain round-to-nearest group-wise quantization."""
    return quantize_model(awq_scale_model(model, calib, bits, group_size), "rtn", bits, group_size)
