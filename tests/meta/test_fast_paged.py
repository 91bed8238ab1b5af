"""labkit.fast_paged: the engine's linear layers through labkit.cpu_kernels give the model's own logits."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import cpu_kernels, fast_paged
from labkit.testing import LLAMA_CONFIGS, TINY_LLAMA, random_labkit_llama, random_tokens, with_random_biases

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


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1"])
def test_quantized_linear_against_gguf_quants(ops, quantization):
    """A PackedLinear of llama.cpp's blocks against gguf.quants' dequantized weights times the activation rounded
    to int8 blocks, in float64, at B = 1..9 rows and widths that are odd multiples of 32; codes may sit one step
    from gguf's (test_fast_decode checks the quantizers), so the bound is one step per input plus rounding."""
    from gguf import GGMLQuantizationType, quants

    qtype = getattr(GGMLQuantizationType, quantization.upper())
    for out, inp in [(36, 96), (52, 160)] if quantization == "q4_1" else [(40, 96), (56, 160)]:  # rows in 8s
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
        if quantization == "q4_0":  # the same codes as gguf's: its weights exactly, so no step of slack
            assert torch.equal(cpu_kernels.dequantize(*cpu_kernels.quantize_q4_0(linear.weight.detach())), w_hat)
            step = torch.zeros_like(step)
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
        fast_paged.accelerate(model, quantization="q4_k")
    with pytest.raises(ValueError, match="cpp"):
        fast_paged.accelerate(model, kernels="avx")
    assert fast_paged.accelerate(model, kernels="torch") is model


def test_engine_config_names_the_quantizations():
    """serve --quantization takes GGUF's names; another is refused, naming the choices."""
    import argparse

    from stage04_batching.config import EngineConfig

    with pytest.raises(ValueError, match="q8_0"):
        EngineConfig(quantization="q4_k")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--quantization", "q4_1", "--kernels", "torch"])
    assert (EngineConfig.from_cli_args(args).quantization, args.kernels) == ("q4_1", "torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


FUSED_SHAPES = {**LLAMA_CONFIGS, "wide-gqa": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                 intermediate_size=160)}  # fmt: skip


def reference_linear(x: torch.Tensor, lin: nn.Linear, quantization: str | None) -> torch.Tensor:
    """x times lin's weight in float64, as the kernels see them: the blocks' weights and the activation rounded."""
    if quantization is None:
        return x.double() @ lin.weight.double().T
    w = cpu_kernels.dequantize(*getattr(cpu_kernels, f"quantize_{quantization}")(lin.weight.detach()))
    return cpu_kernels.round_activation(x.float()).double() @ w.double().T


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D): dimension j < D/2 rotates with j + D/2 by the angle of its cos/sin, written out."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[..., :half].double(), sin[..., :half].double()
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def whole_blocks(config: dict) -> bool:
    return all(config.get(k, 64) % cpu_kernels.BLOCK == 0 for k in ("hidden_size", "intermediate_size"))


FUSED_CASES = [(name, q) for name, config in FUSED_SHAPES.items() for q in (None, "q8_0", "q4_0", "q4_1")
               if q is None or whole_blocks(dict(TINY_LLAMA, **config))]  # fmt: skip
# the quantized blocks take widths of whole blocks of 32; the others are float32 only


