"""Matrix kernels for a decode step of a few rows on an x86 CPU: float32, Q8_0, Q4_0 and Q4_1, in C++ with AVX2
(and AVX-512 where the CPU has it); the C++ is cpu_kernels.cpp, beside this file.

At batch 1 a decode step is one matrix-vector product per weight matrix, and its floor is the bytes of
the matrix over the memory bandwidth: a kernel reaches it only if it reads each weight once, in memory
order, and does the little arithmetic per byte in registers while the next bytes stream in. inductor
does not produce that loop for quantized weights (it multiplied int8 codes at ~2 GB/s here), so this
module writes it, as llama.cpp's CPU backend does (ggml's vec_dot_q8_0_q8_0 and vec_dot_q4_1_q8_1):

- the weights are stored (out, in), row after row, in blocks of 32 inputs: Q8_0 has 32 int8 codes and
  one float16 scale d per block (w ~ d * q); Q4_1 has 32 4-bit codes in 16 bytes (input j of the block
  in the low nibble of byte j, input j + 16 in the high one), a float16 scale d and a float16 minimum m
  (w ~ d * q + m): 34 and 20 bytes per 32 weights, llama.cpp's own sizes;
- the activation x is quantized once per call to int8 blocks of 32 (scale dx, and dx * sum(q) for Q4_1's
  minimum term), so a block's dot product is 32 int8 x int8 products summed in integer registers
  (_mm256_maddubs_epi16 multiplies unsigned by signed bytes: for Q8_0 the sign of w moves onto x), then
  one float multiply-add by d * dx;
- float32 as a GEMM microkernel, vectorised over output rows rather than inputs: pack_f32 lays rows out in
  panels of sixteen, input-major, so a panel is one sequential stream (sixteen rows a pass in (out, in)
  order read sixteen streams at ~18 GB/s on one core here; a panel on 2 MB pages streams at the
  bandwidth), and each weight vector loaded is multiplied by every row of x in the batch (decodes, a
  verification's k + 1 tokens, a short chunk), broadcast: B rows read the weights once, and cost
  multiply-adds, not bytes, until the FMA units saturate (up to 6 rows a pass with AVX2's 16 registers,
  12 with AVX-512's). Each output is one running sum over the inputs in order, so a row's result is
  bitwise the same in any batch and on any number of threads;
- Q4_0 (llama.cpp's, w ~ d * (q - 8)) with rows interleaved in eights, as llama.cpp repacks it for x86: one
  broadcast of four x codes meets eight rows in one byte multiply-add (vpdpbusd with AVX512-VNNI) whose
  eight int32 lanes are the eight rows, so no horizontal sums; on SmolLM2's LM head, one thread, 0.5 ms
  against Q4_1's 1.5. pack_q8_0x8 lays Q8_0 out the same way for the engine (q8_0x8_matvec: the codes stored + 128
  against x's, 128 * sum(x) per block taken off): 4 rows through all of SmolLM2's matrices cost 1.3x one
  row, against 3.4x for Q4_1 one row a pass (bench multirow, one thread);
- Q8_0 (StaticDecoder's) and Q4_1 one row per pass, its blocks on four accumulators (with one, each block's multiply-add
  waited on the last), their block scales converted as they stream in (four rows a pass measured slower
  for both: 2.2x on the LM head for Q8_0, 1.4x over SmolLM2's matrices for Q4_1);
- huge_pages puts a decoder's matrices in one buffer on 2 MB pages: on 4 kB pages a stream misses the TLB
  every 4 kB, which cost this VM a third of its bandwidth;
- the passes are split across torch's threads (OpenMP, torch.set_num_threads).

decode_attention is a one-token step's attention over the keys written so far, the rest of a step that
inductor's loops took ~2.7 ms for at a 256-slot window; layer_qkv and layer_out are an engine's decoder
layer on either side of its paged attention (fast_paged.FusedLayer). ops() builds the extension on first use
(a C++ compiler, ~1 minute, cached in torch's extensions folder) and returns None, with a message, where it cannot: no compiler or no AVX2. Each op is
registered with a shape-only fake so torch.compile calls it from its compiled graph.

    ops = cpu_kernels.ops()
    codes, scales = cpu_kernels.quantize_q8_0(w)                 # w (out, in) float32
    y = ops.q8_0_matvec(x, codes, scales)                        # x (B, in) float32 -> (B, out) float32
"""

import functools
import platform
import shutil
from pathlib import Path

