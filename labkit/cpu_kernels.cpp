#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

constexpr int MR = 16;  // rows per panel of the float32 loop's layout (pack_f32): two vectors of eight

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

// Q4_0 with rows interleaved in eights (quantize_q4_0's layout, as llama.cpp repacks Q4_0 for x86): per group
// of 8 rows and block of 32 inputs, 128 bytes whose 32-byte quarter g holds, for row i, inputs 4g..4g+3 in
// the low nibbles of bytes 4i..4i+3 and inputs 16+4g..16+4g+3 in the high ones; then the 8 rows' float16
// scales. One broadcast of four x codes meets eight rows in one multiply-add of bytes (vpdpbusd, where the
// CPU has AVX512-VNNI), whose eight int32 lanes are the eight rows: no horizontal sums, and the eight scales
// apply as one vector. w = d * (q - 8), so a block's sum is d * dx * (sum q x - 8 sum x).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q4_0_VNNI
#endif
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef Q4_0_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// One block of a group of 8 rows against one row of x: the eight rows' sums of (q - 8) x, in int32. With VNNI
// the high nibbles multiply in place (v & 0xF0 is 16 q) and one shift divides their sum by 16: no shift per
// vector; maddubs (AVX2) would saturate at 240 * 127 * 2, so there they shift down first.
static inline __m256i q4_0_block(const uint8_t* blk, const int8_t* xq, int32_t sum8) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int k = 0; k < 4; k++) {
    int32_t a, b;
    std::memcpy(&a, xq + 4 * k, 4);
    std::memcpy(&b, xq + 16 + 4 * k, 4);
    __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 32 * k));
    s0 = dot4(s0, _mm256_and_si256(v, low), _mm256_set1_epi32(a));
#ifdef Q4_0_VNNI
    s1 = dot4(s1, _mm256_andnot_si256(low, v), _mm256_set1_epi32(b));
#else
    s1 = dot4(s1, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_set1_epi32(b));
#endif
  }
#ifdef Q4_0_VNNI
  s1 = _mm256_srai_epi32(s1, 4);
#endif
  return _mm256_sub_epi32(_mm256_add_epi32(s0, s1), _mm256_set1_epi32(sum8));
}

// One group of 8 weight rows against every row of x, Q4_0_ROWS rows of x a pass (two groups a pass, sharing
// the broadcasts of x, measured slower: 7.0 against 4.0 ms for SmolLM2's layers, one thread)
constexpr int Q4_0_ROWS = 4;
// Past one row of x, 16 blocks ahead (2 kB) prefetched on the first pass over a group (later passes find it in L1):
// 8 rows through SmolLM2's matrices 6.8 against 7.9 ms at two threads; one row is as fast without it
constexpr int Q4_0_PREFETCH = 2048;
static void q4_0_group(const uint8_t* wp, const uint16_t* sp, int64_t g, int64_t nb, const int8_t* q, const float* dx,
                       const int32_t* sum8, int64_t n, int64_t B, float* yp, int64_t out) {
  for (int64_t i0 = 0; i0 < B; i0 += Q4_0_ROWS) {
    int rows = int(std::min<int64_t>(Q4_0_ROWS, B - i0));
    __m256 acc[Q4_0_ROWS];
    for (int r = 0; r < Q4_0_ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = wp + (g * nb + b) * 128;
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + (g * nb + b) * 8)));
      if (B > 1 && i0 == 0) {
        _mm_prefetch((const char*)blk + Q4_0_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char*)blk + Q4_0_PREFETCH + 64, _MM_HINT_T0);
      }
      for (int r = 0; r < rows; r++) {
        int64_t xb = (i0 + r) * nb + b;
        __m256i s = q4_0_block(blk, q + (i0 + r) * n + b * 32, sum8[xb]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx[xb])), acc[r]);
      }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(yp + (i0 + r) * out + g * 8, acc[r]);
  }
}