@pytest.mark.parametrize("name,quantization", FUSED_CASES)
def test_fused_layer_against_its_modules_in_float64(ops, name, quantization):
    """FusedLayer.qkv and .out (forward_paged's two C++ calls a layer) against the layer written out in float64 from
    its weights: norm, q/k/v, RoPE at random positions; o_proj, residual, norm, SwiGLU, residual; at 1..9, 23
    rows. Quantized, the weights and each product's input are rounded as llama.cpp's blocks round them, so the
    bound allows an activation code one step off. Past max_rows a float32 pass is left to the modules (None)."""
    seed = list(FUSED_SHAPES).index(name)
    model = random_labkit_llama(seed, **FUSED_SHAPES[name], vocab_size=128)
    c = model.config
    fast = fast_paged.accelerate(model, quantization=quantization)
    for i, (layer, base) in enumerate(zip(fast.model.layers, model.model.layers, strict=True)):
        fused = layer.fused
        gen = torch.Generator().manual_seed(seed * 100 + i)
        for rows in [*range(1, 10), 23]:
            x = torch.randn(rows, c.hidden_size, generator=gen)
            pos = torch.randint(0, 200, (rows,), generator=gen)
            cos, sin = model.rope_cos[pos, None], model.rope_sin[pos, None]
            with torch.no_grad():
                q, k, v = fused.qkv(x, cos, sin)
                h = base.input_layernorm(x)
                attn = base.self_attn
                want = [reference_linear(h, p, quantization).view(rows, -1, c.head_dim)
                        for p in (attn.q_proj, attn.k_proj, attn.v_proj)]  # fmt: skip
                want[0], want[1] = reference_rope(want[0], cos, sin), reference_rope(want[1], cos, sin)
                y = torch.randn(rows, c.num_attention_heads, c.head_dim, generator=gen)
                got_out = fused.out(x, y)
                mid = x.double() + reference_linear(y.reshape(rows, -1), attn.o_proj, quantization)
                h2 = base.post_attention_layernorm(mid.float())
                mlp = base.mlp
                a = F.silu(reference_linear(h2, mlp.gate_proj, quantization)) * reference_linear(
                    h2, mlp.up_proj, quantization
                )
                want_out = mid + reference_linear(a.float(), mlp.down_proj, quantization)
            tol = 1e-5 if quantization is None else 3e-2
            for what, g, w in [("q", q, want[0]), ("k", k, want[1]), ("v", v, want[2]), ("out", got_out, want_out)]:
                err, scale = (g.double() - w).abs().max().item(), w.abs().max().item()
                assert err <= tol * scale + 1e-5, (
                    f"seed={seed} {name} {quantization} layer {i}, {rows} rows: {what} off by {err:.3g} (scale {scale:.3g})"
                )
        x = torch.randn(fast_paged.CPP_MAX_ROWS + 1, c.hidden_size, generator=gen)
        pos = torch.zeros(len(x), dtype=torch.long)
        left = fused.qkv(x, model.rope_cos[pos, None], model.rope_sin[pos, None])
        assert (left is None) == (quantization is None), (
            f"{name}: a long float32 pass goes to the GEMM, a quantized one not"
        )


def test_a_layer_that_cannot_fuse_runs_its_modules(ops):
    """Biases or Qwen3's q/k norm: no fused layer; a module swapped after accelerate() (stage 04's LoRA wraps them)
    sends forward_paged back to the modules, so the swap is not bypassed."""
    for extra in (dict(attention_bias=True), dict(mlp_bias=True), dict(qk_norm=True)):
        fast = fast_paged.accelerate(random_labkit_llama(0, **extra))
        assert not any(hasattr(layer, "fused") for layer in fast.model.layers), f"{extra}: fused"
    fast = fast_paged.accelerate(random_labkit_llama(0))
    layer = fast.model.layers[0]
    x, cos, sin = torch.randn(2, 64), fast.rope_cos[:2, None], fast.rope_sin[:2, None]
    assert layer.fused.qkv(x, cos, sin) is not None
    hook = layer.mlp.down_proj.register_forward_hook(lambda *_: None)  # a hook must see its module run
    assert layer.fused.out(x, torch.randn(2, 4, 16)) is None, "a hooked module is bypassed"
    hook.remove()
    assert layer.fused.out(x, torch.randn(2, 4, 16)) is not None
    layer.self_attn.k_proj = nn.Sequential(layer.self_attn.k_proj)
    assert layer.fused.qkv(x, cos, sin) is None and layer.fused.out(x, torch.randn(2, 4, 16)) is None