import torch

BLOCK = 32

SOURCE = Path(__file__).with_suffix(".cpp")  # the kernels, in C++


@functools.cache
def ops():
    """torch.ops.labkit_cpu (q8_0_matvec, q4_1_matvec, f32_matvec, decode_attention, stream_read, layer_qkv,
    layer_out), built on first use; None where it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        print("labkit.cpu_kernels: this CPU has no AVX2; the decode step uses PyTorch's kernels")
        return None
    if not shutil.which("c++"):
        print("labkit.cpu_kernels: no C++ compiler (c++) on PATH; the decode step uses PyTorch's kernels")
        return None
    from torch.utils.cpp_extension import load_inline

    print("labkit.cpu_kernels: loading the AVX2 matrix-vector kernels (the first time, a minute to compile them)")
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        flags += ["-mavx512f", "-mavx512vl"]  # f32_matvec takes up to twelve rows in one pass
        if "avx512_vnni" in _cpu_flags():
            flags.append("-mavx512vnni")  # q4_0_matvec's byte products in one instruction (vpdpbusd)
    load_inline(
        "labkit_cpu", SOURCE.read_text(), extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False
    )
    for name in ("q8_0_matvec", "q4_1_matvec"):  # shapes only, for torch.compile's tracing
        torch.library.register_fake(f"labkit_cpu::{name}")(lambda x, w, *rest: x.new_empty(x.shape[0], w.shape[0]))
    for name in ("q4_0_matvec", "q8_0x8_matvec"):  # rows interleaved in eights
        torch.library.register_fake(f"labkit_cpu::{name}")(lambda x, w, s: x.new_empty(x.shape[0], w.shape[0] * 8))
    torch.library.register_fake("labkit_cpu::f32_matvec")(lambda x, w: x.new_empty(x.shape[0], w.shape[0] * MR))
    torch.library.register_fake("labkit_cpu::decode_attention")(lambda q, k, v, pos: torch.empty_like(q))
    return torch.ops.labkit_cpu


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


MR = 16  # rows per panel of pack_f32's layout, as in cpu_kernels.cpp


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """(out, in) float -> (out / 16, in, 16) float32, f32_matvec's layout: rows in panels of sixteen, and for
    each input k a panel's sixteen weights back to back, so the loop over a panel reads one stream."""
    out, inp = w.shape
    if out % MR:
        raise ValueError(f"pack_f32: ({out}, {inp}) (out, in) needs out % {MR} == 0")
    return w.detach().float().reshape(out // MR, MR, inp).transpose(1, 2).contiguous()


def huge_pages(tensors):
    """The tensors (a list whose items are tensors or tuples of them) copied back to back into one buffer
    that Linux backs with 2 MB pages (madvise(MADV_HUGEPAGE), where transparent huge pages are "madvise" or
    "always"): streaming ~540 MB of weights on 4 kB pages misses the TLB every 4 kB, which on this VM cost
    a third of the bandwidth (a copy: 21 GB/s on 4 kB pages, 31 on 2 MB ones, one core). Elsewhere, or
    where the call fails, the same copies on ordinary pages."""
    flat = [t for item in tensors for t in (item if isinstance(item, tuple) else (item,))]
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in flat]  # each copy 64-byte aligned
    huge = 2**21
    length = -(-sum(sizes) // huge) * huge  # whole 2 MB pages, from a 2 MB boundary inside the buffer
    buf = torch.empty(length + huge, dtype=torch.uint8)
    start = -buf.data_ptr() % huge
    if platform.system() == "Linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buf.data_ptr() + start), ctypes.c_size_t(length), 14)  # 14: MADV_HUGEPAGE
    copies, offset = [], start
    for t, size in zip(flat, sizes, strict=True):
        copy = buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
        offset += size
    it = iter(copies)
    return [tuple(next(it) for _ in item) if isinstance(item, tuple) else next(it) for item in tensors]


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (codes (out, in) int8, scales (out, in / 32) float16): w ~ codes * scale, per block of 32."""
    out, inp = w.shape
    blocks = w.float().reshape(out, inp // BLOCK, BLOCK)
    scales = (blocks.abs().amax(-1) / 127).half()
    codes = torch.round(blocks / scales.float().clamp(min=1e-30)[..., None]).clamp(-127, 127)
    return codes.to(torch.int8).reshape(out, inp), scales


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float -> (packed (out, in / 2) uint8, scales, mins (out, in / 32) float16): w ~ code * d + m,
    the grid spanning each block's [min, max] in 15 steps, d and m rounded to float16 before codes are chosen."""
    out, inp = w.shape
    blocks = w.float().reshape(out, inp // BLOCK, BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scales, mins = ((hi - lo) / 15).half(), lo.half()
    codes = torch.round((blocks - mins.float()[..., None]) / scales.float().clamp(min=1e-30)[..., None])
    codes = codes.clamp(0, 15).to(torch.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # byte j: input j (low nibble), input j + 16 (high)
    return packed.reshape(out, inp // 2), scales, mins


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> q4_0_matvec's (packed (out / 8, in / 32, 128) uint8, scales (out / 8, in / 32, 8) float16):
    llama.cpp's Q4_0 (per block of 32, d = the signed value of largest magnitude / -8, code = trunc(w / d + 8.5)
    in 0..15, w ~ d * (code - 8)), rows interleaved in eights as cpu_kernels.cpp's q4_0_matvec reads them."""
    out, inp = w.shape
    if out % 8 or inp % BLOCK:
        raise ValueError(f"quantize_q4_0: ({out}, {inp}) (out, in) needs out % 8 == 0 and in % {BLOCK} == 0")
    blocks = w.detach().float().reshape(out, inp // BLOCK, BLOCK)
    d = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8
    codes = torch.trunc(blocks * torch.where(d == 0, 0, 1 / d) + 8.5).clamp(0, 15).to(torch.uint8)
    groups = codes.reshape(out // 8, 8, inp // BLOCK, BLOCK).transpose(1, 2)  # (out / 8, blocks, 8 rows, 32)
    pairs = groups[..., :16] | (groups[..., 16:] << 4)  # byte j: input j (low nibble), input j + 16 (high)
    packed = pairs.unflatten(-1, (4, 4)).transpose(2, 3).reshape(out // 8, inp // BLOCK, 128)  # quarter, row, 4
    return packed.contiguous(), d.squeeze(-1).half().reshape(out // 8, 8, -1).transpose(1, 2).contiguous()


def pack_q8_0x8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_q8_0's (codes (out, in), scales (out, in / 32)) -> q8_0x8_matvec's rows interleaved in eights:
    codes + 128 (out / 8, in / 32, 256) uint8 (for each four inputs, the eight rows' four codes) and scales
    (out / 8, in / 32, 8) float16."""
    out, inp = codes.shape
    if out % 8:
        raise ValueError(f"pack_q8_0x8: ({out}, {inp}) (out, in) needs out % 8 == 0")
    groups = codes.reshape(out // 8, 8, inp // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # group, block, quad, row, 4
    unsigned = (groups.reshape(out // 8, inp // BLOCK, 256).to(torch.int16) + 128).to(torch.uint8)
    return unsigned.contiguous(), scales.reshape(out // 8, 8, -1).transpose(1, 2).contiguous()


def round_activation(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) float32 rounded as the Q8_0 and Q4_1 loops round it before their integer products: per block
    of 32 inputs a scale d = max |x| / 127 and codes round(x / d) (ties to even) -> codes * d."""
    blocks = x.unflatten(-1, (-1, BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks * torch.where(d > 0, 1 / d, 0))
    return (codes * d).flatten(-2)


def dequantize(*weights: torch.Tensor) -> torch.Tensor:
    """quantize_q8_0's, quantize_q4_0's or quantize_q4_1's output -> the (out, in) float32 weights the kernels use."""
    if len(weights) == 2 and weights[0].dtype == torch.uint8:  # Q4_0, rows in eights
        packed, scales = weights
        pairs = packed.unflatten(-1, (4, 8, 4)).transpose(2, 3).flatten(-2)  # (out / 8, blocks, 8 rows, 16)
        codes = torch.cat([pairs & 15, pairs >> 4], -1).float() - 8  # (out / 8, blocks, 8, 32)
        w = codes * scales.float()[..., None]
        return w.transpose(1, 2).reshape(packed.shape[0] * 8, -1)
    if len(weights) == 2:
        codes, scales = weights
        return (codes.float().unflatten(1, (-1, BLOCK)) * scales.float()[..., None]).flatten(1)
    packed, scales, mins = weights
    blocks = packed.unflatten(1, (-1, BLOCK // 2))
    codes = torch.cat([blocks & 15, blocks >> 4], -1).float()
    return (codes * scales.float()[..., None] + mins.float()[..., None]).flatten(1)
