"""AWQ: the activation-aware scale search beats round-to-nearest when a few input channels are
salient, and folding the scales leaves the float model's logits unchanged."""

import copy

import pytest
import torch
from torch import nn

from labkit.testing import LLAMA_CONFIGS, random_labkit_llama, random_tokens, with_random_biases

pytestmark = pytest.mark.in_process("the learner's code folds scales into the test's model, then the test runs it")

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
    assert abs(alpha * 20 - round(alpha * 20)) < 1e-9, (
        f"seed={seed}: α comes from the grid 0, 1/20, ..., 19/20, got {alpha}"
    )
    y = x @ W.T
    err_rtn = (x @ rtn(W, bits, 32).T - y).pow(2).mean().item()
    err_awq = ((x / s) @ rtn(W * s, bits, 32).T - y).pow(2).mean().item()
    assert err_awq < 0.8 * err_rtn, f"seed={seed}, bits={bits}: AWQ MSE {err_awq:.4g} not below RTN {err_rtn:.4g}"


def test_awq_search_keeps_the_first_alpha_on_a_tie(impl):
    """With every channel equally loud, s = mean|x|^α is constant, so after normalising every α gives
    s = 1 and the same loss: the search keeps the first, α = 0 (llm-awq compares with a strict <)."""
    linear, _ = salient_layer(3)
    signs = torch.randint(0, 2, (256, 128), generator=torch.Generator().manual_seed(3)) * 2 - 1.0
    s, alpha = impl(MOD).search_scale(linear, signs, [linear], bits=4, group_size=32)
    assert alpha == 0.0, f"every α ties; the first (0) is kept, got {alpha}"
    torch.testing.assert_close(s, torch.ones(128), msg="equal channels give s = 1")


# Qwen2-style biases on an MHA model, where AWQ also folds into Linears (v before o): their biases scale too.
BIASED = {"mha-untied+biases": dict(LLAMA_CONFIGS["mha-untied"], attention_bias=True, o_proj_bias=True, mlp_bias=True)}


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS | BIASED))
def test_awq_folded_model_has_the_same_logits(impl, name):
    model = with_random_biases(random_labkit_llama(7, **(LLAMA_CONFIGS | BIASED)[name]), 7)
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


def awq_groups(layer, cos, sin, mask):
    """AWQ's scaling groups of a Llama layer (the paper's, as in llm-awq's auto_scale): (op before,
    linears that read its output, the float function the loss is measured on, which input to record)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], lambda h: attn(h, cos, sin, mask), attn.q_proj),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], mlp, mlp.gate_proj),
        (mlp.up_proj, [mlp.down_proj], mlp.down_proj, mlp.down_proj),
    ]  # fmt: skip
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # v -> o folds one-to-one only without GQA
        groups.append((attn.v_proj, [attn.o_proj], attn.o_proj, attn.o_proj))
    return groups


@torch.no_grad()
def layer_by_layer_awq(awq, fold_scale, model, calib, bits: int, group_size: int):
    """AWQ on a model written out: per layer, record each group's input, search s with the module's
    (separately tested) search_scale, fold it, then run the scaled layer to get the next one's input."""
    from labkit.calibration import record_inputs

    x, cos, sin, mask = model.layer_inputs(calib)
    for layer in model.model.layers:
        groups = awq_groups(layer, cos, sin, mask)
        with record_inputs({j: m for j, (*_, m) in enumerate(groups)}) as inputs:
            layer(x, cos, sin, mask)
        for j, (prev, linears, block, _) in enumerate(groups):
            s, _ = awq.search_scale(block, torch.cat(inputs[j]), linears, bits, group_size)
            fold_scale(prev, linears, s)
        x = layer(x, cos, sin, mask)
    return model


@pytest.mark.parametrize("name", ["mha-untied", "gqa4-3layers"])
def test_awq_on_a_model_folds_the_searched_scale_of_every_group_layer_by_layer(impl, name):
    model = random_labkit_llama(5, **LLAMA_CONFIGS[name])
    calib = random_tokens(6, 24, model.config.vocab_size, batch=2)
    fold = impl("stage03_quantization.smoothquant").fold_scale
    expected = layer_by_layer_awq(impl(MOD), fold, copy.deepcopy(model), calib, bits=3, group_size=16)
    impl(MOD).awq_scale_model(model, calib, bits=3, group_size=16)
    for (key, got), want in zip(model.state_dict().items(), expected.state_dict().values(), strict=True):
        torch.testing.assert_close(
            got, want, atol=1e-6, rtol=1e-5,
            msg=f"{name} {key}: awq_scale_model differs from searching and folding s = mean|x|^α group by "
            "group, layer by layer, on the inputs of the already-scaled layers",
        )  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_awq_quantized_model_is_rtn_of_the_scaled_model(impl, seed):
    """AWQ = fold the scales, then round to nearest: the folded model computes the float function,
    and the quantized one differs from it only by the scaled weights' rounding."""
    model = random_labkit_llama(seed, num_key_value_heads=2)
    calib = random_tokens(seed, 24, model.config.vocab_size, batch=2)
    scaled = impl(MOD).awq_scale_model(copy.deepcopy(model), calib, bits=4, group_size=32)
    quantized = impl(MOD).awq_quantize_model(copy.deepcopy(model), calib, bits=4, group_size=32)
    for name, m in scaled.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            got = quantized.get_submodule(name).dequantize_weight()
            torch.testing.assert_close(
                got, rtn(m.weight, 4, 32), atol=2e-3 * m.weight.abs().max().item(), rtol=0,
                msg=f"seed={seed} {name}: AWQ's weight is not round-to-nearest of the scaled weight",
            )  # fmt: skip
