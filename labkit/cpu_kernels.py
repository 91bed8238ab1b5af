"""Matrix-vector kernels for a batch-1 decode step on an x86 CPU: float32, Q8_0 and Q4_1, in C++ with AVX2.

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
- float32 rows sixteen per pass: each load of x serves them all, and their sixteen sums are independent
  chains the core overlaps (at four rows a pass the loop read SmolLM2's 538 MB at ~13.6 GB/s on one
  core, at sixteen ~18 GB/s, the rate of torch's own sum over the same tensors); Q8_0 and Q4_1 one row
  per pass, their block scales converted as they stream in (four rows a pass measured slower for both:
  2.2x on the LM head for Q8_0, 1.4x over SmolLM2's matrices for Q4_1 with its scales converted up front);
- a batch of B inputs reads each float32 pass's rows from memory once: x's other rows find them in L1;
- the passes are split across torch's threads (OpenMP, torch.set_num_threads).

decode_attention is a one-token step's attention over the keys written so far, the rest of a step that
inductor's loops took ~2.7 ms for at a 256-slot window. ops() builds the extension on first use
(a C++ compiler, ~1 minute, cached in torch's extensions folder) and returns None, with a message, where it cannot: no compiler or no AVX2. Each op is
registered with a shape-only fake so torch.compile calls it from its compiled graph.

    ops = cpu_kernels.ops()
    codes, scales = cpu_kernels.quantize_q8_0(w)                 # w (out, in) float32
    y = ops.q8_0_matvec(x, codes, scales)                        # x (B, in) float32 -> (B, out) float32
"""

import functools
import platform
import shutil

import torch

BLOCK = 32

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

constexpr int ROWS = 4;               // rows per pass of the float32 loop's tail (out % 16 rows)
constexpr int F32_ROWS = 16;          // rows per pass of the float32 loop (16 accumulators: AVX2 has 16 registers)

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// x (n,) float -> int8 codes q (n,), per block of 32 a scale dx and dx * sum(q): x ~ dx * q
static void quantize_row(const float* x, int64_t n, int8_t* q, float* dx, float* dsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < n / 32; b++) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      v[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    float d = hmax(amax) / 127.f;
    __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i c[4];
    for (int j = 0; j < 4; j++)  // to the nearest integer, ties to even
      c[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    // 32 int32 -> 32 int8: the packs work per 128-bit lane, the permute restores the order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i*)(q + b * 32), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    dx[b] = d;
    dsum[b] = d * hsum(_mm256_cvtepi32_ps(sum));
  }
}

// 32 unsigned bytes times 32 signed bytes, summed in pairs, then in fours: 8 int32 sums as floats
static inline __m256 dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// The shared frame: each of x's B rows quantized once, then the out rows in passes of R over the threads;
// pass.operator()<R>(r, nb, qx, dx, dsum, y) writes y[0..R) for rows r..r+R of the weights. x's codes and
// scales go to a buffer kept per calling thread (allocating them per call cost ~2 us each, ~120 calls a step).
template <int R, typename Pass>
static at::Tensor matvec(const at::Tensor& x, int64_t out, const Pass& pass) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "x: (B, in) float32, in % 32 == 0");
  auto xc = x.contiguous();
  int64_t B = x.size(0), n = x.size(1), nb = n / 32;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  q.resize(B * n), d.resize(B * 2 * nb);
  auto y = at::empty({B, out}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data();
  float *dp = d.data(), *yp = y.data_ptr<float>();
  for (int64_t i = 0; i < B; i++) quantize_row(xp + i * n, n, qp + i * n, dp + i * 2 * nb, dp + i * 2 * nb + nb);
  at::parallel_for(0, (out + R - 1) / R, 64 / R, [&](int64_t g0, int64_t g1) {
    for (int64_t i = 0; i < B; i++) {
      const int8_t* qi = qp + i * n;
      const float* di = dp + i * 2 * nb;
      for (int64_t r = g0 * R; r < std::min(g1 * R, out); r += R) {
        if (r + R <= out) pass.template operator()<R>(r, nb, qi, di, di + nb, yp + i * out + r);
        else for (int64_t t = r; t < out; t++) pass.template operator()<1>(t, nb, qi, di, di + nb, yp + i * out + t);
      }
    }
  });
  return y;
}

