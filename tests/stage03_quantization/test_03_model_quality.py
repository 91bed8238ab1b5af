"""Model level, on the course's tiny trained target: every method keeps perplexity within its
stated bound of fp32 while actually shrinking the weights. Few held-out windows and a small
calibration set keep this within the time budget; the benchmark measures the full table."""

import copy

import pytest
import torch

import labkit
from labkit.calibration import calibration_windows
from labkit.checkpoint import load_tokenizer
from labkit.device import pin_threads
from labkit.model import from_pretrained
from labkit.quality import heldout, perplexity

# method -> (quantize(model, calib) via the stage's modules, max perplexity increase %, max bytes / fp32 bytes)
METHODS = {
    "int8": (lambda impl, m, c: impl("stage03_quantization.quant_linear").quantize_model(m, "int8"), 0.1, 0.33),
    "fp8_e4m3": (lambda impl, m, c: impl("stage03_quantization.quant_linear").quantize_model(m, "fp8_e4m3"), 0.3, 0.33),
    "nf4": (lambda impl, m, c: impl("stage03_quantization.quant_linear").quantize_model(m, "nf4_dq"), 0.5, 0.22),
    "rtn-int4": (
        lambda impl, m, c: impl("stage03_quantization.quant_linear").quantize_model(m, "rtn", 4, 128),
        0.5,
        0.22,
    ),
    "gptq-int4": (lambda impl, m, c: impl("stage03_quantization.gptq").gptq_quantize_model(m, c, 4, 128), 0.5, 0.22),
    "awq-int4": (lambda impl, m, c: impl("stage03_quantization.awq").awq_quantize_model(m, c, 4, 128), 0.5, 0.22),
}


@pytest.fixture(scope="module")
def target():
    with pin_threads(1):  # module fixtures run before the per-test one_thread fixture
        tokenizer = load_tokenizer(labkit.TARGET)
        model = from_pretrained(labkit.TARGET)
        windows = heldout(tokenizer, n_tokens=1024, seq=512)  # 2 held-out windows
        calib = calibration_windows(tokenizer, n_windows=2, seq=128)  # from the training split
        yield model, windows, calib, perplexity(model, windows)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_quantized_target_perplexity_within_bound(impl, target, method):
    model, windows, calib, ppl_fp32 = target
    quantize, max_increase_pct, max_bytes_ratio = METHODS[method]
    fp32_bytes = impl("stage03_quantization.evaluate").weight_bytes(model)
    with torch.no_grad():
        q = quantize(impl, copy.deepcopy(model), calib)
        ppl = perplexity(q, windows)
    ratio = impl("stage03_quantization.evaluate").weight_bytes(q) / fp32_bytes
    assert ratio <= max_bytes_ratio, f"{method}: weights take {ratio:.3f} of fp32, expected ≤ {max_bytes_ratio}"
    increase = 100 * (ppl / ppl_fp32 - 1)
    assert increase <= max_increase_pct, (
        f"{method}: perplexity {ppl_fp32:.4f} -> {ppl:.4f} ({increase:+.3f} %), bound +{max_increase_pct} %"
    )
