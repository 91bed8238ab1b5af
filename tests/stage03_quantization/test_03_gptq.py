"""GPTQ: the Hessian, equality with a slow column-by-column reference, and beating round-to-nearest."""

import copy

import pytest
import torch

from labkit.testing import random_labkit_llama

MOD = "stage03_quantization.gptq"
SEEDS = [0, 1, 2]


def correlated_inputs(seed: int, n: int, dim: int, dtype=torch.float32) -> torch.Tensor:
    """(n, dim) activations whose channels are strongly correlated and of unequal scale."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) * torch.logspace(0, -2, dim, dtype=torch.float64)
    z = torch.randn(n, dim, generator=g, dtype=torch.float64)
    return (z @ mix.T * torch.rand(dim, generator=g, dtype=torch.float64).add(0.2)).to(dtype)


def minmax_grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (scale, zero) per row of w (out, g), over a range that includes 0."""
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    return scale, torch.round(-lo / scale)


def slow_gptq(W, H, bits, group_size, percdamp=0.01, act_order=False):
    """Optimal Brain Quantization, one column at a time with an explicit inverse Hessian:
    quantize column i, move its error onto the later columns by -err·H⁻¹[i, j]/H⁻¹[i, i], then
    eliminate i from H⁻¹. No Cholesky, no blocks. float64. Returns W_hat in the original order."""
    W, H = W.clone().double(), H.clone().double()
    out, n = W.shape
    maxq = 2**bits - 1
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n)
    static = [minmax_grid(W[:, g * group_size : (g + 1) * group_size], bits) for g in range(n // group_size)]
    W, H = W[:, order], H[order][:, order]
    H = H + percdamp * torch.diag(H).mean() * torch.eye(n, dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    W_hat = torch.zeros_like(W)
    for i in range(n):
        if act_order:
            scale, zero = static[int(order[i]) // group_size]
        elif i % group_size == 0:
            scale, zero = minmax_grid(W[:, i : i + group_size], bits)
        q = torch.clamp(torch.round(W[:, i] / scale) + zero, 0, maxq)
        W_hat[:, i] = scale * (q - zero)
        err = W[:, i] - W_hat[:, i]
        W[:, i + 1 :] -= torch.outer(err / Hinv[i, i], Hinv[i, i + 1 :])
        Hinv = Hinv - torch.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return W_hat[:, torch.argsort(order)]


def dequant(codes, scales, zeros):
    g = scales.shape[1]
    c = codes.double().view(codes.shape[0], g, -1)
    return ((c - zeros.double()[..., None]) * scales.double()[..., None]).view(codes.shape)


@pytest.mark.parametrize("seed", SEEDS)
def test_hessian_is_running_average_of_2xxT(impl, seed):
    x = correlated_inputs(seed, 300, 24)
    h = impl(MOD).Hessian(24)
    for chunk in (x[:7], x[7:107].view(4, 25, 24), x[107:]):  # uneven batches, extra leading dims
        h.add_batch(chunk)
    expected = 2 / len(x) * x.double().T @ x.double()
    torch.testing.assert_close(h.H.double(), expected, rtol=1e-4, atol=1e-5, msg=f"seed={seed}: H != 2/n Σ x xᵀ")
    assert h.n == 300, f"seed={seed}: counted {h.n} tokens, expected 300"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_equals_slow_column_by_column_reference(impl, seed, act_order):
    g = torch.Generator().manual_seed(100 + seed)
    W = torch.randn(6, 32, generator=g, dtype=torch.float64)
    x = correlated_inputs(seed, 200, 32, torch.float64)
    H = 2 / len(x) * x.T @ x
    expected = slow_gptq(W, H, bits=3, group_size=8, act_order=act_order)
    # block_size 16 < 32 columns: exercises the lazy update between blocks
    codes, scales, zeros = impl(MOD).gptq_quantize(W, H, bits=3, group_size=8, block_size=16, act_order=act_order)
    assert codes.shape == W.shape and scales.shape == zeros.shape == (6, 4), f"seed={seed}: wrong output shapes"
    torch.testing.assert_close(
        dequant(codes, scales, zeros), expected, atol=1e-9, rtol=1e-9,
        msg=f"seed={seed}, act_order={act_order}: GPTQ differs from the column-by-column reference",
    )  # fmt: skip


@pytest.mark.parametrize("percdamp", [0.1, 0.5])
def test_gptq_uses_the_damping_it_is_given(impl, percdamp):
    g = torch.Generator().manual_seed(7)
    W = torch.randn(5, 16, generator=g, dtype=torch.float64)
    x = correlated_inputs(7, 60, 16, torch.float64)
    H = 2 / len(x) * x.T @ x
    expected = slow_gptq(W, H, bits=3, group_size=8, percdamp=percdamp)
    codes, scales, zeros = impl(MOD).gptq_quantize(W, H, bits=3, group_size=8, block_size=8, percdamp=percdamp)
    torch.testing.assert_close(
        dequant(codes, scales, zeros), expected, atol=1e-9, rtol=1e-9, msg=f"percdamp={percdamp}"
    )


def test_gptq_sets_the_weights_of_a_dead_input_to_zero(impl):
    """An input that is always 0 has H_ii = 0: its weights never matter, and GPTQ writes 0 for them."""
    g = torch.Generator().manual_seed(8)
    W = torch.randn(6, 16, generator=g, dtype=torch.float64) + 0.5
    x = correlated_inputs(8, 80, 16, torch.float64)
    x[:, [3, 11]] = 0.0
    codes, scales, zeros = impl(MOD).gptq_quantize(W, 2 / len(x) * x.T @ x, bits=4, group_size=8, block_size=8)
    W_hat = dequant(codes, scales, zeros)
    assert torch.isfinite(W_hat).all(), "a dead input must not make H singular"
    assert (W_hat[:, [3, 11]] == 0).all(), f"dead inputs 3 and 11 should get weight 0, got {W_hat[:, [3, 11]]}"


def rtn(W: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    out = torch.empty_like(W)
    for s in range(0, W.shape[1], group_size):
        scale, zero = minmax_grid(W[:, s : s + group_size], bits)
        q = torch.clamp(torch.round(W[:, s : s + group_size] / scale[:, None]) + zero[:, None], 0, 2**bits - 1)
        out[:, s : s + group_size] = scale[:, None] * (q - zero[:, None])
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_output_error_below_round_to_nearest(impl, seed, bits):
    g = torch.Generator().manual_seed(200 + seed)
    W = torch.randn(32, 128, generator=g)
    x = correlated_inputs(seed, 512, 128)
    H = 2 / len(x) * x.T @ x
    codes, scales, zeros = impl(MOD).gptq_quantize(W, H, bits=bits, group_size=32)
    err_gptq = ((W.double() - dequant(codes, scales, zeros)) @ x.double().T).pow(2).sum().item()
    err_rtn = ((W - rtn(W, bits, 32)).double() @ x.double().T).pow(2).sum().item()
    assert err_gptq < 0.5 * err_rtn, (
        f"seed={seed}, bits={bits}: ||WX - ŴX||² should be under half of RTN's: GPTQ {err_gptq:.4g}, RTN {err_rtn:.4g}"
    )


@torch.no_grad()
def layer_by_layer_gptq(gptq, model, calib, bits: int, group_size: int, act_order: bool) -> dict[str, torch.Tensor]:
    """GPTQ as the paper runs it on a model, written out: each decoder layer's Hessians come from
    the inputs it receives after every layer before it was quantized. Each linear is quantized
    with the module's own (separately tested) Hessian and gptq_quantize; returns {name: W_hat}
    and quantizes `model` in place (its nn.Linear weights become W_hat)."""
    from labkit.calibration import record_inputs

    x, cos, sin, mask = model.layer_inputs(calib)
    weights = {}
    for i, layer in enumerate(model.model.layers):
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        with record_inputs(linears) as inputs:
            layer(x, cos, sin, mask)
        for name, linear in linears.items():
            h = gptq.Hessian(linear.in_features)
            for batch in inputs[name]:
                h.add_batch(batch)
            codes, scales, zeros = gptq.gptq_quantize(linear.weight.float(), h.H, bits, group_size, act_order=act_order)
            linear.weight.copy_(dequant(codes, scales.half(), zeros))  # QuantLinear keeps float16 scales
            weights[f"model.layers.{i}.{name}"] = linear.weight.clone()
        x = layer(x, cos, sin, mask)
    return weights


@pytest.mark.parametrize("seed,act_order", [(0, False), (1, True)])
@pytest.mark.in_process("the learner's code changes the test's model in place")
def test_gptq_on_a_model_is_gptq_layer_by_layer_on_propagated_inputs(impl, seed, act_order):
    from labkit.testing import random_tokens

    model = random_labkit_llama(seed, num_hidden_layers=3, num_key_value_heads=2)
    calib = random_tokens(seed, 40, model.config.vocab_size, batch=3)
    expected = layer_by_layer_gptq(impl(MOD), copy.deepcopy(model), calib, 4, 32, act_order)
    impl(MOD).gptq_quantize_model(model, calib, bits=4, group_size=32, act_order=act_order)
    for name, W_hat in expected.items():
        torch.testing.assert_close(
            model.get_submodule(name).dequantize_weight(), W_hat, atol=1e-6, rtol=0,
            msg=f"seed={seed} act_order={act_order} {name}: differs from GPTQ applied layer by layer with the "
            "inputs propagated through the already-quantized layers",
        )  # fmt: skip


def test_gptq_on_a_model_keeps_every_bias(impl):
    from labkit.testing import random_tokens, with_random_biases

    model = with_random_biases(random_labkit_llama(3, attention_bias=True, o_proj_bias=True, mlp_bias=True), 3)
    biases = {n.removesuffix(".bias"): p.detach().clone() for n, p in model.named_parameters() if n.endswith(".bias")}
    ids = random_tokens(3, 19, model.config.vocab_size, batch=2)
    with torch.no_grad():
        expected = model(ids)
        impl(MOD).gptq_quantize_model(model, random_tokens(4, 40, model.config.vocab_size, batch=2), 8, 32)
        got = model(ids)
    for name, bias in biases.items():
        assert torch.equal(model.get_submodule(name).bias, bias), f"{name}: GPTQ dropped or changed the bias"
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 0.02, f"INT8 GPTQ moved the biased model's logits by {rel:.3g}"
