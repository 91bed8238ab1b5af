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
- float32 rows four per pass, interleaved by pack_f32 so that a pass reads one sequential stream (sixteen
  rows a pass in (out, in) order, sixteen streams, read SmolLM2's 538 MB at ~18 GB/s on one core here, the
  rate of torch's own sum; four interleaved on 2 MB pages ~28-33); a batch of B inputs (a verification's
  k + 1 tokens) meets each pass's rows in L1, three or two of x's rows at a time;
- Q8_0 and Q4_1 one row per pass, its blocks on four accumulators (with one, each block's multiply-add
  waited on the last), their block scales converted as they stream in (four rows a pass measured slower
  for both: 2.2x on the LM head for Q8_0, 1.4x over SmolLM2's matrices for Q4_1);
- huge_pages puts a decoder's matrices in one buffer on 2 MB pages: on 4 kB pages a stream misses the TLB
  every 4 kB, which cost this VM a third of its bandwidth;
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

constexpr int F32_ROWS = 4;  // rows per pass of the float32 loop, interleaved by pack_f32 (8 measured no faster)

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

// The shared frame: each of x's B rows quantized once, then the out rows over the threads; pass(r, nb, qx, dx,
// dsum) returns row r's dot product with one quantized x. x's codes and scales go to a buffer kept per calling
// thread (allocating them per call cost ~2 us each, ~120 calls a step).
template <typename Pass>
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
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)  // x's other rows find row r in L1
      for (int64_t i = 0; i < B; i++) yp[i * out + r] = pass(r, nb, qp + i * n, dp + i * 2 * nb, dp + i * 2 * nb + nb);
  });
  return y;
}

// One row a pass, its blocks in fours on four accumulators: with one, each block's multiply-add waited for
// the previous block's (the FMA's latency, ~4 cycles), which held a row to ~15 GB/s here
constexpr int U = 4;

struct Q8_0 {
  const int8_t* w;
  const uint16_t* s;
  float operator()(int64_t r, int64_t nb, const int8_t* qx, const float* dx, const float*) const {
    __m256 acc[U];
    for (int u = 0; u < U; u++) acc[u] = _mm256_setzero_ps();
    const int8_t* wr = w + r * nb * 32;
    const uint16_t* sr = s + r * nb;
    for (int64_t b0 = 0; b0 < nb; b0 += U)
      for (int u = 0; u < U && b0 + u < nb; u++) {
        int64_t b = b0 + u;
        __m256i qb = _mm256_loadu_si256((const __m256i*)(qx + b * 32));
        __m256i qw = _mm256_loadu_si256((const __m256i*)(wr + b * 32));
        __m256 p = dot_u8_i8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qb, qw));  // |w| * (x with w's sign)
        acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(sr[b]) * dx[b]), p, acc[u]);
      }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
};

struct Q4_1 {
  const uint8_t* w;
  const uint16_t *s, *m;
  float operator()(int64_t r, int64_t nb, const int8_t* qx, const float* dx, const float* dsum) const {
    __m256 acc[U];
    float mins[U] = {};  // sums over blocks of m * (dx * sum(q)): the minimum's share of the dot product
    for (int u = 0; u < U; u++) acc[u] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    const uint8_t* wr = w + r * nb * 16;
    const uint16_t *sr = s + r * nb, *mr = m + r * nb;
    for (int64_t b0 = 0; b0 < nb; b0 += U)
      for (int u = 0; u < U && b0 + u < nb; u++) {
        int64_t b = b0 + u;
        __m256i qb = _mm256_loadu_si256((const __m256i*)(qx + b * 32));
        __m128i p = _mm_loadu_si128((const __m128i*)(wr + b * 16));
        __m256i qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low);
        acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(sr[b]) * dx[b]), dot_u8_i8(qw, qb), acc[u]);
        mins[u] += _cvtsh_ss(mr[b]) * dsum[b];
      }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + (mins[0] + mins[1]) +
           (mins[2] + mins[3]);
  }
};

