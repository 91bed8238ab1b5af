"""AWQ: the activation-aware scale search beats round-to-nearest when a few input channels are
salient, and folding the scales leaves the float model's logits unchanged."""

import pytest
import torch
from torch import nn

from labkit.testing import LLAMA_CONFIGS, random_tokens

MOD = "stage03_quantization.awq"
SEEDS = [0, 1, 2]


def rtn(W: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round-to-nearest asymmetric group-wise fake quantization, written out here as the reference."""
    g = W.view(W.shape[0], -1, group_size)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    zero = torch.round(-lo / scale)
    return (scale * (torch.clamp(torch.round(g / scale) + zero, 0, 2**bits - 1) - zero)).view_as(W)


def salient_layer(seed: int):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 128, generator=g) * 0.05)
    x = torch.randn(512, 128, generator=g)
    salient = torch.randperm(128, generator=g)[:4]
    x[:, salient] *= 20.0  # a few channels carry most of the activation magnitude
    return linear, x


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [3, 4])
def test_awq_scale_search_beats_rtn_on_salient_channels(impl, seed, bits):
    linear, x = salient_layer(seed)
    W = linear.weight.detach().clone()
    s, alpha = impl(MOD).search_scale(linear, x, [linear], bits=bits, group_size=32)
    assert torch.equal(linear.weight, W), f"seed={seed}: search_scale must leave the weights as they were"
    assert s.shape == (128,) and 0 < alpha < 1, f"seed={seed}: expected s (128,) and a non-zero α, got α={alpha}"
    y = x @ W.T
    err_rtn = (x @ rtn(W, bits, 32).T - y).pow(2).mean().item()
    err_awq = ((x / s) @ rtn(W * s, bits, 32).T - y).pow(2).mean().item()
    assert err_awq < 0.8 * err_rtn, f"seed={seed}, bits={bits}: AWQ MSE {err_awq:.4g} not below RTN {err_rtn:.4g}"


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_awq_folded_model_has_the_same_logits(impl, make_llama, name):
    model = make_llama(7, **LLAMA_CONFIGS[name])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = random_tokens(7, 33, model.config.vocab_size, batch=2)
    with torch.no_grad():
        expected = model(ids)
        impl(MOD).awq_scale_model(model, random_tokens(8, 24, model.config.vocab_size, batch=2), bits=3, group_size=16)
        got = model(ids)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("layernorm" in k for k in changed), f"{name}: no scale was folded into any norm"
    assert not any("embed" in k or k == "lm_head.weight" for k in changed), f"{name}: embeddings must not change"

    torch.testing.assert_close(
        got, expected, atol=1e-4, rtol=1e-4, msg=f"{name}: folding AWQ scales changed the logits"
    )
