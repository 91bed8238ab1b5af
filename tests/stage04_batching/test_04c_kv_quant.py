"""§2–§4 of lab5.ipynb: the KV cache at one byte per element (fp8 e4m3 with per-head scales, int8 per token and
head), quantized on write and widened on read.

References are written here: torch's own float8_e4m3fn cast, int8's exact math, and a contiguous-cache labkit
Llama whose cache rounds each new key and value the same way (FakeQuantCache), never the stage's code.
"""

import pytest
import torch
from stage04_helpers import make_model, random_prompts

from labkit import TARGET
from labkit.model import KVCache
from labkit.testing import LLAMA_CONFIGS, assert_greedy_within

MODULE = "stage04_batching.kv_quant"
FORMATS = ("fp8_e4m3", "int8")
# The engine and the reference round the same float32 keys; their sums differ in order only (~1e-6), so a code
# may flip to its neighbour where x / scale sits on a rounding boundary. One such flip moves a logprob by far
# less than this; a format bug (a wrong scale, a missing one, keys for values) moves it by 1e-2 or more.
KV_LOGPROB_TOL = 5e-4


def ref_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., n_kv, D) through torch's e4m3 cast with one scale per head (n_kv,), back to float32."""
    return (x / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]


def ref_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact symmetric int8 per token and head: codes round(x / s), s = absmax / 127 (1 where absmax is 0)."""
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / s), s[..., 0]


class FakeQuantCache(KVCache):
    """labkit's contiguous cache, rounding each new key and value as the quantized pool stores it."""

    def __init__(self, model, fmt: str, k_scale=None, v_scale=None):
        super().__init__(model.config, 1, model.config.max_position_embeddings)
        self.fmt, self.scales = fmt, (k_scale, v_scale)

    def write(self, layer, k, v):  # k, v: (1, n_kv, T, D)
        k, v = (
            self._round(x.transpose(1, 2), s and s[layer]).transpose(1, 2)
            for x, s in zip((k, v), self.scales, strict=True)
        )
        return super().write(layer, k, v)

    def _round(self, x, scale):  # x: (1, T, n_kv, D)
        if self.fmt == "fp8_e4m3":
            return ref_fp8(x, scale)
        codes, s = ref_int8(x)
        return codes * s[..., None]


@torch.no_grad()
def ref_logprobs(model, fmt, scales, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) log-softmax of a one-pass forward with every key and value rounded as the pool rounds it."""
    cache = FakeQuantCache(model, fmt, *scales)
    return torch.log_softmax(model(torch.tensor([ids]), cache)[0].double(), -1)


def _engine_scales(engine, fmt):
    cache = engine.cache
    if fmt == "int8":
        return (None, None)
    assert all(s is not None for s in cache.k_scale + cache.v_scale), "every layer's fp8 scale is set by now"
    return ([s.clone() for s in cache.k_scale], [s.clone() for s in cache.v_scale])


def _check_against_reference(impl, engine, model, fmt, prompts, outs, what):
    """Each output's tokens follow the fake-quantized reference up to a near-tie (assert_greedy_within), and the
    logprob the engine reports for each token is the reference's to KV_LOGPROB_TOL."""
    scales = _engine_scales(engine, fmt)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        ref = ref_logprobs(model, fmt, scales, p + o.token_ids)[len(p) - 1 : -1]  # row t predicts output t
        want = ref.argmax(-1).tolist()
        assert_greedy_within(o.token_ids, want, ref.float(), KV_LOGPROB_TOL, f"{what}: request {i}")
        part = next((t for t, (a, b) in enumerate(zip(o.token_ids, want, strict=True)) if a != b), len(want))
        got = torch.tensor([lp.logprob for lp in o.logprobs[:part]], dtype=torch.float64)
        expect = ref[torch.arange(part), o.token_ids[:part]]
        err = (got - expect).abs()
        assert err.max() <= KV_LOGPROB_TOL, (
            f"{what}: request {i} token {int(err.argmax())}: logprob {got[err.argmax()]:.5f}, the reference that "
            f"rounds K/V as {fmt} gives {expect[err.argmax()]:.5f} (off by {err.max():.2e}): look at the "
            "quantize-on-write (scale per head / per token) and the dequantize-on-read"
        )
    # The reference must tell the formats apart from float32, or this test could not see a missing rounding.
    p, o = prompts[0], outs[0]
    with torch.no_grad():
        float_lp = torch.log_softmax(model(torch.tensor([p + o.token_ids]))[0].double(), -1)
    gap = (float_lp - ref_logprobs(model, fmt, scales, p + o.token_ids)).abs().max()
    assert gap > 5 * KV_LOGPROB_TOL, f"{what}: the {fmt} reference is within {gap:.1e} of float32: test too weak"