at::Tensor q8_0_matvec(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf && codes.is_contiguous() &&
              scales.is_contiguous() && codes.size(1) == x.size(1), "codes (out, in) int8, scales (out, in / 32) float16");
  // one row per pass: four measured 2.2x slower on SmolLM2's 49,152-row LM head here (4.3 vs 2.0 ms)
  return matvec(x, codes.size(0), Q8_0{codes.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr())});
}

at::Tensor q4_1_matvec(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf &&
              packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous() && packed.size(1) * 2 == x.size(1),
              "packed (out, in / 2) uint8, scales and mins (out, in / 32) float16");
  // one row per pass, as Q8_0: four (with the block scales converted up front) measured 1.4x slower on
  // SmolLM2's matrices here (12.5 vs 8.8 ms a step's worth, one thread)
  return matvec(x, packed.size(0), Q4_1{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                                         reinterpret_cast<const uint16_t*>(mins.data_ptr())});
}

// Four float32 rows against XB rows of x, from pack_f32's layout: the four rows' inputs k..k+8 lie back to
// back, so a pass reads one sequential stream (sixteen rows a pass in (out, in) order read sixteen streams and
// reached ~18 GB/s on one core here; this layout on 2 MB pages ~28-33)
template <int XB>
static inline void f32_rows(const float* w, const float* xp, int64_t n, float* y0, int64_t out) {
  __m256 acc[XB][F32_ROWS];
  for (int b = 0; b < XB; b++)
    for (int j = 0; j < F32_ROWS; j++) acc[b][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    __m256 xk[XB];
    for (int b = 0; b < XB; b++) xk[b] = _mm256_loadu_ps(xp + b * n + k);
    for (int j = 0; j < F32_ROWS; j++) {
      __m256 wj = _mm256_loadu_ps(w + k * F32_ROWS + 8 * j);
      for (int b = 0; b < XB; b++) acc[b][j] = _mm256_fmadd_ps(wj, xk[b], acc[b][j]);
    }
  }
  for (int b = 0; b < XB; b++)
    for (int j = 0; j < F32_ROWS; j++) y0[b * out + j] = hsum(acc[b][j]);
}

at::Tensor f32_matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous() &&
              w.dim() == 4 && w.size(2) == F32_ROWS && w.size(3) == 8 && w.size(1) * 8 == x.size(1),
              "x (B, in) float32, w from pack_f32: (out / 4, in / 8, 4, 8) float32");
  auto xc = x.contiguous();
  int64_t B = x.size(0), n = x.size(1), out = w.size(0) * F32_ROWS;
  auto y = at::empty({B, out}, x.options());
  const float *wp = w.data_ptr<float>(), *xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // a batch (a verification's k + 1 tokens) takes x's rows three or two at a time against a group read once and
  // kept in L1 (twelve or eight independent sums): over 30 of SmolLM2's (3072, 576) matrices, one thread, B = 1, 2
  // and 3 took 6.8-6.9 ms (bound by the bytes), then each further pass over L1 costs multiply-adds: B = 4 10.8,
  // B = 5 15.5 (in pairs only, B = 3 had taken 8.4 and B = 5 17)
  at::parallel_for(0, w.size(0), 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
      const float* wg = wp + F32_ROWS * g * n;
      int64_t i = 0;
      for (; i + 3 <= B && B - i != 4; i += 3) f32_rows<3>(wg, xp + i * n, n, yp + i * out + F32_ROWS * g, out);
      for (; i + 2 <= B; i += 2) f32_rows<2>(wg, xp + i * n, n, yp + i * out + F32_ROWS * g, out);
      if (i < B) f32_rows<1>(wg, xp + i * n, n, yp + i * out + F32_ROWS * g, out);
    }
  });
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

// Eight dot products' partial sums (one vector each) -> one vector of the eight sums, in order
static inline __m256 hsum8(const __m256* a) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // a0..a3: low, high halves
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[0..8 NV) = sum over t < n of p[t] * v[t, 0..8 NV): NV independent sums, v's rows read in order
template <int NV>
static inline void weighted_rows(const float* p, const float* v, int64_t n, int64_t D, float inv, float* out) {
  __m256 o[NV];
  for (int c = 0; c < NV; c++) o[c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t++) {
    __m256 pt = _mm256_set1_ps(p[t]);
    for (int c = 0; c < NV; c++) o[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + t * D + 8 * c), o[c]);
  }
  for (int c = 0; c < NV; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(o[c], _mm256_set1_ps(inv)));
}