struct Q8_0 {
  const int8_t* w;
  const uint16_t* s;
  template <int R>
  void operator()(int64_t r, int64_t nb, const int8_t* qx, const float* dx, const float*, float* y) const {
    __m256 acc[R];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      __m256i qb = _mm256_loadu_si256((const __m256i*)(qx + b * 32));
      for (int i = 0; i < R; i++) {
        __m256i qw = _mm256_loadu_si256((const __m256i*)(w + ((r + i) * nb + b) * 32));
        __m256 p = dot_u8_i8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qb, qw));  // |w| * (x with w's sign)
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(s[(r + i) * nb + b]) * dx[b]), p, acc[i]);
      }
    }
    for (int i = 0; i < R; i++) y[i] = hsum(acc[i]);
  }
};

struct Q4_1 {
  const uint8_t* w;
  const uint16_t *s, *m;
  template <int R>
  void operator()(int64_t r, int64_t nb, const int8_t* qx, const float* dx, const float* dsum, float* y) const {
    __m256 acc[R];
    float mins[R];  // sum over blocks of m * (dx * sum(q)): the minimum's share of the dot product
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps(), mins[i] = 0.f;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
      __m256i qb = _mm256_loadu_si256((const __m256i*)(qx + b * 32));
      for (int i = 0; i < R; i++) {
        __m128i p = _mm_loadu_si128((const __m128i*)(w + ((r + i) * nb + b) * 16));
        __m256i qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low);
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(s[(r + i) * nb + b]) * dx[b]), dot_u8_i8(qw, qb), acc[i]);
        mins[i] += _cvtsh_ss(m[(r + i) * nb + b]) * dsum[b];
      }
    }
    for (int i = 0; i < R; i++) y[i] = hsum(acc[i]) + mins[i];
  }
};

at::Tensor q8_0_matvec(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf && codes.is_contiguous() &&
              scales.is_contiguous() && codes.size(1) == x.size(1), "codes (out, in) int8, scales (out, in / 32) float16");
  // one row per pass: four measured 2.2x slower on SmolLM2's 49,152-row LM head here (4.3 vs 2.0 ms)
  return matvec<1>(x, codes.size(0), Q8_0{codes.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr())});
}

at::Tensor q4_1_matvec(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf &&
              packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous() && packed.size(1) * 2 == x.size(1),
              "packed (out, in / 2) uint8, scales and mins (out, in / 32) float16");
  // one row per pass, as Q8_0: four (with the block scales converted up front) measured 1.4x slower on
  // SmolLM2's matrices here (12.5 vs 8.8 ms a step's worth, one thread)
  return matvec<1>(x, packed.size(0), Q4_1{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                                         reinterpret_cast<const uint16_t*>(mins.data_ptr())});
}

// R float32 rows against every row of x: the rows stream from memory once and stay in L1 for x's other rows
template <int R>
static inline void f32_rows(const float* w0, const float* xp, int64_t B, int64_t n, float* y0, int64_t out) {
  for (int64_t i = 0; i < B; i++) {
    __m256 acc[R];
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) {
      __m256 xk = _mm256_loadu_ps(xp + i * n + k);
      for (int j = 0; j < R; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + j * n + k), xk, acc[j]);
    }
    for (int j = 0; j < R; j++) y0[i * out + j] = hsum(acc[j]);
  }
}

at::Tensor f32_matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous() &&
              w.size(1) == x.size(1) && x.size(1) % 8 == 0 && w.size(0) % ROWS == 0, "x (B, in), w (out, in) float32");
  auto xc = x.contiguous();
  int64_t B = x.size(0), n = x.size(1), out = w.size(0);
  auto y = at::empty({B, out}, x.options());
  const float *wp = w.data_ptr<float>(), *xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // sixteen rows a pass: sixteen streams in flight reach the copy bandwidth where four reached ~75% of it
  at::parallel_for(0, out / F32_ROWS, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) f32_rows<F32_ROWS>(wp + F32_ROWS * g * n, xp, B, n, yp + F32_ROWS * g, out);
  });
  for (int64_t r = out / F32_ROWS * F32_ROWS; r < out; r += ROWS) f32_rows<ROWS>(wp + r * n, xp, B, n, yp + r, out);
  return y;
}