def test_stacked_packings_store_each_weight_once(ops):
    """q, k, v (and gate, up) pack into one stacked buffer; each layer's own packing is a view into it, and a
    second engine on the same model reuses both."""
    model = random_labkit_llama(1, hidden_size=64, intermediate_size=96)
    first, second = fast_paged.accelerate(model), fast_paged.accelerate(model)
    for a, b in zip(first.model.layers, second.model.layers, strict=True):
        stacked = a.fused.qkv_group.packed[0]
        q, k, v = (a.self_attn.q_proj.packed[0], a.self_attn.k_proj.packed[0], a.self_attn.v_proj.packed[0])
        assert q.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert k.data_ptr() == stacked[len(q) :].data_ptr()
        assert b.fused.qkv_group.packed[0].data_ptr() == stacked.data_ptr()


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_packed_eagle_head_runs_the_kernels_and_keeps_the_heads_forward(ops, quantization):
    """labkit.eagle.packed: every linear layer of the draft on the kernels, in the format asked, and the teacher-
    forced forward within that format's rounding of the float head's (Q8_0 moves a feature by about 1 %), and not exactly
    it; a shape the format cannot take (97 vocabulary rows, not whole eights) is refused, not run in float32."""
    from labkit import eagle

    model = random_labkit_llama(3, **LLAMA_CONFIGS["gqa4-3layers"], vocab_size=96)
    head = eagle.attach(model, torch.arange(96), seed=3)
    with torch.no_grad():
        for p in head.layer.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
    fast = eagle.packed(head, quantization)
    linears = [m for m in fast.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, fast_paged.PackedLinear) and m.quantization == quantization for m in linears)
    feats, ids = torch.randn(1, 7, model.config.hidden_size), random_tokens(5, 7, 96, 1)
    with torch.no_grad():
        want, got = head(feats, ids), fast(feats, ids)
    err = ((got - want).norm() / want.norm()).item()
    assert err < (1e-5 if quantization is None else 0.03), f"{quantization}: the packed head is {err:.3g} off"
    if quantization:
        assert err > 1e-6, "Q8_0 weights gave the float head's features exactly: not quantized"
    odd = eagle.attach(random_labkit_llama(3, **LLAMA_CONFIGS["gqa4-3layers"], vocab_size=97), torch.arange(97))
    with pytest.raises(ValueError, match="cannot store it as q8_0"):
        eagle.packed(odd, "q8_0")


def test_static_draft_equals_the_packed_heads_forward(ops):
    """labkit.fast_verify.StaticDraft (the benchmark's compiled draft step, eager here as StaticVerifier's test is:
    compiling is torch's, the benchmark runs it) over 6, 1, 2 and 2 positions of one sequence: each position's
    predicted feature is the Q8_0-packed head's teacher-forced one (the same kernels and layout), its logits that
    feature through the head's LM head at the head's tokens (a shuffled subset, so a scatter into the wrong columns
    shows) and -inf elsewhere; the keys cross a window of 8, so the wider one runs."""
    backend = "eager"
    from labkit import eagle
    from labkit.fast_verify import StaticDraft

    model = random_labkit_llama(5, **LLAMA_CONFIGS["gqa4-3layers"], vocab_size=96)
    vocab = torch.randperm(96, generator=torch.Generator().manual_seed(5))[:40]
    head = eagle.attach(model, vocab, seed=5)
    with torch.no_grad():  # attach starts from f_{t+1} = f_t: a layer adding nothing and no fc bias
        for p in [*head.layer.parameters(), head.fc.bias]:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(6))
    fast = eagle.packed(head, "q8_0")
    feats, ids = torch.randn(11, model.config.hidden_size), random_tokens(6, 11, 96, 1)[0]
    draft = StaticDraft(head, head.new_cache(16), window=8, backend=backend)
    with torch.no_grad():
        want = fast(feats[None], ids[None])[0]
        start = 0
        for T in (6, 1, 2, 2):
            got, logits = draft(feats[start : start + T], ids[start : start + T])
            torch.testing.assert_close(got, want[start : start + T], atol=1e-5, rtol=1e-5, msg=f"{backend}: at {start}")
            masked = torch.ones(96, dtype=torch.bool)
            masked[vocab] = False
            assert torch.isneginf(logits[:, masked]).all(), f"{backend}: a token outside the head's vocabulary"
            torch.testing.assert_close(logits[:, vocab], fast.lm_head(want[start : start + T]), atol=1e-4, rtol=1e-4)
            start += T
    assert draft.cache.length == 11
