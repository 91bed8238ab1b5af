"""Stage 04 part 3 learner bugs (the quantized KV cache, kv_quant.py), one edit each, planted in
solutions/stage04_batching (see labkit/grading/mutants.py)."""

MUTANTS = [
    # fp8_scale
    dict(
        file="kv_quant.py",
        find="    amax = x.abs().amax(dim=(0, 2))  # (n_kv,)",
        replace="    amax = x.amax(dim=(0, 2))  # (n_kv,)",
        bug="fp8_scale takes the largest value, not the largest magnitude (a negative outlier saturates)",
    ),
    dict(
        file="kv_quant.py",
        find="    amax = x.abs().amax(dim=(0, 2))  # (n_kv,)",
        replace="    amax = x.abs().amax(dim=(0, 1))  # (n_kv,)",
        bug="fp8_scale reduces over tokens and heads, giving one scale per channel instead of per head",
    ),
    dict(
        file="kv_quant.py",
        find="    if not per_head:\n        amax = amax.max().expand_as(amax).clone()\n",
        replace="",
        bug="fp8_scale ignores per_head=False (a per-tensor scale comes out per head)",
    ),
    dict(
        file="kv_quant.py",
        find="        amax = amax.max().expand_as(amax).clone()",
        replace="        amax = amax.mean().expand_as(amax).clone()",
        bug="the per-tensor fp8 scale fits the mean head's absmax, so the largest heads saturate",
    ),
    dict(
        file="kv_quant.py",
        find="    scale = amax / FP8_MAX\n",
        replace="    scale = amax / 127\n",
        bug="fp8_scale maps the absmax onto int8's 127 instead of e4m3's 448 (a third of the range unused)",
    ),
    dict(
        file="kv_quant.py",
        find="    return torch.where(scale > 0, scale, torch.ones_like(scale))",
        replace="    return scale",
        bug="fp8_scale returns 0 for an all-zero head (x / 0 is NaN on write)",
    ),
    # quantize_fp8
    dict(
        file="kv_quant.py",
        find="    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)",
        replace="    return (x * scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)",
        bug="quantize_fp8 multiplies by the scale instead of dividing",
    ),
    dict(
        file="kv_quant.py",
        find="    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)",
        replace="    return (x / scale.max()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)",
        bug="quantize_fp8 divides every head by the largest head's scale (per-head scales stored, not used)",
    ),
    dict(
        file="kv_quant.py",
        find="    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)",
        replace="    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e5m2)",
        bug="quantize_fp8 rounds to e5m2 (2 mantissa bits) instead of e4m3",
    ),
    dict(
        file="kv_quant.py",
        find="    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)",
        replace="    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).half().to(torch.float8_e4m3fn)",
        bug="quantize_fp8 goes through float16 first (double rounding: a value near a tie lands a step off)",
    ),
    # quantize_int8
    dict(
        file="kv_quant.py",
        find="    amax = x.abs().amax(dim=-1)  # (N, n_kv)",
        replace="    amax = x.abs().amax(dim=-1).amax(dim=-1, keepdim=True).expand(-1, x.shape[1])  # (N, n_kv)",
        bug="quantize_int8 takes one scale per token over all heads, not per token and head",
    ),
    dict(
        file="kv_quant.py",
        find="    amax = x.abs().amax(dim=-1)  # (N, n_kv)",
        replace="    amax = x.amax(dim=-1)  # (N, n_kv)",
        bug="quantize_int8 scales by the largest value, not the largest magnitude",
    ),
    dict(
        file="kv_quant.py",
        find="    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))",
        replace="    scale = torch.where(amax > 0, amax / 128, torch.ones_like(amax))",
        bug="quantize_int8 divides the absmax by 128 (the largest value rounds to 128 and clamps)",
    ),
    dict(
        file="kv_quant.py",
        find="    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))",
        replace="    scale = amax / INT8_MAX",
        bug="quantize_int8 gives an all-zero head scale 0 (0 / 0 is NaN)",
    ),
    dict(
        file="kv_quant.py",
        find="    q = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX)",
        replace="    q = torch.trunc(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX)",
        bug="quantize_int8 truncates toward zero instead of rounding (a bias of half a step)",
    ),
    dict(
        file="kv_quant.py",
        find="    q = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX)",
        replace="    q = torch.floor(x / scale[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX)",
        bug="quantize_int8 rounds halves up instead of to even (torch.round's rule)",
    ),
    dict(
        file="kv_quant.py",
        find="    q = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX)",
        replace="    q = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX - 1)",
        bug="quantize_int8 clamps to -127..126 (asymmetric: a positive absmax loses a step)",
    ),
    # dequantize
    dict(
        file="kv_quant.py",
        find="    return q.to(torch.float32) * scale[..., None]",
        replace="    return q.to(torch.float32)",
        bug="dequantize forgets the scale (codes read as values)",
    ),
    dict(
        file="kv_quant.py",
        find="    return q.to(torch.float32) * scale[..., None]",
        replace="    return q.to(torch.float32) / scale[..., None]",
        bug="dequantize divides by the scale instead of multiplying",
    ),
    dict(
        file="kv_quant.py",
        find="    return q.to(torch.float32) * scale[..., None]",
        replace="    return q.to(torch.float32) * scale.mean()",
        bug="dequantize widens every code with the mean scale (per-head / per-token scales ignored)",
    ),
]
