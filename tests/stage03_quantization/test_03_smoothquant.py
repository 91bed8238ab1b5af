"""SmoothQuant: the smoothing scale formula, exact equivalence in float after folding, and W8A8
error far below naive W8A8 when activations have outlier channels."""

import copy

import pytest
import torch
from torch import nn

from labkit.model import RMSNorm
from labkit.testing import LLAMA_CONFIGS, random_labkit_llama, random_tokens

pytestmark = pytest.mark.in_process("the learner's code folds scales into the test's model, then the test runs it")

MOD = "stage03_quantization.smoothquant"
SEEDS = [0, 1, 2]


def int8_rows(t: torch.Tensor) -> torch.Tensor:
    """Symmetric absmax INT8 fake quantization per row, written out here as the reference."""
    scale = t.abs().amax(-1, keepdim=True) / 127
    return torch.round(t / scale).clamp(-127, 127) * scale


def outlier_block(seed: int):
    """RMSNorm -> two Linears, with a norm weight that blows up 4 channels (as trained LLMs do)."""
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(128, 1e-5)
    a, b = nn.Linear(128, 96, bias=False), nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128, generator=g) + 0.5)
        norm.weight[torch.randperm(128, generator=g)[:4]] *= 60.0
        a.weight.copy_(torch.randn(96, 128, generator=g) * 0.05)
        b.weight.copy_(torch.randn(64, 128, generator=g) * 0.05)
    x = torch.randn(256, 128, generator=g)
    return norm, [a, b], x


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha", [0.5, 0.85])
def test_smoothing_scales_formula(impl, seed, alpha):
    g = torch.Generator().manual_seed(seed)
    act_max = torch.rand(40, generator=g) * 10
    weights = [torch.randn(24, 40, generator=g), torch.randn(8, 40, generator=g) * 3]
    w_max = torch.maximum(weights[0].abs().amax(0), weights[1].abs().amax(0))
    expected = (act_max**alpha / w_max ** (1 - alpha)).clamp(min=1e-5)
    got = impl(MOD).smoothing_scales(act_max, weights, alpha)
    torch.testing.assert_close(got, expected, msg=f"seed={seed}: s_j = max|X_j|^α / max|W_j|^(1-α)")


@pytest.mark.parametrize("seed", SEEDS)
def test_fold_scale_keeps_the_function(impl, seed):
    norm, linears, x = outlier_block(seed)
    prev = nn.Linear(128, 128)  # a Linear before the Linears works the same way, bias included
    with torch.no_grad():
        prev.weight.normal_(generator=torch.Generator().manual_seed(seed))
        prev.bias.normal_(generator=torch.Generator().manual_seed(seed + 10))
        expected = [lin(norm(x)) for lin in linears] + [lin(prev(x)) for lin in linears]
        s = torch.rand(128, generator=torch.Generator().manual_seed(seed)) * 4 + 0.1
        n2, p2, l2, l3 = copy.deepcopy(norm), copy.deepcopy(prev), copy.deepcopy(linears), copy.deepcopy(linears)
        impl(MOD).fold_scale(n2, l2, s)
        impl(MOD).fold_scale(p2, l3, s)
        got = [lin(n2(x)) for lin in l2] + [lin(p2(x)) for lin in l3]
    assert not torch.equal(n2.weight, norm.weight), f"seed={seed}: the norm weight should have been divided by s"
    for e, o in zip(expected, got, strict=True):
        torch.testing.assert_close(
            o, e, atol=1e-4, rtol=1e-4, msg=f"seed={seed}: folding changed the output (a Linear's bias scales too)"
        )


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_smoothed_model_is_equivalent_in_float(impl, name):
    model = random_labkit_llama(3, **LLAMA_CONFIGS[name])
    before = model.model.layers[-1].post_attention_layernorm.weight.detach().clone()
    ids = random_tokens(3, 29, model.config.vocab_size, batch=2)
    with torch.no_grad():
        expected = model(ids)
        impl(MOD).smooth_model(model, random_tokens(4, 24, model.config.vocab_size, batch=2), alpha=0.5)
        got = model(ids)
    assert not torch.equal(model.model.layers[-1].post_attention_layernorm.weight, before), f"{name}: nothing folded"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{name}: smoothing changed the logits")


