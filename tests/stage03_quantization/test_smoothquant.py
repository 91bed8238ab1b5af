"""SmoothQuant: the smoothing scale formula, exact equivalence in float after folding, and W8A8
error far below naive W8A8 when activations have outlier channels."""

import copy

import pytest
import torch
from torch import nn

from labkit.model import RMSNorm
from labkit.testing import LLAMA_CONFIGS, random_tokens

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
    prev = nn.Linear(128, 128, bias=False)  # a Linear before the Linears works the same way
    with torch.no_grad():
        prev.weight.normal_(generator=torch.Generator().manual_seed(seed))
        expected = [lin(norm(x)) for lin in linears] + [lin(prev(x)) for lin in linears]
        s = torch.rand(128, generator=torch.Generator().manual_seed(seed)) * 4 + 0.1
        n2, p2, l2, l3 = copy.deepcopy(norm), copy.deepcopy(prev), copy.deepcopy(linears), copy.deepcopy(linears)
        impl(MOD).fold_scale(n2, l2, s)
        impl(MOD).fold_scale(p2, l3, s)
        got = [lin(n2(x)) for lin in l2] + [lin(p2(x)) for lin in l3]
    assert not torch.equal(n2.weight, norm.weight), f"seed={seed}: the norm weight should have been divided by s"
    for e, o in zip(expected, got, strict=True):
        torch.testing.assert_close(o, e, atol=1e-4, rtol=1e-4, msg=f"seed={seed}: folding changed the output")


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_smoothed_model_is_equivalent_in_float(impl, make_llama, name):
    model = make_llama(3, **LLAMA_CONFIGS[name])
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
