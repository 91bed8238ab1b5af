"""SmoothQuant (Xiao et al., 2022): make activations easy to quantize by moving their outliers into
the weights. A per-input-channel scale s divides the activation (folded into the norm before it) and
multiplies the weight columns after it: X W = (X diag(s)⁻¹)(diag(s) W), exact in float. Then both
sides are INT8: per-token activations, per-output-channel weights (W8A8).
"""

import torch
import torch.nn.functional as F
from torch import nn

from labkit.calibration import record_inputs

from .primitives import quantize_int8


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α), clamped to ≥ 1e-5.

    act_max: (in,) running max of |activation| per input channel over the calibration tokens
    weights: the (out_k, in) weights that read this activation; max|W_j| is over all their rows
    returns  (in,) float32
    """
    w_max = torch.cat([w.abs() for w in weights]).amax(0).float()
    return (act_max.float().pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def fold_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Divide the output channels of `prev` by s and multiply the input columns of `linears` by s.

    prev:    an RMSNorm (weight (in,)) or an nn.Linear (weight (in, *), and its bias (in,) if it has one)
             producing the linears' input
    linears: nn.Linear with weight (*, in)
    The composed function is unchanged in exact arithmetic; only where the magnitude lives moves.
    """
    prev.weight.div_(s.view(-1, *([1] * (prev.weight.dim() - 1))))
    if getattr(prev, "bias", None) is not None:  # a Linear's bias is part of its output channels too
        prev.bias.div_(s)
    for linear in linears:
        linear.weight.mul_(s)


class W8A8Linear(nn.Module):
    """INT8 weights (per output channel) times INT8 activations (per token), the integer matmul
    simulated exactly in float32, then one rank-1 rescale by the two scale vectors, plus the float bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        codes, scale = quantize_int8(linear.weight.detach(), per_row=True)
        self.register_buffer("codes", codes)  # (out, in) int8
        self.register_buffer("scale", scale)  # (out, 1) float32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())  # (out,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) float32 -> (..., out); activations are quantized per token on the fly; the bias,
        if any, is added in float."""
        x_codes, x_scale = quantize_int8(x, per_row=True)  # (..., in), (..., 1)
        acc = F.linear(x_codes.float(), self.codes.float())  # int8·int8 sums, exact in fp32 here
        y = acc * x_scale * self.scale.view(-1)
        return y if self.bias is None else y + self.bias


def _smoothing_pairs(layer: nn.Module) -> dict[str, tuple[nn.Module, list[nn.Linear]]]:
    """The norm before each group of linears in a Llama decoder layer, keyed by the first linear."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "self_attn.q_proj": (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]),
        "mlp.gate_proj": (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
    }


@torch.no_grad()
def smooth_model(model: nn.Module, calib: torch.Tensor, alpha: float = 0.5) -> nn.Module:
    """Fold smoothing scales into every decoder layer's two norms, in place; logits are unchanged."""
    x, cos, sin, mask = model.layer_inputs(calib)
    for layer in model.model.layers:
        pairs = _smoothing_pairs(layer)
        with record_inputs({name: layer.get_submodule(name) for name in pairs}) as inputs:
            layer(x, cos, sin, mask)
        for name, (norm, linears) in pairs.items():
            act_max = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[name]]).abs().amax(0)
            fold_scale(norm, linears, smoothing_scales(act_max, [lin.weight for lin in linears], alpha))
        x = layer(x, cos, sin, mask)
    return model


def w8a8_model(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace every nn.Linear not named in `skip` by a W8A8Linear, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith(skip):
            model.set_submodule(name, W8A8Linear(module))
    return model