// One new token's attention over the first n cached keys, per (sequence, query head): scores, softmax,
// weighted values, with the query heads that share a KV head (GQA) reading the same rows. The compiled
// graph's own loops for this (a masked softmax over the whole window) cost ~90 us a layer at 256 slots.
// Scores go eight keys at a time and the weighted sum over eight vectors of the head at a time: one key
// or one vector at a time, each multiply-add waited on the last (SmolLM2's shapes at 129 keys, one thread,
// 14.9 us a call against 8.9).
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
      int64_t s = 0;
      for (; s + 8 <= n; s += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          __m256 qd = _mm256_loadu_ps(qr + d);
          for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kr + (s + j) * D + d), acc[j]);
        }
        _mm256_storeu_ps(&p[s], _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
      }
      for (; s < n; s++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + s * D + d), acc);
        p[s] = hsum(acc) * scale;
      }
      float m = -INFINITY, sum = 0.f;
      for (int64_t t = 0; t < n; t++) m = std::max(m, p[t]);
      __m256 sums = _mm256_setzero_ps();
      for (s = 0; s + 8 <= n; s += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&p[s]), _mm256_set1_ps(m)));
        _mm256_storeu_ps(&p[s], e);
        sums = _mm256_add_ps(sums, e);
      }
      for (sum = hsum(sums); s < n; s++) sum += (p[s] = std::exp(p[s] - m));
      float* out = yp + r * D;
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) weighted_rows<8>(p.data(), vr + d, n, D, 1.f / sum, out + d);
      for (; d < D; d += 8) weighted_rows<1>(p.data(), vr + d, n, D, 1.f / sum, out + d);
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
    for name in ("q8_0_matvec", "q4_1_matvec"):  # shapes only, for torch.compile's tracing
        torch.library.register_fake(f"labkit_cpu::{name}")(lambda x, w, *rest: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("labkit_cpu::f32_matvec")(lambda x, w: x.new_empty(x.shape[0], w.shape[0] * 4))
    torch.library.register_fake("labkit_cpu::decode_attention")(lambda q, k, v, pos: torch.empty_like(q))
    return torch.ops.labkit_cpu


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """(out, in) float -> (out / 4, in / 8, 4, 8) float32, f32_matvec's layout: rows in groups of four, each
    group's eight inputs k..k+8 of its four rows back to back, so the loop over a group reads one stream."""
    out, inp = w.shape
    if out % 4 or inp % 8:
        raise ValueError(f"pack_f32: ({out}, {inp}) (out, in) needs out % 4 == 0 and in % 8 == 0")
    return w.detach().float().reshape(out // 4, 4, inp // 8, 8).transpose(1, 2).contiguous()


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


def round_activation(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) float32 rounded as the Q8_0 and Q4_1 loops round it before their integer products: per block
    of 32 inputs a scale d = max |x| / 127 and codes round(x / d) (ties to even) -> codes * d."""
    blocks = x.unflatten(-1, (-1, BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks * torch.where(d > 0, 1 / d, 0))
    return (codes * d).flatten(-2)


def dequantize(*weights: torch.Tensor) -> torch.Tensor:
    """quantize_q8_0's or quantize_q4_1's output -> the (out, in) float32 weights the kernels compute with."""
    if len(weights) == 2:
        codes, scales = weights
        return (codes.float().unflatten(1, (-1, BLOCK)) * scales.float()[..., None]).flatten(1)
    packed, scales, mins = weights
    blocks = packed.unflatten(1, (-1, BLOCK // 2))
    codes = torch.cat([blocks & 15, blocks >> 4], -1).float()
    return (codes * scales.float()[..., None] + mins.float()[..., None]).flatten(1)