at::Tensor q4_0_matvec(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0 && packed.scalar_type() == at::kByte &&
              scales.scalar_type() == at::kHalf && packed.is_contiguous() && scales.is_contiguous() && packed.dim() == 3 &&
              packed.size(2) == 128 && packed.size(1) * 32 == x.size(1) && scales.size(2) == 8,
              "x (B, in) float32; packed (out / 8, in / 32, 128) uint8 and scales (out / 8, in / 32, 8) float16 from quantize_q4_0");
  auto xc = x.contiguous();
  int64_t B = x.size(0), n = x.size(1), nb = n / 32, groups = packed.size(0), out = groups * 8;
  thread_local std::vector<int8_t> q;  // per calling thread, as matvec's: no allocation per call
  thread_local std::vector<float> dx, dsum;
  thread_local std::vector<int32_t> sum8;
  q.resize(B * n), dx.resize(B * nb), dsum.resize(B * nb), sum8.resize(B * nb);
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < B; i++) {
    quantize_row(xp + i * n, n, q.data() + i * n, dx.data() + i * nb, dsum.data() + i * nb);
    for (int64_t b = 0; b < nb; b++) {
      int32_t t = 0;
      for (int j = 0; j < 32; j++) t += q[i * n + b * 32 + j];
      sum8[i * nb + b] = 8 * t;
    }
  }
  auto y = at::empty({B, out}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  // the buffers are this thread's (thread_local): the worker threads get their addresses, not their names
  const int8_t* qp = q.data();
  const float* dxp = dx.data();
  const int32_t* s8 = sum8.data();
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) q4_0_group(wp, sp, g, nb, qp, dxp, s8, n, B, yp, out);
  });
  return y;
}

// Q8_0 with rows interleaved in eights (pack_q8_0x8's layout), for the engine: per group of 8 rows and block of
// 32 inputs, 256 bytes whose 32-byte eighth k holds, for row i, inputs 4k..4k+3 in bytes 4i..4i+3, each code
// stored plus 128; then the 8 rows' float16 scales. As Q4_0's loop: one broadcast of four x codes meets eight
// rows in one vpdpbusd, whose lanes are the rows. vpdpbusd multiplies unsigned by signed bytes: the weights go
// in unsigned (w + 128), x as it is, and 128 * sum(x) per block comes off, one figure per row of x rather than
// per weight row (a per-weight correction read 32 more bytes a block: 12 % more traffic, and this loop
// measured 15-25 % faster than that one on SmolLM2's matrices at 1-8 rows). Without VNNI, maddubs on the
// codes made signed again, x taking w's sign (as q8_0_matvec).
static inline __m256i q8_0x8_block(const uint8_t* blk, const int8_t* xs) {
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int k = 0; k < 8; k += 2) {
    int32_t a, b;
    std::memcpy(&a, xs + 4 * k, 4);
    std::memcpy(&b, xs + 4 * k + 4, 4);
    __m256i w0 = _mm256_loadu_si256((const __m256i*)(blk + 32 * k)), w1 = _mm256_loadu_si256((const __m256i*)(blk + 32 * k + 32));
#ifdef Q4_0_VNNI
    s0 = _mm256_dpbusd_epi32(s0, w0, _mm256_set1_epi32(a));
    s1 = _mm256_dpbusd_epi32(s1, w1, _mm256_set1_epi32(b));
#else
    const __m256i flip = _mm256_set1_epi8(char(0x80));
    w0 = _mm256_xor_si256(w0, flip), w1 = _mm256_xor_si256(w1, flip);
    s0 = dot4(s0, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(_mm256_set1_epi32(a), w0));
    s1 = dot4(s1, _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(_mm256_set1_epi32(b), w1));
#endif
  }
  return _mm256_add_epi32(s0, s1);
}

