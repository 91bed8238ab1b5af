"""Quantization primitives: round-trip error bounds from first principles, exact bit packing,
the published NF4 table, FP8 ranges and saturation."""

import pytest
import torch

MOD = "stage03_quantization.primitives"
SEEDS = [0, 1, 2]

# bitsandbytes functional.get_4bit_type("nf4"), by index.
NF4_PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def heavy_tailed(seed: int, shape=(48, 256)) -> torch.Tensor:
    """Student-t-like weights with rows of very different magnitudes, like a trained layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp(min=0.05).sqrt()
    return x * torch.logspace(-2, 1, shape[0])[torch.randperm(shape[0], generator=g)][:, None]


@pytest.mark.parametrize("seed", SEEDS)
def test_int8_per_tensor_error_within_half_scale(impl, seed):
    x = heavy_tailed(seed)
    codes, scale = impl(MOD).quantize_int8(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape, f"seed={seed}: codes must be int8 shaped like x"
    assert scale.numel() == 1, f"seed={seed}: per-tensor quantization has one scale, got shape {tuple(scale.shape)}"
    torch.testing.assert_close(scale.reshape(()), x.abs().max() / 127, msg=f"seed={seed}: scale = absmax / 127")
    err = (x - impl(MOD).dequantize_int8(codes, scale)).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all(), f"seed={seed}: max error {err.max():.3g} > scale/2 = {scale / 2}"
    assert codes.abs().max() == 127, f"seed={seed}: the largest |x| must map to ±127"


@pytest.mark.parametrize("seed", SEEDS)
def test_int8_per_channel_has_one_scale_per_row(impl, seed):
    x = heavy_tailed(seed)
    codes, scale = impl(MOD).quantize_int8(x, per_row=True)
    assert scale.shape == (x.shape[0], 1), f"seed={seed}: per-row scales must be (out, 1), got {tuple(scale.shape)}"
    torch.testing.assert_close(scale, x.abs().amax(1, keepdim=True) / 127, msg=f"seed={seed}: row absmax / 127")
    deq = impl(MOD).dequantize_int8(codes, scale)
    assert ((x - deq).abs() <= scale / 2 * (1 + 1e-5)).all(), f"seed={seed}: error above half the row's scale"
    per_tensor = impl(MOD).dequantize_int8(*impl(MOD).quantize_int8(x))
    rel = lambda y: ((x - y).norm(dim=1) / x.norm(dim=1)).mean().item()  # noqa: E731
    assert rel(deq) < 0.1 * rel(per_tensor), (
        f"seed={seed}: rows differ 1000× in magnitude, so per-channel scales should cut the mean relative "
        f"row error >10×; got {rel(deq):.3g} vs per-tensor {rel(per_tensor):.3g}"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_int8_all_zero_and_one_signed_rows(impl, seed):
    x = heavy_tailed(seed, (6, 40))
    x[0] = 0.0  # a dead output channel
    x[1] = x[1].abs()  # all positive
    x[2] = -x[2].abs()  # all negative
    codes, scale = impl(MOD).quantize_int8(x, per_row=True)
    assert (scale > 0).all() and torch.isfinite(scale).all(), (
        f"seed={seed}: every row, even all-zero, needs a scale > 0"
    )
    assert (codes[0] == 0).all(), f"seed={seed}: an all-zero row quantizes to code 0"
    deq = impl(MOD).dequantize_int8(codes, scale)
    assert torch.equal(deq[0], x[0]), f"seed={seed}: an all-zero row comes back exactly"
    assert codes[1].max() == 127 and codes[2].min() == -127, f"seed={seed}: a one-signed row still uses ±127"
    assert ((x - deq).abs() <= scale / 2 * (1 + 1e-5)).all(), f"seed={seed}: error above half the row's scale"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_groupwise_error_within_half_scale(impl, seed, bits, group_size):
    w = heavy_tailed(seed)
    w[:, ::17] = 0.0  # zeros must survive exactly: the grid contains 0
    codes, scales, zeros = impl(MOD).quantize_groupwise(w, bits, group_size)
    n_groups = w.shape[1] // group_size
    assert codes.shape == w.shape and codes.dtype == torch.uint8, f"seed={seed}: codes (out, in) uint8"
    assert scales.shape == zeros.shape == (w.shape[0], n_groups), f"seed={seed}: one scale/zero per group"
    assert int(codes.max()) <= 2**bits - 1, f"seed={seed}: codes must fit in {bits} bits"
    groups = w.view(w.shape[0], n_groups, group_size)
    span = groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)
    torch.testing.assert_close(scales.float(), span / (2**bits - 1), msg=f"seed={seed}: scale = (max - min) / maxq")
    deq = impl(MOD).dequantize_groupwise(codes, scales, zeros)
    half = (scales.float() / 2).repeat_interleave(group_size, 1)
    err = (w - deq).abs()
    assert (err <= half * (1 + 1e-4) + 1e-7).all(), f"seed={seed}: error {(err - half).max():.3g} above scale/2"
    assert (deq[:, ::17] == 0).all(), f"seed={seed}: a zero weight must dequantize to exactly 0"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [3, 4])
def test_groupwise_all_positive_and_all_negative_groups_keep_zero_on_the_grid(impl, seed, bits):
    maxq = 2**bits - 1
    w = heavy_tailed(seed, (8, 96)).abs() + 0.01  # every group strictly positive ...
    w[1::2] *= -1  # ... or, on odd rows, strictly negative
    codes, scales, zeros = impl(MOD).quantize_groupwise(w, bits, 32)
    groups = w.view(8, 3, 32)
    span = groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)  # the range widened to contain 0
    torch.testing.assert_close(scales.float(), span / maxq, msg=f"seed={seed}: one-signed groups still span 0")
    assert (zeros[0::2] == 0).all() and (zeros[1::2] == maxq).all(), (
        f"seed={seed}: 0 sits at code 0 in an all-positive group and at code {maxq} in an all-negative one"
    )
    err = (w - impl(MOD).dequantize_groupwise(codes, scales, zeros)).abs()
    assert (err <= (scales.float() / 2).repeat_interleave(32, 1) * (1 + 1e-4)).all(), f"seed={seed}: error > scale/2"


@pytest.mark.parametrize("seed", SEEDS)
def test_groupwise_smaller_groups_smaller_error(impl, seed):
    w = heavy_tailed(seed)
    mod = impl(MOD)
    errs = [(w - mod.dequantize_groupwise(*mod.quantize_groupwise(w, 4, g))).pow(2).mean() for g in (32, 64, 128)]
    assert errs[0] < errs[1] < errs[2], f"seed={seed}: MSE should grow with the group size, got {errs}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_roundtrip_is_exact(impl, seed, bits):
    n = 1000 + seed  # not a multiple of 8
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = impl(MOD).pack(codes, bits)
    assert packed.dtype == torch.uint8, f"seed={seed}: packed must be uint8"
    assert packed.numel() == -(-n // 8) * bits, f"seed={seed}: {n} {bits}-bit codes take ceil(n/8)*bits bytes"
    assert torch.equal(impl(MOD).unpack(packed, bits, n), codes), f"seed={seed}, bits={bits}: round trip changed codes"


@pytest.mark.parametrize("seed", SEEDS)
def test_pack_4bit_two_codes_per_byte_high_nibble_first(impl, seed):
    codes = torch.randint(0, 16, (64, 32), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    flat = codes.reshape(-1)
    expected = (flat[0::2] << 4) | flat[1::2]  # bitsandbytes: first element in the high nibble
    assert torch.equal(impl(MOD).pack(codes, 4), expected), f"seed={seed}: byte k must hold codes 2k (high), 2k+1"


def test_nf4_codebook_is_the_bitsandbytes_table(impl):
    code = impl(MOD).nf4_codebook()
    torch.testing.assert_close(code, torch.tensor(NF4_PUBLISHED), atol=1e-6, rtol=0, msg="NF4 table mismatch")
    assert (code < 0).sum() == 7 and (code == 0).sum() == 1 and (code > 0).sum() == 8, "7 negative, 0, 8 positive"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(16, 192), (12, 80)])  # (12, 80): blocks of 64 run across rows
def test_nf4_picks_the_nearest_code_per_block(impl, seed, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    codes, absmax = impl(MOD).quantize_nf4(w, block_size=64)
    blocks = w.reshape(-1, 64)
    torch.testing.assert_close(absmax, blocks.abs().amax(1), msg=f"seed={seed} {shape}: absmax per block of 64")
    table = torch.tensor(NF4_PUBLISHED)
    nearest = table[(blocks / absmax[:, None])[..., None].sub(table).abs().argmin(-1)]  # brute force
    expected = (nearest * absmax[:, None]).reshape(w.shape)
    got = impl(MOD).dequantize_nf4(codes, absmax)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=f"seed={seed} {shape}: not the nearest NF4 level")
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15, f"seed={seed}: NF4 codes are 4-bit uint8"


def test_nf4_exact_midpoints_round_down_as_bitsandbytes_does(impl):
    """bitsandbytes' dQuantizeNF4 compares with `x > midpoint`, so a value exactly between two levels
    takes the lower one. Each block holds 1.0 (its absmax) and the 15 midpoints."""
    table = impl(MOD).nf4_codebook()  # equal to NF4_PUBLISHED (tested above), bit for bit what it compares with
    mids = (table[1:] + table[:-1]) / 2
    w = torch.cat([torch.ones(1), mids]).repeat(4)  # 4 blocks of 16
    codes, absmax = impl(MOD).quantize_nf4(w, block_size=16)
    assert torch.equal(absmax, torch.ones(4)), "each block's absmax is 1"
    assert codes.reshape(4, 16)[:, 1:].tolist() == [list(range(15))] * 4, (
        "midpoint i lies between levels i, i + 1: take i"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_nf4_double_quantization_of_absmax(impl, seed):
    mod = impl(MOD)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(seed))
    _, absmax = mod.quantize_nf4(w, 64)  # 192 entries: not a multiple of the 256 block
    codes, scales, offset = mod.double_quantize(absmax, 256)
    assert codes.dtype == torch.int8 and codes.numel() == absmax.numel(), f"seed={seed}: one int8 per absmax"
    assert scales.numel() == 1, f"seed={seed}: 192 values make one block of 256"
    torch.testing.assert_close(offset.reshape(()), absmax.mean(), msg=f"seed={seed}: offset is the mean")
    restored = mod.double_dequantize(codes, scales, offset, 256)
    step = (absmax - absmax.mean()).abs().max() / 127
    assert ((restored - absmax).abs() <= step / 2 * (1 + 1e-4)).all(), f"seed={seed}: error above half a step"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n,block_size", [(600, 256), (300, 64)])
def test_double_quantization_scales_each_block_of_absmax_values_on_its_own(impl, seed, n, block_size):
    """A 7B model has thousands of absmax values: several second-level blocks (the last one partial), whose
    spreads differ by orders of magnitude. Each block's int8 step is its own max |absmax - mean| / 127."""
    mod = impl(MOD)
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // block_size)
    spread = torch.logspace(-3, 0, blocks)[torch.randperm(blocks, generator=g)]
    absmax = 1.0 + torch.randn(n, generator=g) * spread.repeat_interleave(block_size)[:n]
    codes, scales, offset = mod.double_quantize(absmax, block_size)
    assert codes.dtype == torch.int8 and codes.shape == (n,), f"seed={seed}: one int8 code per absmax value"
    assert scales.shape == (blocks, 1), f"seed={seed}: {n} values in blocks of {block_size} need {blocks} scales"
    restored = mod.double_dequantize(codes, scales, offset, block_size)
    for j in range(blocks):  # the slow obvious version, one block at a time
        part = slice(j * block_size, (j + 1) * block_size)
        centered = absmax[part].double() - absmax.double().mean()
        step = centered.abs().max() / 127
        assert scales[j, 0].item() == pytest.approx(step.item(), rel=1e-5), f"seed={seed}: block {j}'s scale"
        err = (restored[part].double() - absmax[part].double()).abs().max()
        assert err <= step / 2 * (1 + 1e-3), (
            f"seed={seed} n={n} block_size={block_size}: block {j} (spread {spread[j]:.0e}) restored with error "
            f"{err:.2e}, above half its own step {step / 2:.2e}"
        )