// e^x for x <= 0, eight at a time (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n);
// within 2 ulp, and ~10x cheaper than std::exp one at a time
static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // keeps 2^n a normal float; e^-87 ~ 1.6e-38
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One new token's attention over the first n cached keys, per (sequence, query head): scores, softmax,
// weighted values, with the query heads that share a KV head (GQA) reading the same rows. The compiled
// graph's own loops for this (a masked softmax over the whole window) cost ~90 us a layer at 256 slots.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.stride(3) == 1 && v.stride(3) == 1 &&
              k.stride(2) == k.size(3) && v.stride(2) == v.size(3) && q.size(0) == k.size(0) &&
              q.size(2) == k.size(3) && k.size(3) % 8 == 0 && q.size(1) % k.size(1) == 0,
              "q (B, H, D), k and v (B, KV, S, D) float32 with contiguous rows, D % 8 == 0, H % KV == 0");
  auto qc = q.contiguous();
  int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), n = pos.item<int64_t>() + 1;
  TORCH_CHECK(n >= 1 && n <= k.size(2), "pos must index a written cache slot");
  auto y = at::empty({B, H, D}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float scale = 1.f / std::sqrt(float(D));
  at::parallel_for(0, B * H, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(n);
    for (int64_t r = r0; r < r1; r++) {
      int64_t b = r / H, g = (r % H) / (H / KV);
      const float *qr = qp + r * D, *kr = kp + b * k.stride(0) + g * k.stride(1), *vr = vp + b * v.stride(0) + g * v.stride(1);
      float m = -INFINITY, sum = 0.f;
      for (int64_t s = 0; s < n; s++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + s * D + d), acc);
        p[s] = hsum(acc) * scale;
        m = std::max(m, p[s]);
      }
      int64_t s = 0;
      __m256 sums = _mm256_setzero_ps();
      for (; s + 8 <= n; s += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&p[s]), _mm256_set1_ps(m)));
        _mm256_storeu_ps(&p[s], e);
        sums = _mm256_add_ps(sums, e);
      }
      for (sum = hsum(sums); s < n; s++) sum += (p[s] = std::exp(p[s] - m));
      float* out = yp + r * D;
      for (int64_t d = 0; d < D; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vr + t * D + d), acc);
        _mm256_storeu_ps(out + d, _mm256_mul_ps(acc, _mm256_set1_ps(1.f / sum)));
      }
    }
  });
  return y;
}

TORCH_LIBRARY(labkit_cpu, m) {
  m.def("q8_0_matvec(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("q4_1_matvec(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("f32_matvec(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor pos) -> Tensor");
}
TORCH_LIBRARY_IMPL(labkit_cpu, CPU, m) {
  m.impl("q8_0_matvec", &q8_0_matvec);
  m.impl("q4_1_matvec", &q4_1_matvec);
  m.impl("f32_matvec", &f32_matvec);
  m.impl("decode_attention", &decode_attention);
}
"""


@functools.cache
def ops():
    """torch.ops.labkit_cpu (q8_0_matvec, q4_1_matvec, f32_matvec, decode_attention), built on first use; None where
    it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        print("labkit.cpu_kernels: this CPU has no AVX2; the decode step uses PyTorch's kernels")
        return None
    if not shutil.which("c++"):
        print("labkit.cpu_kernels: no C++ compiler (c++) on PATH; the decode step uses PyTorch's kernels")
        return None
    from torch.utils.cpp_extension import load_inline

    print("labkit.cpu_kernels: loading the AVX2 matrix-vector kernels (the first time, a minute to compile them)")
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
    load_inline("labkit_cpu", SOURCE, extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
    for name in ("q8_0_matvec", "q4_1_matvec", "f32_matvec"):  # shapes only, for torch.compile's tracing
        torch.library.register_fake(f"labkit_cpu::{name}")(lambda x, w, *rest: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("labkit_cpu::decode_attention")(lambda q, k, v, pos: torch.empty_like(q))
    return torch.ops.labkit_cpu


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


def dequantize(*weights: torch.Tensor) -> torch.Tensor:
    """quantize_q8_0's or quantize_q4_1's output -> the (out, in) float32 weights the kernels compute with."""
    if len(weights) == 2:
        codes, scales = weights
        return (codes.float().unflatten(1, (-1, BLOCK)) * scales.float()[..., None]).flatten(1)
    packed, scales, mins = weights
    blocks = packed.unflatten(1, (-1, BLOCK // 2))
    codes = torch.cat([blocks & 15, blocks >> 4], -1).float()
    return (codes * scales.float()[..., None] + mins.float()[..., None]).flatten(1)