// Past one row of x, 16 blocks ahead (4 kB) prefetched: 8 rows through SmolLM2's matrices 7.4-9.1 against
// 8.0-11.2 ms at two threads, 13.6 against 17.0 at one (1 kB ahead gained half of that); one row is as fast without it
constexpr int Q8_0X8_PREFETCH = 4096;
at::Tensor q8_0x8_matvec(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0 && codes.scalar_type() == at::kByte &&
              scales.scalar_type() == at::kHalf && codes.is_contiguous() && scales.is_contiguous() && codes.dim() == 3 &&
              codes.size(2) == 256 && codes.size(1) * 32 == x.size(1) && scales.size(2) == 8,
              "x (B, in) float32; pack_q8_0x8's codes (out / 8, in / 32, 256) uint8 and scales (out / 8, in / 32, 8) float16");
  auto xc = x.contiguous();
  int64_t B = x.size(0), n = x.size(1), nb = n / 32, groups = codes.size(0), out = groups * 8;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx, dsum;
  thread_local std::vector<int32_t> xsum;
  q.resize(B * n), dx.resize(B * nb), dsum.resize(B * nb), xsum.resize(B * nb);
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < B; i++) quantize_row(xp + i * n, n, q.data() + i * n, dx.data() + i * nb, dsum.data() + i * nb);
  for (int64_t j = 0; j < B * nb; j++) {  // what the weights' + 128 adds to a block's sum (nothing without VNNI)
    int32_t t = 0;
    for (int k = 0; k < 32; k++) t += q[j * 32 + k];
#ifdef Q4_0_VNNI
    xsum[j] = 128 * t;
#else
    xsum[j] = 0;
#endif
  }
  auto y = at::empty({B, out}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const int8_t* qp = q.data();  // this thread's buffers, by address: the workers have their own thread_locals
  const float* dxp = dx.data();
  const int32_t* xsp = xsum.data();
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t i0 = 0; i0 < B; i0 += Q4_0_ROWS) {
        int rows = int(std::min<int64_t>(Q4_0_ROWS, B - i0));
        __m256 acc[Q4_0_ROWS];
        for (int r = 0; r < Q4_0_ROWS; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
          int64_t gb = g * nb + b;
          __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + gb * 8)));
          if (B > 1) {  // several rows a block run slowly enough that the hardware prefetcher falls behind
            const char* ahead = (const char*)(wp + gb * 256) + Q8_0X8_PREFETCH;
            for (int line = 0; line < 256; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
          }
          for (int r = 0; r < rows; r++) {
            int64_t xo = (i0 + r) * n + b * 32, xb = (i0 + r) * nb + b;
            __m256i s = _mm256_sub_epi32(q8_0x8_block(wp + gb * 256, qp + xo), _mm256_set1_epi32(xsp[xb]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dxp[xb])), acc[r]);
          }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(yp + (i0 + r) * out + g * 8, acc[r]);
      }
  });
  return y;
}

