"""QuantLinear stores only codes and scales, dequantizes in forward, and reports honest bytes;
quantize_model swaps a model's Linears but leaves lm_head (the tied embedding) in float."""

import pytest
import torch
from torch import nn

from labkit.testing import LLAMA_CONFIGS, random_labkit_llama, random_tokens, with_random_biases

pytestmark = pytest.mark.in_process("the learner's code swaps the linears of the test's model, then the test runs it")

MOD = "stage03_quantization.quant_linear"
SEEDS = [0, 1]

# The largest error one weight may have, from first principles, per method (w: (out, in)).
BOUNDS = {
    "int8": lambda w: w.abs().amax(1, keepdim=True) / 254,  # half of absmax/127, per row
    "fp8_e4m3": lambda w: torch.maximum(w.abs() / 16, w.abs().max() / 448 * 2.0**-10),
    "fp8_e5m2": lambda w: torch.maximum(w.abs() / 8, w.abs().max() / 57344 * 2.0**-17),
    "nf4": lambda w: w.reshape(-1, 64).abs().amax(1, keepdim=True).expand(-1, 64).reshape(w.shape) * 0.1520 * 1.001,
}


def weight(seed: int, out: int = 96, n: int = 256) -> torch.Tensor:
    return torch.randn(out, n, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", sorted(BOUNDS))
def test_quantlinear_weight_error_within_format_bound(impl, seed, method):
    w = weight(seed)
    layer = impl(MOD).QuantLinear.from_weight(w, method)
    err = (layer.dequantize_weight() - w).abs()
    assert (err <= BOUNDS[method](w) * (1 + 1e-4)).all(), (
        f"seed={seed}, {method}: weight error above the format's bound"
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantlinear_forward_dequantizes_on_the_fly(impl, seed, bits):
    w = weight(seed)
    layer = impl(MOD).QuantLinear.from_weight(w, "rtn", bits=bits, group_size=64)
    stored = {name: b for name, b in layer.named_buffers()} | dict(layer.named_parameters())
    assert not any(t.is_floating_point() and t.numel() >= w.numel() for t in stored.values()), (
        f"seed={seed}: a QuantLinear must not keep a full float weight, found {[(k, t.dtype) for k, t in stored.items()]}"
    )
    x = torch.randn(5, 7, 256, generator=torch.Generator().manual_seed(seed))
    w_hat = layer.dequantize_weight()
    group_half_range = (w.view(96, 4, 64).amax(-1) - w.view(96, 4, 64).amin(-1)).repeat_interleave(64, 1)
    assert ((w_hat - w).abs() <= group_half_range / (2**bits - 1) * 0.5 * 1.01 + 1e-6).all(), f"seed={seed}: bad ŵ"
    torch.testing.assert_close(layer(x), x @ w_hat.T, msg=f"seed={seed}: forward must compute x @ dequantize_weight()ᵀ")


@pytest.mark.parametrize("seed", SEEDS)
def test_int4_g128_storage_at_most_0_3_of_fp16(impl, seed):
    w = weight(seed, 768, 256)
    layer = impl(MOD).QuantLinear.from_weight(w, "rtn", bits=4, group_size=128)
    fp16_bytes = w.numel() * 2
    assert w.numel() // 2 <= layer.weight_bytes() <= 0.3 * fp16_bytes, (
        f"seed={seed}: INT4 g128 with scales must take between numel/2 and 0.3 × fp16 bytes "
        f"({fp16_bytes}), got {layer.weight_bytes()}"
    )
    packed = [b for b in layer.buffers() if b.dtype == torch.uint8 and b.numel() == w.numel() // 2]
    assert packed, f"seed={seed}: expected the codes packed two per byte ({w.numel() // 2} uint8)"


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_quantize_model_swaps_every_linear_but_lm_head(impl, name):
    mod = impl(MOD)
    model = random_labkit_llama(5, **LLAMA_CONFIGS[name])
    ids = random_tokens(5, 21, model.config.vocab_size, batch=2)
    with torch.no_grad():
        expected = model(ids)
        embed = model.model.embed_tokens.weight.clone()
        mod.quantize_model(model, "int8")
        got = model(ids)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear | mod.QuantLinear)}
    assert kinds.pop("lm_head") is nn.Linear, f"{name}: lm_head must stay a float nn.Linear"
    assert len(kinds) == 7 * model.config.num_hidden_layers, f"{name}: expected 7 Linears per layer, got {kinds}"
    assert all(k is mod.QuantLinear for k in kinds.values()), f"{name}: not every decoder Linear was swapped"
    assert torch.equal(model.model.embed_tokens.weight, embed), f"{name}: the embedding must stay float"
    rel = ((got - expected).norm() / expected.norm()).item()
    assert 0 < rel < 0.02, f"{name}: INT8 logits should be close to float but not identical, rel. error {rel:.3g}"


@pytest.mark.parametrize("method,seed", [("int8", 0), ("rtn", 1), ("nf4", 2)])
def test_quantize_model_keeps_every_bias(impl, method, seed):
    """Qwen2's q/k/v carry biases, and some models bias o_proj and the MLP too: quantizing the weight must not drop them."""
    mod = impl(MOD)
    model = with_random_biases(random_labkit_llama(seed, attention_bias=True, o_proj_bias=True, mlp_bias=True), seed)
    with torch.no_grad():
        biases = {n.removesuffix(".bias"): p.clone() for n, p in model.named_parameters() if n.endswith(".bias")}
        ids = random_tokens(seed, 17, model.config.vocab_size, batch=2)
        expected = model(ids)
        mod.quantize_model(model, method, bits=8, group_size=16)
        got = model(ids)
    for name, bias in biases.items():
        kept = model.get_submodule(name).bias
        assert kept is not None and torch.equal(kept, bias), f"{method}: {name} lost its bias (pass module.bias on)"
    rel = ((got - expected).norm() / expected.norm()).item()
    limit = 0.1 if method == "nf4" else 0.02
    assert rel < limit, f"{method}: logits of the biased model moved by {rel:.3g} (more than rounding explains)"


@pytest.mark.parametrize("bits,group_size", [(3, 16), (8, 32)])
def test_quantize_model_passes_bits_and_group_size_on(impl, bits, group_size):
    mod = impl(MOD)
    model = mod.quantize_model(random_labkit_llama(2), "rtn", bits=bits, group_size=group_size)
    layers = [m for m in model.modules() if isinstance(m, mod.QuantLinear)]
    assert layers, "quantize_model swapped nothing"
    for m in layers:
        assert m.bits == bits, f"bits={bits} asked, a layer holds {m.bits}-bit codes"
        assert m.scales.shape == (m.out_features, m.in_features // group_size), (
            f"group_size={group_size}: expected one scale per {group_size} inputs, got {tuple(m.scales.shape)}"
        )