# §2: fp8 e4m3 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv,d", [(1, 8), (2, 16), (3, 64), (5, 72)])
@pytest.mark.parametrize("per_head", [True, False])
def test_fp8_scale_maps_each_heads_absmax_onto_448(impl, n_kv, d, per_head):
    kv = impl(MODULE)
    x = torch.randn(9, n_kv, d) * torch.logspace(-1, 1, n_kv)[:, None]  # heads of different sizes
    x[3, 0, 1] = -40.0  # the largest magnitude is negative
    amax = x.abs().amax(dim=(0, 2))
    want = amax / 448 if per_head else amax.max().repeat(n_kv) / 448
    got = kv.fp8_scale(x, per_head)
    assert got.shape == (n_kv,), f"fp8_scale returns one scale per kv head, shape ({n_kv},), got {tuple(got.shape)}"
    assert torch.allclose(got, want, rtol=1e-6), (
        f"per_head={per_head}: scales {got.tolist()}, want absmax / 448 = {want.tolist()} "
        f"({'each head its own' if per_head else 'one absmax over every head'}, of |x|, not x)"
    )
    zero = kv.fp8_scale(torch.zeros(4, n_kv, d), per_head)
    assert torch.equal(zero, torch.ones(n_kv)), f"an all-zero x has scale 1 (nothing to fit), got {zero.tolist()}"


@pytest.mark.parametrize("n_kv,d", [(1, 8), (2, 16), (4, 64)])
def test_quantize_fp8_is_torchs_e4m3_cast_of_x_over_its_heads_scale(impl, n_kv, d):
    kv = impl(MODULE)
    x = torch.randn(7, n_kv, d) * 3
    scale = torch.rand(n_kv) * 0.02 + 0.002  # small enough that some x / scale pass 448 and saturate
    codes = kv.quantize_fp8(x, scale)
    assert codes.dtype == torch.float8_e4m3fn, f"codes are torch.float8_e4m3fn (one byte), got {codes.dtype}"
    want = (x / scale[:, None]).to(torch.float8_e4m3fn)
    bad = codes.view(torch.uint8) != want.view(torch.uint8)
    assert not bad.any(), (
        f"{int(bad.sum())} of {x.numel()} codes differ from torch's cast of x / scale[head], first at "
        f"{bad.nonzero()[0].tolist()}: {codes[bad][0].float():.4g} vs {want[bad][0].float():.4g} "
        "(divide by the head's scale, saturate at +-448)"
    )
    back = kv.dequantize(codes, scale)
    assert back.dtype == torch.float32 and torch.equal(back, want.float() * scale[:, None]), (
        f"dequantize(codes, scale) is codes * scale[head] in float32; off by {(back - want.float() * scale[:, None]).abs().max():.3g}"
    )