// NR rows of x against one panel of pack_f32's layout (MR rows; for each input k the panel's MR weights lie
// back to back, so a panel is one sequential stream): per input, the two weight vectors are loaded once and
// meet every row of x, broadcast. Each output is one running sum over the inputs in order, whatever NR, the
// batch and the thread split: a row's bits depend on nothing else in the batch. With two or more rows the
// loop is slow enough per byte that the hardware prefetcher stops running ahead, and the stream stalled
// while the multiply-adds ran (B = 4 cost 1.56x B = 1 on SmolLM2's LM head here, one thread): pf, a line
// prefetched per input, keeps it streaming.
constexpr int PREFETCH = 96;
template <int NR>
static inline void f32_tile(const float* w, int64_t n, const float* x, float* y, int64_t out, const float* pf) {
  // twelve named accumulators, not an array: GCC 12 kept an array of them on the stack and stored it every
  // input, which held the loop to ~40 % of the FMA rate
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k++) {
    if (pf) _mm_prefetch((const char*)(pf + k * MR), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(w + k * MR), w1 = _mm256_loadu_ps(w + k * MR + 8), xb;
#define ROW(b)                                    \
    if constexpr (NR > b) {                       \
      xb = _mm256_broadcast_ss(x + b * n + k);    \
      c##b##0 = _mm256_fmadd_ps(w0, xb, c##b##0); \
      c##b##1 = _mm256_fmadd_ps(w1, xb, c##b##1); \
    }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
#define STORE(b) \
  if constexpr (NR > b) _mm256_storeu_ps(y + b * out, c##b##0), _mm256_storeu_ps(y + b * out + 8, c##b##1);
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

#ifdef __AVX512F__
// Seven to twelve rows in one pass, a panel's sixteen weights one 512-bit vector (where the CPU has AVX-512,
// and ops() compiles for it): two passes of AVX2's six or fewer re-read the panel and cost B = 8 2.1x B = 1
// on SmolLM2's LM head here, one pass 1.6-1.7x. The same multiply-adds in the same order, so the same bits.
constexpr int MAX_ROWS = 12;
template <int NR>
static inline void f32_tile16(const float* w, int64_t n, const float* x, float* y, int64_t out, const float* pf) {
  __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
  c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k++) {
    _mm_prefetch((const char*)(pf + k * MR), _MM_HINT_T0);
    __m512 wk = _mm512_loadu_ps(w + k * MR);
#define ROW(b) \
    if constexpr (NR > b) c##b = _mm512_fmadd_ps(wk, _mm512_set1_ps(x[b * n + k]), c##b);
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
  }
#define STORE(b) \
  if constexpr (NR > b) _mm512_storeu_ps(y + b * out, c##b);
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) STORE(11)
#undef STORE
}
#else
constexpr int MAX_ROWS = 6;
#endif

// One panel against `rows` rows of x (1..MAX_ROWS): with AVX2, twelve accumulators at most, which with two
// weight vectors and a broadcast x are the sixteen registers it has (seven or eight rows spilled)
static void f32_panel(int rows, const float* w, int64_t n, const float* x, float* y, int64_t out, const float* pf) {
  switch (rows) {
    case 1: return f32_tile<1>(w, n, x, y, out, pf);
    case 2: return f32_tile<2>(w, n, x, y, out, pf);
    case 3: return f32_tile<3>(w, n, x, y, out, pf);
    case 4: return f32_tile<4>(w, n, x, y, out, pf);
    case 5: return f32_tile<5>(w, n, x, y, out, pf);
    case 6: return f32_tile<6>(w, n, x, y, out, pf);
#ifdef __AVX512F__
    case 7: return f32_tile16<7>(w, n, x, y, out, pf);
    case 8: return f32_tile16<8>(w, n, x, y, out, pf);
    case 9: return f32_tile16<9>(w, n, x, y, out, pf);
    case 10: return f32_tile16<10>(w, n, x, y, out, pf);
    case 11: return f32_tile16<11>(w, n, x, y, out, pf);
    case 12: return f32_tile16<12>(w, n, x, y, out, pf);
#endif
  }
}

at::Tensor f32_matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous() &&
              w.dim() == 3 && w.size(2) == MR && w.size(1) == x.size(1),
              "x (B, in) float32, w from pack_f32: (out / 16, in, 16) float32");
  auto xc = x.contiguous();
  int64_t B = x.size(0), n = x.size(1), panels = w.size(0), out = panels * MR;
  auto y = at::empty({B, out}, x.options());
  const float *wp = w.data_ptr<float>(), *xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // x's rows MAX_ROWS at most at a time, the chunks as even as they go (B = 8 as 4 + 4 without AVX-512); the
  // panel is read from memory by the first chunk and from L2 by the others
  int64_t chunks = (B + MAX_ROWS - 1) / MAX_ROWS;
  at::parallel_for(0, panels, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
      for (int64_t c = 0, i = 0; c < chunks; c++) {
        int rows = int((B - i) / (chunks - c));
        const float* panel = wp + p * n * MR;
        f32_panel(rows, panel, n, xp + i * n, yp + i * out + p * MR, out, B > 1 ? panel + PREFETCH * MR : nullptr);
        i += rows;
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

// The bytes of x read once, summed on the threads torch has, each its own slice: the streaming rate the
// matrix loops above can reach, which the benchmarks' floor takes (torch's own sum on two threads read
// slower than two of these loops did, and a floor a kernel beats is no floor)
double stream_read(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() % 32 == 0, "x: contiguous float32");
  const float* p = x.data_ptr<float>();
  int64_t lines = x.numel() / 16;
  std::vector<double> parts(at::get_num_threads(), 0.0);
  at::parallel_for(0, lines, 4096, [&](int64_t l0, int64_t l1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t l = l0;
    for (; l + 2 <= l1; l += 2) {  // two cache lines a pass, four sums in flight
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + 16 * l));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + 16 * l + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + 16 * l + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + 16 * l + 24));
    }
    for (; l < l1; l++) a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_loadu_ps(p + 16 * l), _mm256_loadu_ps(p + 16 * l + 8)));
    parts[at::get_thread_num()] += hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  });
  double sum = 0;
  for (double v : parts) sum += v;
  return sum;
}

