"""labkit.fast_paged: the engine's linear layers through labkit.cpu_kernels give the model's own logits."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import cpu_kernels, fast_paged
from labkit.testing import LLAMA_CONFIGS, random_labkit_llama, random_tokens, with_random_biases

pytestmark = pytest.mark.skipif(not shutil.which("c++"), reason="labkit.cpu_kernels compiles C++: no c++ compiler")

SHAPES = {  # every packed path: widths of 8 and 32, vocabularies of whole panels of 16 and of a padded one
    **{name: dict(config, vocab_size=96 + 4 * i) for i, (name, config) in enumerate(LLAMA_CONFIGS.items())},
    "gqa-odd-vocab": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
    "qwen3-like": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, qk_norm=True),
}


@pytest.fixture(scope="module")
def ops():
    kernels = cpu_kernels.ops()
    if kernels is None:
        pytest.skip("labkit.cpu_kernels needs an x86 CPU with AVX2")
    return kernels


@pytest.mark.parametrize("name", list(SHAPES))
def test_fast_forward_equals_the_model_at_every_row_count(ops, name):
    """The accelerated copy's logits at 1..9 and 23 rows (the kernel's passes of up to 6 or 12 rows, then
    chunks) and past CPP_MAX_ROWS (the GEMM) against the model's own forward; biases random so a dropped one
    shows; the model stays as it was."""
    seed = list(SHAPES).index(name)
    config = dict(SHAPES[name])
    qk_norm = config.pop("qk_norm", False)
    model = random_labkit_llama(seed, **config, attention_bias=True, mlp_bias=True, qk_norm=qk_norm)
    model = with_random_biases(model, seed)
    fast = fast_paged.accelerate(model)
    packed = [m for m in fast.modules() if isinstance(m, fast_paged.PackedLinear)]
    assert len(packed) >= 7 * model.config.num_hidden_layers, f"seed={seed} {name}: only {len(packed)} packed"
    assert not any(isinstance(m, fast_paged.PackedLinear) for m in model.modules()), "the model was changed"
    for rows in [*range(1, 10), 23, fast_paged.CPP_MAX_ROWS + 3]:
        ids = random_tokens(seed + rows, rows, model.config.vocab_size, 1)
        with torch.no_grad():
            want, got = model(ids), fast(ids)
        scale = want.abs().max().item()
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * scale + 1e-5, f"seed={seed} {name}: {rows} rows differ by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_quantized_linear_against_gguf_quants(ops, quantization):
    """A PackedLinear of llama.cpp's blocks against gguf.quants' dequantized weights times the activation rounded
    to int8 blocks, in float64, at B = 1..9 rows and widths that are odd multiples of 32; codes may sit one step
    from gguf's (test_fast_decode checks the quantizers), so the bound is one step per input plus rounding."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType.Q8_0 if quantization == "q8_0" else GGMLQuantizationType.Q4_1
    for out, inp in [(36, 96), (52, 160)]:
        seed = out + inp
        gen = torch.Generator().manual_seed(seed)
        linear = nn.Linear(inp, out, bias=True)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out, inp, generator=gen) * torch.rand(out, 1, generator=gen))
            linear.bias.copy_(torch.randn(out, generator=gen))
        w_hat = torch.from_numpy(
            quants.dequantize(quants.quantize(linear.weight.detach().numpy(), qtype), qtype).copy()
        )
        step = (w_hat.double().unflatten(1, (-1, 32)).amax(-1) - w_hat.double().unflatten(1, (-1, 32)).amin(-1)) / (
            254 if quantization == "q8_0" else 15
        )
        layer = fast_paged.PackedLinear(linear, ops, quantization, fast_paged.CPP_MAX_ROWS)
        for B in range(1, 10):
            x = torch.randn(B, inp, generator=gen)
            rx = cpu_kernels.round_activation(x).double()
            want = F.linear(rx, w_hat.double(), linear.bias.double())
            with torch.no_grad():
                got = layer(x).double()
            bound = rx.abs().unflatten(1, (-1, 32)).sum(-1) @ step.T + 1e-4 * (rx.abs() @ w_hat.double().abs().T) + 1e-5
            worst = ((got - want).abs() - bound).max().item()
            assert worst <= 0, f"seed={seed} {quantization} ({out}, {inp}) B={B}: {worst:.3g} past the bound"


def test_unknown_names_are_refused():
    model = random_labkit_llama(0)
    with pytest.raises(ValueError, match="q8_0"):
        fast_paged.accelerate(model, quantization="q4_0")
    with pytest.raises(ValueError, match="cpp"):
        fast_paged.accelerate(model, kernels="avx")
    assert fast_paged.accelerate(model, kernels="torch") is model


def test_engine_config_names_the_quantizations():
    """serve --quantization takes GGUF's names; another is refused, naming the choices."""
    import argparse

    from stage04_batching.config import EngineConfig

    with pytest.raises(ValueError, match="q8_0"):
        EngineConfig(quantization="q4_0")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--quantization", "q4_1", "--kernels", "torch"])
    assert (EngineConfig.from_cli_args(args).quantization, args.kernels) == ("q4_1", "torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