# §3: int8 per token and head ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv,d", [(1, 8), (2, 16), (3, 64), (5, 72)])
def test_quantize_int8_rounds_x_over_its_tokens_absmax_per_head(impl, n_kv, d):
    kv = impl(MODULE)
    x = torch.randn(11, n_kv, d)
    x[2, :, 3] = 25.0  # an outlier channel: its token's scale grows, the other channels lose steps
    x[5, 0] = 0.0  # a head of zeros keeps scale 1
    x[6, -1, 0] = -9.0
    x[7, 0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale 1: exact ties, which go to even
    codes, scale = kv.quantize_int8(x)
    want_codes, want_scale = ref_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (11, n_kv), (
        f"int8 codes and a (N, n_kv) = (11, {n_kv}) scale, got {codes.dtype} and {tuple(scale.shape)}"
    )
    assert torch.allclose(scale, want_scale, rtol=1e-6), (
        f"scale[token, head] is absmax over head_dim / 127; worst {scale.flatten()[(scale - want_scale).abs().argmax()]:.4g}"
        f" vs {want_scale.flatten()[(scale - want_scale).abs().argmax()]:.4g}"
    )
    bad = codes.float() != want_codes
    assert not bad.any(), (
        f"{int(bad.sum())} of {x.numel()} codes differ from round(x / scale), first at {bad.nonzero()[0].tolist()}: "
        f"{int(codes[bad][0])} vs {int(want_codes[bad][0])} (round, do not truncate; -127..127)"
    )
    back = kv.dequantize(codes, scale)
    assert torch.equal(back, want_codes * want_scale[..., None]), "dequantize(codes, scale) is codes * scale[..., None]"
    err = (back - x).abs() / want_scale[..., None]
    assert err.max() <= 0.5 + 1e-4, f"every value within half a step of x, worst {err.max():.3f} steps"


# §4: through the engine ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", list(LLAMA_CONFIGS), ids=list(LLAMA_CONFIGS))
def test_engine_with_a_quantized_pool_follows_the_rounded_reference_under_preemption(impl, config, fmt):
    seed = list(LLAMA_CONFIGS).index(config)
    model = make_model(seed, **LLAMA_CONFIGS[config])
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    engine = engine_mod.LLMEngine(model, num_blocks=14, block_size=8, max_num_seqs=6, kv_cache_dtype=fmt)
    assert all(p.element_size() == 1 for p in engine.cache.k + engine.cache.v), f"{fmt}: one byte an element"
    preempted = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), original(seq))[1]
    prompts = random_prompts(seed, 6, 10, 40)
    params = sequence.SamplingParams(max_tokens=30, ignore_eos=True, logprobs=1)
    outs = engine.generate(prompts, params)
    assert preempted, f"seed={seed}: 14 blocks of 8 cannot hold 6 requests of up to 70 tokens: expected preemption"
    _check_against_reference(impl, engine, model, fmt, prompts, outs, f"{config} {fmt}, preempted {preempted}")
    assert engine.block_manager.num_used_blocks == 0, f"{config} {fmt}: blocks leaked"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", ["gqa2-tied", "mqa-odd"])
def test_prefix_cache_hits_read_the_quantized_blocks_back(impl, config, fmt):
    seed = list(LLAMA_CONFIGS).index(config)
    model = make_model(seed, **LLAMA_CONFIGS[config])
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    engine = engine_mod.LLMEngine(model, num_blocks=64, block_size=8, kv_cache_dtype=fmt)
    system = random_prompts(seed, 1, 40, 40)[0]
    prompts = [system + s for s in random_prompts(seed + 10, 3, 3, 12)]
    params = sequence.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    first = engine.generate(prompts[:1], params)
    rest = engine.generate(prompts[1:], params)
    assert all(o.num_cached_tokens >= 40 for o in rest), (
        f"{config} {fmt}: the 40-token system prompt should be read from the prefix cache, "
        f"cached {[o.num_cached_tokens for o in rest]}"
    )
    _check_against_reference(impl, engine, model, fmt, prompts, first + rest, f"{config} {fmt}, prefix hits")


def test_kv_cache_dtype_flag_builds_the_pool_and_refuses_unknown_formats(impl, monkeypatch):
    serve = impl("stage04_batching.serve")
    apps = []
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kw: apps.append(app))
    serve.main(["--model", str(TARGET), "--kv-cache-dtype", "int8", "--num-gpu-blocks-override", "16"])
    engine = apps[0].state.core.engine
    assert engine.config.kv_cache_dtype == "int8", f"--kv-cache-dtype int8 gave {engine.config.kv_cache_dtype!r}"
    assert engine.cache.k[0].dtype == torch.int8, f"the int8 pool stores int8 codes, got {engine.cache.k[0].dtype}"
    out = engine.generate([[5, 6, 7, 8]], impl("stage04_batching.sequence").SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) == 3, f"the int8 engine serves: {out}"
    with pytest.raises(SystemExit):
        serve.main(["--model", str(TARGET), "--kv-cache-dtype", "fp16"])  # argparse names the choices
    EngineConfig = impl("stage04_batching.config").EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8, got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="batch_invariant reads the float pool only"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", batch_invariant=True)