// ---- A decoder layer around its attention, for an engine's decode steps (fast_paged.FusedLayer) ----
// Eager PyTorch spent ~9 ms of a 25 ms SmolLM2 step (two threads, serve.json) on ~60 small ops a layer (norms, RoPE,
// SwiGLU, residuals, the linear layers' reshapes) between the matrix loops; here a layer is two calls, with
// the paged attention (the learner's) between them.

// w: one packed matrix as fast_paged packs it: (pack_f32,), Q8_0 or Q4_0 (codes, scales), Q4_1 (packed, scales, mins)
static at::Tensor linear_packed(const at::Tensor& x, at::TensorList w, int64_t out) {
  at::Tensor y = w.size() == 1 ? f32_matvec(x, w[0])
                 : w.size() == 3 ? q4_1_matvec(x, w[0], w[1], w[2])
                 : w[0].scalar_type() == at::kChar ? q8_0_matvec(x, w[0], w[1])
                 : w[0].dim() == 3 && w[0].size(2) == 256 ? q8_0x8_matvec(x, w[0], w[1])
                                                          : q4_0_matvec(x, w[0], w[1]);
  return y.size(1) == out ? y : y.narrow(1, 0, out);  // a float32 panel's padding rows dropped
}

// labkit.model.RMSNorm per row: float32 mean of squares, x * rsqrt(mean + eps) * weight
static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  int64_t N = x.size(0), d = x.size(1);
  auto y = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < N; i++) {
    const float* r = xp + i * d;
    float ss = 0.f;
    for (int64_t j = 0; j < d; j++) ss += r[j] * r[j];
    float inv = 1.f / std::sqrt(ss / float(d) + float(eps));
    for (int64_t j = 0; j < d; j++) yp[i * d + j] = wp[j] * (r[j] * inv);
  }
  return y;
}

// labkit.model.apply_rope on heads of D: dimension j rotates with j + D/2, cos and sin (N, D) one row a token
static void rope(float* x, int64_t N, int64_t heads, int64_t D, int64_t stride, const float* cos, const float* sin) {
  int64_t half = D / 2;
  std::vector<float> tmp(D);
  for (int64_t i = 0; i < N; i++)
    for (int64_t h = 0; h < heads; h++) {
      float* v = x + i * stride + h * D;
      const float *c = cos + i * D, *s = sin + i * D;
      for (int64_t j = 0; j < half; j++) tmp[j] = v[j] * c[j] - v[j + half] * s[j];
      for (int64_t j = half; j < D; j++) tmp[j] = v[j] * c[j] + v[j - half] * s[j];
      std::copy(tmp.begin(), tmp.end(), v);
    }
}