@pytest.mark.parametrize("name,fmax", [("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)])
def test_fp8_absmax_maps_to_the_format_max(impl, name, fmax):
    dtype = getattr(torch, name)
    x = heavy_tailed(0)
    codes, scale = impl(MOD).quantize_fp8(x, dtype)
    assert codes.dtype == dtype, f"codes must be {name}"
    assert codes.float().abs().max() == fmax, f"{name}: the largest |x| must land on ±{fmax}"
    torch.testing.assert_close(scale.reshape(()), x.abs().max() / fmax, msg=f"{name}: scale = absmax / {fmax}")


@pytest.mark.parametrize("name,fmax", [("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)])
def test_fp8_saturates_instead_of_overflowing(impl, name, fmax):
    dtype = getattr(torch, name)
    x = torch.tensor([1e9, -1e9, fmax * 3, 1.0])
    codes, scale = impl(MOD).quantize_fp8(x, dtype, scale=1.0)
    got = impl(MOD).dequantize_fp8(codes, scale)
    assert torch.equal(got, torch.tensor([fmax, -fmax, fmax, 1.0])), (
        f"{name}: expected saturation at ±{fmax}, got {got}"
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name,mantissa,min_subnormal", [("float8_e4m3fn", 3, 2.0**-9), ("float8_e5m2", 2, 2.0**-16)])
def test_fp8_error_is_relative(impl, seed, name, mantissa, min_subnormal):
    x = heavy_tailed(seed)
    codes, scale = impl(MOD).quantize_fp8(x, getattr(torch, name))
    err = (x - impl(MOD).dequantize_fp8(codes, scale)).abs()
    # Round to nearest: half an ulp, i.e. 2^-(m+1) relative for normals, half the subnormal step below.
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), torch.tensor(min_subnormal / 2) * scale)
    assert (err <= bound * (1 + 1e-5)).all(), f"seed={seed}, {name}: error above half an ulp"
