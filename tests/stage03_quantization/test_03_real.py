"""§5–§8 on the real model: SmolLM2-135M's layers are 576 and 1536 inputs wide. The stage's default
group size, 128, does not divide 576, so RTN, GPTQ and AWQ refuse it before any work, naming the
group size and the width; 64 divides both, and RTN at 64 stays within one step of
each group's own min/max grid."""

import copy

import pytest
from torch import nn

from labkit.testing import real_ids, real_labkit

pytestmark = [
    pytest.mark.real,
    pytest.mark.in_process("the learner's code swaps the linears of the test's copy of the real model"),
]


def test_group_size_that_does_not_divide_the_real_model_is_refused(impl):
    ql = impl("stage03_quantization.quant_linear")
    model = copy.deepcopy(real_labkit())
    with pytest.raises(ValueError) as refused:
        ql.quantize_model(model, "rtn", 4, 128)
    message = str(refused.value)
    assert "128" in message and "576" in message, (
        f"RTN with group size 128: the error should name 128 and 576, not {message!r}"
    )
    calib = real_ids(32)[None]
    for name, quantize in (
        ("GPTQ", impl("stage03_quantization.gptq").gptq_quantize_model),
        ("AWQ", impl("stage03_quantization.awq").awq_quantize_model),
    ):
        try:
            quantize(model, calib, 4, 128)
        except ValueError as e:
            assert "128" in str(e) and "576" in str(e), f"{name}, group size 128: the error should name 128 and 576"
        else:
            pytest.fail(f"{name} accepted group size 128 on SmolLM2, whose layers are 576 inputs wide")

    quantized = ql.quantize_model(model, "rtn", 4, 64)
    fp32 = dict(real_labkit().named_modules())
    n = 0
    for name, layer in quantized.named_modules():
        if not isinstance(layer, ql.QuantLinear):
            assert not (isinstance(layer, nn.Linear) and name != "lm_head"), f"RTN g64 left {name} in float"
            continue
        w = fp32[name].weight.detach()
        groups = w.reshape(w.shape[0], -1, 64)
        lo, hi = groups.amin(-1, keepdim=True).clamp(max=0), groups.amax(-1, keepdim=True).clamp(min=0)
        step = ((hi - lo) / 15).expand_as(groups).reshape(w.shape)
        err = (layer.dequantize_weight() - w).abs()
        # half a step of rounding, plus up to half a step where the rounded zero point shifts the grid,
        # plus the float16 rounding of the stored scale
        assert (err <= step * 1.01 + 1e-6).all(), (
            f"RTN INT4 g64, {name}: error {float((err / step).max()):.3f} steps of its group's 64-wide grid"
        )
        n += 1
    assert n == 30 * 7, f"RTN g64 should quantize the 7 linears of each of the 30 layers, not {n}"