// Input norm, the fused q/k/v product, RoPE: x (N, hidden) -> q (N, H, D), k and v (N, KV, D)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_qkv(const at::Tensor& x, const at::Tensor& norm, double eps,
                                                         at::TensorList w_qkv, const at::Tensor& cos,
                                                         const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  int64_t N = x.size(0), D = cos.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.numel() == N * D && sin.numel() == N * D,
              "x (N, hidden) float32, cos and sin one row of head_dim per token");
  auto qkv = linear_packed(rms_norm(x, norm, eps), w_qkv, (heads + 2 * kv_heads) * D).contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  float* p = qkv.data_ptr<float>();
  int64_t stride = qkv.size(1);
  rope(p, N, heads, D, stride, c.data_ptr<float>(), s.data_ptr<float>());
  rope(p + heads * D, N, kv_heads, D, stride, c.data_ptr<float>(), s.data_ptr<float>());
  auto q = qkv.narrow(1, 0, heads * D).reshape({N, heads, D}).contiguous();  // as three nn.Linear outputs
  auto k = qkv.narrow(1, heads * D, kv_heads * D).reshape({N, kv_heads, D}).contiguous();
  auto v = qkv.narrow(1, (heads + kv_heads) * D, kv_heads * D).reshape({N, kv_heads, D}).contiguous();
  return {q, k, v};
}

// The rest of the layer after attention's output y (N, H * D): x + o_proj(y), then + down(silu(gate) * up)
// of its post-attention norm -> (N, hidden)
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& y, at::TensorList w_o, const at::Tensor& norm, double eps,
                     at::TensorList w_gate_up, at::TensorList w_down, int64_t intermediate) {
  int64_t N = x.size(0), d = x.size(1);
  auto h = (x + linear_packed(y.reshape({N, -1}), w_o, d)).contiguous();
  auto gu = linear_packed(rms_norm(h, norm, eps), w_gate_up, 2 * intermediate).contiguous();
  auto a = at::empty({N, intermediate}, x.options());
  const float* g = gu.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  // silu(gate) = gate / (1 + e^-gate) = gate * e / (1 + e) with e = e^gate where gate < 0: e^-|gate| never
  // overflows, so eight at a time through exp_nonpositive (std::exp one by one cost ~8 us a layer)
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < N; i++) {
    const float *gi = g + i * 2 * intermediate, *ui = gi + intermediate;
    float* ai = ap + i * intermediate;
    int64_t j = 0;
    for (; j + 8 <= intermediate; j += 8) {
      __m256 gate = _mm256_loadu_ps(gi + j), e = exp_nonpositive(_mm256_or_ps(gate, sign));  // e^-|gate|
      __m256 num = _mm256_blendv_ps(gate, _mm256_mul_ps(gate, e), _mm256_cmp_ps(gate, zero, _CMP_LT_OQ));
      _mm256_storeu_ps(ai + j, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(ui + j)));
    }
    for (; j < intermediate; j++) ai[j] = gi[j] / (1.f + std::exp(-gi[j])) * ui[j];
  }
  h.add_(linear_packed(a, w_down, d));
  return h;
}

TORCH_LIBRARY(labkit_cpu, m) {
  m.def("q8_0_matvec(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("q4_1_matvec(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("q4_0_matvec(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("q8_0x8_matvec(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("f32_matvec(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor pos) -> Tensor");
  m.def("stream_read(Tensor x) -> float");
  m.def("layer_qkv(Tensor x, Tensor norm, float eps, Tensor[] w_qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("layer_out(Tensor x, Tensor y, Tensor[] w_o, Tensor norm, float eps, Tensor[] w_gate_up, Tensor[] w_down, int intermediate) -> Tensor");
}
TORCH_LIBRARY_IMPL(labkit_cpu, CPU, m) {
  m.impl("q8_0_matvec", &q8_0_matvec);
  m.impl("q4_1_matvec", &q4_1_matvec);
  m.impl("q4_0_matvec", &q4_0_matvec);
  m.impl("q8_0x8_matvec", &q8_0x8_matvec);
  m.impl("f32_matvec", &f32_matvec);
  m.impl("decode_attention", &decode_attention);
  m.impl("stream_read", &stream_read);
  m.impl("layer_qkv", &layer_qkv);
  m.impl("layer_out", &layer_out);
}