@pytest.mark.parametrize("seed", SEEDS)
def test_w8a8_linear_quantizes_tokens_and_channels(impl, seed):
    _, (linear, _), x = outlier_block(seed)
    with torch.no_grad():
        got = impl(MOD).W8A8Linear(linear)(x)
    expected = int8_rows(x) @ int8_rows(linear.weight.detach()).T  # per token × per output channel
    torch.testing.assert_close(
        got, expected, atol=1e-5, rtol=1e-4, msg=f"seed={seed}: not per-token × per-channel INT8"
    )
    biased = nn.Linear(128, 96)
    with torch.no_grad():
        biased.weight.copy_(linear.weight)
        biased.bias.normal_(generator=torch.Generator().manual_seed(seed))
        got = impl(MOD).W8A8Linear(biased)(x)
    torch.testing.assert_close(
        got, expected + biased.bias, atol=1e-5, rtol=1e-4, msg=f"seed={seed}: the float bias is added after the rescale"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_smoothing_cuts_w8a8_error_with_outlier_channels(impl, seed):
    mod = impl(MOD)
    norm, linears, x = outlier_block(seed)
    with torch.no_grad():
        h = norm(x)
        exact = [lin(h) for lin in linears]
        naive = [mod.W8A8Linear(lin)(h) for lin in linears]
        s = mod.smoothing_scales(h.abs().amax(0), [lin.weight for lin in linears], alpha=0.5)
        mod.fold_scale(norm, linears, s)
        h = norm(x)
        smoothed = [mod.W8A8Linear(lin)(h) for lin in linears]
    err = lambda ys: sum((y - e).pow(2).sum().item() for y, e in zip(ys, exact, strict=True))  # noqa: E731
    assert err(smoothed) < 0.2 * err(naive), (
        f"seed={seed}: smoothed W8A8 error {err(smoothed):.4g} should be far below naive {err(naive):.4g}"
    )


@torch.no_grad()
def layer_by_layer_smoothing(sq, model, calib, alpha: float):
    """SmoothQuant on a model written out: per layer, the running max |x| per channel of the input
    of q/k/v and of gate/up, over every calibration token, turned into s by the module's (separately
    tested) smoothing_scales and folded by its fold_scale; the next layer sees the smoothed layer."""
    from labkit.calibration import record_inputs

    x, cos, sin, mask = model.layer_inputs(calib)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [
            (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]),
            (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
        ]
        with record_inputs({j: linears[0] for j, (_, linears) in enumerate(groups)}) as inputs:
            layer(x, cos, sin, mask)
        for j, (norm, linears) in enumerate(groups):
            act_max = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[j]]).abs().amax(0)
            sq.fold_scale(norm, linears, sq.smoothing_scales(act_max, [lin.weight for lin in linears], alpha))
        x = layer(x, cos, sin, mask)
    return model


@pytest.mark.parametrize("name,alpha", [("gqa2-tied", 0.8), ("gqa4-3layers", 0.35)])
def test_smooth_model_folds_the_smoothing_scales_layer_by_layer(impl, name, alpha):
    model = random_labkit_llama(9, **LLAMA_CONFIGS[name])
    calib = random_tokens(9, 21, model.config.vocab_size, batch=3)
    expected = layer_by_layer_smoothing(impl(MOD), copy.deepcopy(model), calib, alpha)
    impl(MOD).smooth_model(model, calib, alpha=alpha)
    for (key, got), want in zip(model.state_dict().items(), expected.state_dict().values(), strict=True):
        torch.testing.assert_close(
            got, want, atol=1e-6, rtol=1e-5,
            msg=f"{name} alpha={alpha} {key}: smooth_model differs from SmoothQuant applied layer by layer",
        )  # fmt: skip
