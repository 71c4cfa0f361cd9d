// Weight-only int8 / int4 matrix products for small batches (decode steps): y = x @ W.T with W
// streamed from memory once per call. torch's own CPU kernels for these formats
// (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) ran 2-8x slower than float32 here, so a
// decode step got slower with fewer bytes. One row of x (batch 1) converts weights in registers
// as it streams them; several rows (a decode batch) convert each weight row once into a buffer
// that every row of x then reads (4-5x faster at 8 rows). The float loops are written for the
// compiler's vectorizer (-O3 -march=native, OpenMP simd pragmas); int8 on AVX2 and AVX-512 CPUs
// runs in integers instead (int8_linear_integer, below), and so does int4 (int4_linear_integer).
// All split the output rows over torch's threads.
//
// int8:  q [N, K] int8, scale [N]             w[n, k] = q[n, k] * scale[n]
// int4:  packed [N, K / 2] uint8, groups of 32 input channels; in group g of row n, byte j
//        (0..15) holds k = 32g + j in its low nibble and k = 32g + 16 + j in its high one, so
//        both halves meet contiguous runs of x.  w[n, k] = q[n, k] * scale[n, g] + low[n, g]
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace pdserve {

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 64;  // int4: the Python side sends larger batches to a dense matmul
constexpr int64_t kRowBlock = 64;  // int8 prefill chunks: rows of x per pass over the weights (in L2)
// Weights come from memory, not cache (a step reads each once): the loops ask for the weight
// rows this far ahead. The hardware prefetcher alone left a 1-3 MB int8 matrix at ~6 GB/s;
// 8 rows gave ~10 GB/s, 16 rows less (Xeon, 2 cores).
constexpr int64_t kPrefetchRows = 8;

void check_input(const torch::Tensor& x, int64_t K, int64_t max_rows = kMaxRows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(x.size(0) <= max_rows, "at most ", max_rows, " rows");
}

}  // namespace

// y[m, n] = scale * (x[m] . w) for every row m of x: four rows at a time, four independent
// chains per load of w.
inline void dot_rows(const float* xs, const float* w, int64_t M, int64_t N, int64_t K, int64_t n, float scale,
                     float* ys) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    const float *x0 = xs + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t k = 0; k < K; ++k) {
      a0 += x0[k] * w[k];
      a1 += x1[k] * w[k];
      a2 += x2[k] * w[k];
      a3 += x3[k] * w[k];
    }
    ys[m * N + n] = a0 * scale;
    ys[(m + 1) * N + n] = a1 * scale;
    ys[(m + 2) * N + n] = a2 * scale;
    ys[(m + 3) * N + n] = a3 * scale;
  }
  for (; m < M; ++m) {
    const float* xr = xs + m * K;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < K; ++k) acc += xr[k] * w[k];
    ys[m * N + n] = acc * scale;
  }
}

// Several rows of x (a decode batch): each weight row is converted to float once, into a small
// buffer, and then serves every row of x, instead of being converted once per row of x (the
// conversions, not the multiply-adds, bound the single-row loop).
static void int8_linear_batched(const float* xs, const int8_t* qs, const float* scales, float* ys, int64_t M, int64_t N,
                         int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* q = qs + n * K;
      if (n + kPrefetchRows < end) prefetch_rows(q + kPrefetchRows * K, K);
      float* w = row.data();
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) w[k] = static_cast<float>(q[k]);
      dot_rows(xs, row.data(), M, N, K, n, scales[n], ys);
    }
  });
}

// int8 weights in integer arithmetic (int8_linear_integer): each row of x is rounded to int16
// with its own scale (max |x| / 16383: an error of at most 3e-5 of the row's largest entry, far
// below the weights' own 8 bits), and pairs of int8 weights widened to int16 multiply and add into
// int32 lanes in one instruction (AVX512-VNNI vpdpwssd; AVX2 vpmaddwd + vpaddd). That is a third
// of the float loops' instructions per weight (widen, convert, FMA per 16), which bound them on
// the Xeon of docs/benchmarks.md: a step's int8 matrices took 6.7 ms at batch 1 (now 4.1) and
// 18.2 ms at batch 8 (now 12.1). |q| <= 127 and |x| <= 16383, so an int32 lane could overflow
// only past 1032 products; lanes go to float every kIntChunk inputs, by when each has summed at
// most 512 (AVX2) or 256 (AVX-512). The float loops above remain for CPUs without AVX2, widths
// that are not a multiple of the vector, and inputs that are not finite.
constexpr int64_t kIntChunk = 4096;
// From 32 rows of x up, AVX2 builds (kIntWidth 16) multiply in int8_panels.cpp's outer-product
// kernel instead of the dot-product loops below, which remain for smaller decode batches (on two
// AMD EPYC cores the pairs loop was faster up to 24 rows, and the panels from 32 up: their
// packing costs as much as a few rows' products) and for AVX512-VNNI builds (measured on the
// Xeon, where prefill chunks go to bfloat16 instead).
constexpr int64_t kPanelMinRows = 32;

// The integer primitives: a vector of int16 lanes (IVec), int8 -> int16 widening, a pairwise
// multiply-add into int32 lanes, and the lanes' sum as a float.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kIntWidth = 32;
using IVec = __m512i;
inline IVec zero() { return _mm512_setzero_si512(); }
inline IVec load(const int16_t* x) { return _mm512_loadu_si512(x); }
inline IVec widen(const int8_t* w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))); }
inline IVec multiply_add(IVec acc, IVec a, IVec b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline IVec add(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline float lane_sum(IVec acc) { return _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc)); }
#elif defined(__AVX2__)
constexpr int64_t kIntWidth = 16;
using IVec = __m256i;
inline IVec zero() { return _mm256_setzero_si256(); }
inline IVec load(const int16_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
inline IVec widen(const int8_t* w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
inline IVec multiply_add(IVec acc, IVec a, IVec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline IVec add(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline float horizontal_sum(__m256 lanes) {  // the int4 loops below sum their float lanes with it too
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
inline float lane_sum(IVec acc) { return horizontal_sum(_mm256_cvtepi32_ps(acc)); }
#else
constexpr int64_t kIntWidth = 0;  // no integer path: the float loops serve
using IVec = int;  // never used: int8_linear_integer returns before any of these runs
inline IVec zero() { return 0; }
inline IVec load(const int16_t*) { return 0; }
inline IVec widen(const int8_t*) { return 0; }
inline IVec multiply_add(IVec, IVec, IVec) { return 0; }
inline IVec add(IVec, IVec) { return 0; }
inline float lane_sum(IVec) { return 0.f; }
#endif

// One row of x rounded to int16 with its own scale; false if any entry is not finite (the float
// loops propagate inf and NaN as torch would). Vectorized: rounding a prefill's rows one element
// at a time took ~40 ms of a 210-token prefill on two AMD EPYC cores.
static bool round_row_to_int16(const float* row, int64_t K, int16_t* out, float* scale) {
  float peak = 0.f, poison = 0.f;  // poison: NaN iff some entry is inf or NaN (inf * 0 is NaN)
#pragma omp simd reduction(max : peak) reduction(+ : poison)
  for (int64_t k = 0; k < K; ++k) {
    peak = std::max(peak, std::fabs(row[k]));
    poison += row[k] * 0.f;
  }
  if (poison != 0.f) return false;
  *scale = peak > 0.f ? peak / 16383.f : 1.f;
  const float inverse = 1.f / *scale;
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 factor = _mm256_set1_ps(inverse);
  for (; k + 16 <= K; k += 16) {  // round to nearest even (as nearbyint), then pack 16 lanes in order
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), factor));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), factor));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), packed);
  }
#endif
  for (; k < K; ++k) out[k] = static_cast<int16_t>(std::nearbyint(row[k] * inverse));
  return true;
}

static bool round_rows_to_int16(const float* xs, int64_t M, int64_t K, std::vector<int16_t>& xq,
                                std::vector<float>& x_scales) {
  xq.resize(M * K);
  x_scales.resize(M);
  std::atomic<bool> finite{true};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (!round_row_to_int16(xs + m * K, K, xq.data() + m * K, &x_scales[m])) finite = false;
    }
  });
  return finite;
}

// Up to four dot products of int16 vectors a[i] . b[i] over K, each a chain of its own: one
// chain waits on the multiply-add's latency (~5 cycles), four keep the unit busy.
template <int kCount>
inline void dot_int16(const int16_t* const* a, const int16_t* const* b, int64_t K, float* out) {
  for (int i = 0; i < kCount; ++i) out[i] = 0.f;
  for (int64_t start = 0; start < K; start += kIntChunk) {
    IVec lanes[kCount];
    for (int i = 0; i < kCount; ++i) lanes[i] = zero();
    for (int64_t k = start; k < std::min(K, start + kIntChunk); k += kIntWidth) {
      for (int i = 0; i < kCount; ++i) lanes[i] = multiply_add(lanes[i], load(a[i] + k), load(b[i] + k));
    }
    for (int i = 0; i < kCount; ++i) out[i] += lane_sum(lanes[i]);
  }
}

// Batch 1 reads a thread's weight rows one at a time, in address order (one stream per thread),
// and asks for the bytes kPrefetchBytes ahead of the row it starts. On two Zen 4 cores, a step's
// int8 matrices (cycled, beyond L3, each call on two threads) took 1.05-1.09x the time of a plain
// sum over the same bytes this way; four rows at a time with the rows 8 ahead (4.6 KB at K = 576)
// took 1.15-1.33x, 4 KB ahead 1.14-1.31x, 12-24 KB ahead 1.07-1.13x (docs/benchmarks.md,
// "sixteenth pass").
// It asks only where the hardware prefetchers do not suffice (kernels.h): on the Zen 4 of the
// twenty-first pass, with the weights on huge pages, a 230 MB int8 GEMV read 61-63 GB/s without
// the prefetch and 42-43 with it while a plain sum read 62-64, and the engine's int8 batch-1 step
// took 0.77-0.95x the time.
constexpr int64_t kPrefetchBytes = 8192;

// Asks for the bytes kPrefetchBytes ahead of `row` (within the thread's rows), if `prefetch`.
inline void prefetch_ahead(bool prefetch, const int8_t* row, int64_t K, const int8_t* range_end) {
  const int8_t* ahead = row + kPrefetchBytes;
  if (prefetch && ahead < range_end) prefetch_rows<PrefetchTo::kL2>(ahead, std::min<int64_t>(K, range_end - ahead));
}

// One row of x against one weight row, widened in registers as it streams by: two chains of
// multiply-adds, whose int32 lanes add exactly, so the result is that of a single chain.
inline float dot_int8_row(const int16_t* x, const int8_t* w, int64_t K) {
  float total = 0.f;
  for (int64_t start = 0; start < K; start += kIntChunk) {
    const int64_t stop = std::min(K, start + kIntChunk);
    IVec even = zero(), odd = zero();
    int64_t k = start;
    for (; k + 2 * kIntWidth <= stop; k += 2 * kIntWidth) {
      even = multiply_add(even, load(x + k), widen(w + k));
      odd = multiply_add(odd, load(x + k + kIntWidth), widen(w + k + kIntWidth));
    }
    if (k < stop) even = multiply_add(even, load(x + k), widen(w + k));
    total += lane_sum(add(even, odd));
  }
  return total;
}

// Batch 1 with the row of x held in registers (AVX-512: K / 32 vectors of int16, for K up to
// kMaxRegisterVectors * 32), each weight row streamed past it as in dot_int8_row, with the same
// chains (so the same sums). Loading x again for every weight vector, not the multiply-adds,
// bound dot_int8_row where the weights come from cache: on one Zen 4 core a 576 x 576 matrix
// in L2 took 8.6 us that way and 6.3 us with x in registers, 3072 x 576 41.9 and 30.3 us
// (docs/benchmarks.md, "twentieth pass"); from memory, the stream bounds both.
constexpr int kMaxRegisterVectors = 24;  // of the 32 zmm registers: x, two chains, the widened weights

template <int V>
static void int8_rows_x_in_registers(const int16_t* xq, const int8_t* qs, const float* scales, float x_scale,
                                     float* ys, int64_t begin, int64_t end, const int8_t* range_end) {
  static_assert(V <= kMaxRegisterVectors, "x must leave registers for the chains and the widened weights");
  constexpr int64_t K = V * kIntWidth;
  IVec xv[V];
  for (int i = 0; i < V; ++i) xv[i] = load(xq + i * kIntWidth);
  const bool prefetch = !hardware_prefetch_suffices();
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = qs + n * K;
    prefetch_ahead(prefetch, row, K, range_end);
    IVec even = zero(), odd = zero();
#pragma GCC unroll 32
    for (int i = 0; i + 1 < V; i += 2) {
      even = multiply_add(even, xv[i], widen(row + i * kIntWidth));
      odd = multiply_add(odd, xv[i + 1], widen(row + (i + 1) * kIntWidth));
    }
    if constexpr (V % 2 == 1) even = multiply_add(even, xv[V - 1], widen(row + (V - 1) * kIntWidth));
    ys[n] = lane_sum(add(even, odd)) * x_scale * scales[n];
  }
}

// int8_rows_x_in_registers for this K, if it has an instance; false otherwise.
static bool int8_rows_in_registers(const int16_t* xq, const int8_t* qs, const float* scales, float x_scale,
                                   float* ys, int64_t K, int64_t begin, int64_t end, const int8_t* range_end) {
  if (kIntWidth != 32 || K % 32 != 0) return false;
  switch (K / 32) {
    case 16: int8_rows_x_in_registers<16>(xq, qs, scales, x_scale, ys, begin, end, range_end); return true;
    case 18: int8_rows_x_in_registers<18>(xq, qs, scales, x_scale, ys, begin, end, range_end); return true;
    case 20: int8_rows_x_in_registers<20>(xq, qs, scales, x_scale, ys, begin, end, range_end); return true;
    case 24: int8_rows_x_in_registers<24>(xq, qs, scales, x_scale, ys, begin, end, range_end); return true;
    default: return false;
  }
}

// Four rows of x against two weight rows: eight chains, and each loaded vector feeds two or four
// multiply-adds (with one weight row, loads of x bounded the loop: ~100 GFLOP/s-equivalent on
// two AMD EPYC cores, no faster than float32). Without in_register gcc loaded each vector again
// for every multiply-add (16 loads a step, not 6): the pairs loop at 8 rows took 37-41 ms of a
// step's products, 25-27 ms with it and the prefetch in int8_linear_integer.
inline void dot_int16_4x2(const int16_t* const* x, const int16_t* w0, const int16_t* w1, int64_t K,
                          float out[4][2]) {
  for (int i = 0; i < 4; ++i) out[i][0] = out[i][1] = 0.f;
  for (int64_t start = 0; start < K; start += kIntChunk) {
    IVec lanes[4][2];
    for (int i = 0; i < 4; ++i) lanes[i][0] = lanes[i][1] = zero();
    for (int64_t k = start; k < std::min(K, start + kIntChunk); k += kIntWidth) {
      IVec a = load(w0 + k), b = load(w1 + k);
      in_register(a);
      in_register(b);
      for (int i = 0; i < 4; ++i) {
        IVec xv = load(x[i] + k);
        in_register(xv);
        lanes[i][0] = multiply_add(lanes[i][0], xv, a);
        lanes[i][1] = multiply_add(lanes[i][1], xv, b);
      }
    }
    for (int i = 0; i < 4; ++i) {
      out[i][0] += lane_sum(lanes[i][0]);
      out[i][1] += lane_sum(lanes[i][1]);
    }
  }
}

// Rows [m_begin, m_end) of x against weight rows n and n + 1, widened into `wide` (2K).
static void int8_rows_x2(const int16_t* xq, const float* x_scales, const int8_t* qs, const float* scales, float* ys,
                         int64_t m_begin, int64_t m_end, int64_t n, int64_t N, int64_t K, int16_t* wide) {
  for (int64_t k = 0; k < 2 * K; ++k) wide[k] = qs[n * K + k];
  const int16_t *w0 = wide, *w1 = wide + K;
  int64_t m = m_begin;
  for (; m + 4 <= m_end; m += 4) {
    const int16_t* x[4] = {xq + m * K, xq + (m + 1) * K, xq + (m + 2) * K, xq + (m + 3) * K};
    float dots[4][2];
    dot_int16_4x2(x, w0, w1, K, dots);
    for (int i = 0; i < 4; ++i) {
      ys[(m + i) * N + n] = dots[i][0] * x_scales[m + i] * scales[n];
      ys[(m + i) * N + n + 1] = dots[i][1] * x_scales[m + i] * scales[n + 1];
    }
  }
  for (; m < m_end; ++m) {
    const int16_t* x[2] = {xq + m * K, xq + m * K};
    const int16_t* w[2] = {w0, w1};
    float dots[2];
    dot_int16<2>(x, w, K, dots);
    ys[m * N + n] = dots[0] * x_scales[m] * scales[n];
    ys[m * N + n + 1] = dots[1] * x_scales[m] * scales[n + 1];
  }
}

// Batch 1: weight rows [begin, end) against one row of x rounded to int16 (xq, x_scale), one stream
// of rows in address order.
void int8_batch1_rows(const int16_t* xq, float x_scale, const int8_t* qs, const float* scales, float* ys, int64_t K,
                      int64_t begin, int64_t end) {
  const int8_t* range_end = qs + end * K;
  if (int8_rows_in_registers(xq, qs, scales, x_scale, ys, K, begin, end, range_end)) return;
  const bool prefetch = !hardware_prefetch_suffices();
  for (int64_t n = begin; n < end; ++n) {  // other widths
    const int8_t* row = qs + n * K;
    prefetch_ahead(prefetch, row, K, range_end);
    ys[n] = dot_int8_row(xq, row, K) * x_scale * scales[n];
  }
}

bool int8_batch1_supported(int64_t K) { return kIntWidth != 0 && K % kIntWidth == 0; }

bool round_for_int8(const float* x, int64_t K, RoundedRows& in) {
  in.rounded.resize(K);
  in.scales.resize(1);
  return round_row_to_int16(x, K, in.rounded.data(), in.scales.data());
}

static bool int8_linear_integer(const float* xs, const int8_t* qs, const float* scales, float* ys, int64_t M,
                                int64_t N, int64_t K) {
  if (!int8_batch1_supported(K)) return false;
  std::vector<int16_t> xq;
  std::vector<float> x_scales;
  if (!round_rows_to_int16(xs, M, K, xq, x_scales)) return false;
  if (M >= kPanelMinRows && kIntWidth == 16 &&
      int8_linear_panels(xq.data(), x_scales.data(), qs, scales, ys, M, N, K)) {
    return true;
  }
  if (M == 1) {
    at::parallel_for(0, N, kBatch1Grain, [&](int64_t begin, int64_t end) {
      int8_batch1_rows(xq.data(), x_scales[0], qs, scales, ys, K, begin, end);
    });
    return true;
  }
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> wide(K);
    const int16_t* wide_row = wide.data();
    int64_t n = begin;
    if (M >= 4) {  // a batch below the panels (AVX-512: any): pairs of weight rows, x blocks in L2
      const int64_t pairs_end = begin + (end - begin) / 2 * 2;
      std::vector<int16_t> wide_pair(2 * K);
      for (int64_t m = 0; m < M; m += kRowBlock) {
        for (int64_t pair = begin; pair < pairs_end; pair += 2) {
          // The weights come from memory once, on the first block of rows of x.
          if (m == 0 && pair + 2 + kPrefetchRows <= pairs_end) prefetch_rows(qs + (pair + kPrefetchRows) * K, 2 * K);
          int8_rows_x2(xq.data(), x_scales.data(), qs, scales, ys, m, std::min(M, m + kRowBlock), pair, N, K,
                       wide_pair.data());
        }
      }
      n = pairs_end;
    }
    for (; n < end; ++n) {  // a decode batch: widen once, read by every row of x
      const int8_t* row = qs + n * K;
      if (n + kPrefetchRows < end) prefetch_rows(row + kPrefetchRows * K, K);
      for (int64_t k = 0; k < K; ++k) wide[k] = row[k];
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        const int16_t* x[4] = {xq.data() + m * K, xq.data() + (m + 1) * K, xq.data() + (m + 2) * K,
                               xq.data() + (m + 3) * K};
        const int16_t* w[4] = {wide_row, wide_row, wide_row, wide_row};
        float dots[4];
        dot_int16<4>(x, w, K, dots);
        for (int i = 0; i < 4; ++i) ys[(m + i) * N + n] = dots[i] * x_scales[m + i] * scales[n];
      }
      for (; m < M; ++m) {
        const int16_t* x[1] = {xq.data() + m * K};
        float dot;
        dot_int16<1>(x, &wide_row, K, &dot);
        ys[m * N + n] = dot * x_scales[m] * scales[n];
      }
    }
  });
  return true;
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check_input(x, K, std::numeric_limits<int64_t>::max());  // any batch: prefill chunks too
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == N, "scale must be float32 [N]");
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* scales = scale.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  if (int8_linear_integer(xs, qs, scales, ys, M, N, K)) return y;
  if (M > 1) {
    int8_linear_batched(xs, qs, scales, ys, M, N, K);
    return y;
  }
  // Four rows at a time: four independent accumulator chains share each load of x (one chain
  // alone waits on the FMA latency, not on memory).
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
      const int8_t *r0 = qs + n * K, *r1 = r0 + K, *r2 = r1 + K, *r3 = r2 + K;
      if (n + 4 + kPrefetchRows <= end) prefetch_rows(r0 + kPrefetchRows * K, 4 * K);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xs + m * K;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t k = 0; k < K; ++k) {
          const float xv = xr[k];
          a0 += xv * static_cast<float>(r0[k]);
          a1 += xv * static_cast<float>(r1[k]);
          a2 += xv * static_cast<float>(r2[k]);
          a3 += xv * static_cast<float>(r3[k]);
        }
        float* yr = ys + m * N + n;
        yr[0] = a0 * scales[n];
        yr[1] = a1 * scales[n + 1];
        yr[2] = a2 * scales[n + 2];
        yr[3] = a3 * scales[n + 3];
      }
    }
    for (; n < end; ++n) {
      const int8_t* row = qs + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xs + m * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(row[k]);
        ys[m * N + n] = acc * scales[n];
      }
    }
  });
  return y;
}

// The int4 counterpart of int8_linear_batched, where the integer path cannot serve: each weight row
// is dequantized once into a buffer.
static void int4_linear_batched(const float* xs, const uint8_t* ps, const float* scales, const float* lows,
                                float* ys, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* bytes = ps + n * (K / 2);
      if (n + kPrefetchRows < end) prefetch_rows(bytes + kPrefetchRows * (K / 2), K / 2);
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = bytes + g * (kGroup / 2);
        float* w = row.data() + g * kGroup;
        const float s = scales[n * G + g], low = lows[n * G + g];
#pragma omp simd
        for (int64_t j = 0; j < kGroup / 2; ++j) {
          w[j] = static_cast<float>(b[j] & 15) * s + low;
          w[j + kGroup / 2] = static_cast<float>(b[j] >> 4) * s + low;
        }
      }
      dot_rows(xs, row.data(), M, N, K, n, 1.f, ys);
    }
  });
}

// int4 weights in integers: x rounded to int16 as for int8, a group's 16 bytes widened to its 32
// nibbles as int16 lanes (the low nibbles, inputs 32g..32g+15, then the high ones, 32g+16..32g+31),
// multiplied and added in pairs into int32 lanes, which become float once per group to take the
// group's scale. The float loops converted every nibble to float and held the batch-1 int4 step
// at 2.5x its weight-streaming floor, slower than int8's step with two thirds of its bytes; a
// step's int4 products at batch 1 went from 9.6 to 3.3 ms, at batch 8 from 22.6 to 13.7 (Xeon, 2
// cores). At batches the float conversion and scale per group and row of x bound these loops
// (about twice int8's work per weight, where int8 converts once per 4096 inputs), so from 16 rows
// up the panels of int4_panels.cpp serve instead. A lane sums at most 8 products of 15 * 16383:
// exact.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Two groups per step: their 32 bytes widen to 32 int16 lanes at once (one vpmovzxbw), whose low
// nibbles are inputs 0..15 of both groups and whose high nibbles are inputs 16..31. x is put in
// that order once per call (order_int4_inputs), and int32 lanes 0-7 then sum the first group, 8-15
// the second, which take their two scales in one vector.
constexpr bool kInt4Integer = true;
constexpr int64_t kInt4GroupsPerStep = 2;
using FVec = __m512;
struct Nibbles {
  __m512i low, high;
};
inline Nibbles widen_nibbles(const uint8_t* bytes) {
  const __m512i lanes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  // Zero-extended bytes: shifted right by 4, a lane is its high nibble with no mask.
  return {_mm512_and_si512(lanes, _mm512_set1_epi16(15)), _mm512_srli_epi16(lanes, 4)};
}
inline void store_nibbles(const Nibbles& w, int16_t* out) {
  _mm512_storeu_si512(out, w.low);
  _mm512_storeu_si512(out + 32, w.high);
}
inline Nibbles load_nibbles(const int16_t* wide) { return {_mm512_loadu_si512(wide), _mm512_loadu_si512(wide + 32)}; }
// The input of a step (0..63) that its int16 lane p multiplies: low nibbles of both groups, then high.
constexpr int64_t step_input(int64_t p) { return (p % 32) / 16 * 32 + p / 32 * 16 + p % 16; }
inline FVec nibble_products(const int16_t* x, const Nibbles& w) {
  const __m512i sums = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(x), w.low);
  return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(sums, _mm512_loadu_si512(x + 32), w.high));
}
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec step_scales(const float* scales) {  // lanes 0-7: the first group's scale, 8-15: the second's
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 pair = _mm512_castpd_ps(_mm512_castpd128_pd512(_mm_load_sd(reinterpret_cast<const double*>(scales))));
  return _mm512_permutexvar_ps(halves, pair);
}
inline FVec scaled_add(FVec acc, FVec products, FVec scales) { return _mm512_fmadd_ps(products, scales, acc); }
inline float fsum(FVec acc) { return _mm512_reduce_add_ps(acc); }
// acc + lows[g] * sums[g] for g < G, spread over the lanes (fsum adds them all).
inline FVec add_low_terms(FVec acc, const float* lows, const float* sums, int64_t G) {
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 mask = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, lows + g), _mm512_maskz_loadu_ps(mask, sums + g), acc);
  }
  return acc;
}
#elif defined(__AVX2__)
// Two groups per step too, widened with shifts and masks, no shuffles: each 16-bit lane of their 32
// bytes holds four nibbles (the low and high nibble of an even byte, then of the odd byte after it),
// and masked out in place they are four vectors of int16 lanes. Lanes 0-7 hold the first group's
// bytes, 8-15 the second's, so int32 lanes 0-3 sum the first group and 4-7 the second, which take
// their two scales in one vector. One group a step, widened by two vpmovzxbw (the shuffle unit),
// bound the batch-1 loop: on two Zen 3 cores this one took 0.70x its time, in cache and from memory,
// and an int4 engine's batch-1 step 0.82x (docs/benchmarks.md, "twenty-fifth pass").
constexpr bool kInt4Integer = true;
constexpr int64_t kInt4GroupsPerStep = 2;
using FVec = __m256;
struct Nibbles {
  __m256i even_low, even_high, odd_low, odd_high;
};
inline Nibbles widen_nibbles(const uint8_t* bytes) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i mask = _mm256_set1_epi16(15);
  return {_mm256_and_si256(lanes, mask), _mm256_and_si256(_mm256_srli_epi16(lanes, 4), mask),
          _mm256_and_si256(_mm256_srli_epi16(lanes, 8), mask), _mm256_srli_epi16(lanes, 12)};
}
inline void store_nibbles(const Nibbles& w, int16_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), w.even_low);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), w.even_high);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), w.odd_low);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 48), w.odd_high);
}
// The input of a step (0..63) that its int16 lane p multiplies: the four vectors of widen_nibbles
// in turn, lane i of each from bytes 2i (low, high nibble) and 2i + 1 (low, high).
constexpr int64_t step_input(int64_t p) {
  const int64_t byte = 2 * (p % 16) + p / 32;
  return byte / 16 * 32 + (p / 16) % 2 * 16 + byte % 16;
}
inline Nibbles load_nibbles(const int16_t* wide) {
  return {load(wide), load(wide + 16), load(wide + 32), load(wide + 48)};  // load: the int8 loops' int16 load
}
inline FVec nibble_products(const int16_t* x, const Nibbles& w) {
  const __m256i even =
      _mm256_add_epi32(_mm256_madd_epi16(load(x), w.even_low), _mm256_madd_epi16(load(x + 16), w.even_high));
  const __m256i odd =
      _mm256_add_epi32(_mm256_madd_epi16(load(x + 32), w.odd_low), _mm256_madd_epi16(load(x + 48), w.odd_high));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
}
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec step_scales(const float* scales) {  // lanes 0-3: the first group's scale, 4-7: the second's
  return _mm256_set_m128(_mm_set1_ps(scales[1]), _mm_set1_ps(scales[0]));
}
inline FVec scaled_add(FVec acc, FVec products, FVec scales) { return _mm256_fmadd_ps(products, scales, acc); }
inline float fsum(FVec acc) { return horizontal_sum(acc); }
inline FVec add_low_terms(FVec acc, const float* lows, const float* sums, int64_t G) {
  for (int64_t g = 0; g < G; g += 8) {
    const int64_t left = std::min<int64_t>(8, G - g);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lanes);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(lows + g, mask), _mm256_maskload_ps(sums + g, mask), acc);
  }
  return acc;
}
#else
constexpr bool kInt4Integer = false;  // the float loops serve
constexpr int64_t kInt4GroupsPerStep = 1;
using FVec = float;  // never used: the integer int4 paths return before any of these runs
struct Nibbles {
  int low, high;
};
inline Nibbles widen_nibbles(const uint8_t*) { return {0, 0}; }
inline void store_nibbles(const Nibbles&, int16_t*) {}
inline Nibbles load_nibbles(const int16_t*) { return {0, 0}; }
constexpr int64_t step_input(int64_t p) { return p; }
inline FVec nibble_products(const int16_t*, const Nibbles&) { return 0.f; }
inline FVec fzero() { return 0.f; }
inline FVec step_scales(const float*) { return 0.f; }
inline FVec scaled_add(FVec, FVec, FVec) { return 0.f; }
inline float fsum(FVec) { return 0.f; }
inline FVec add_low_terms(FVec, const float*, const float*, int64_t) { return 0.f; }
#endif

// From 16 rows of x up, int4_panels.cpp's outer-product kernel serves, which takes the scales of
// 16 (AVX512-VNNI) or 8 (AVX2) outputs at once: a step's int4 products at 32 rows went from 73 to
// 31 ms (from 93 to 54 on the AVX2 build). Below, packing its panels costs about what it saves:
// at 2, 4 and 8 rows it took 10.9, 10.1 and 13.6 ms against these loops' 9.3, 11.8 and 13.0 (Xeon,
// 2 cores).
constexpr int64_t kInt4PanelMinRows = 16;

// The int16 inputs one step of the dot-product loops covers.
constexpr int64_t kInt4Step = kInt4GroupsPerStep * kGroup;

// The rows of x as the integer int4 loops read them: rounded to int16 with a scale per row
// (round_rows_to_int16), and each group's integer sum, for the low terms. Those take the rounded
// x's sums, not x's own, so that the result is the dequantized weights' product with the rounded
// x, as for int8: with x's own sums the rounding errors of the nibble products (q in 0..15, not
// centred) no longer cancel against the low terms (2e-4 of the result, not 6e-5). The dot-product
// loops read x in step order (step_input: the order in which widen_nibbles lays out a step's
// nibbles); the panels read it as it is.

static bool round_int4_inputs(const float* xs, int64_t M, int64_t K, RoundedRows& in) {
  if (!round_rows_to_int16(xs, M, K, in.rounded, in.scales)) return false;
  const int64_t G = K / kGroup;
  in.sums.resize(M * G);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const int16_t* group = in.rounded.data() + m * K + g * kGroup;
      int32_t sum = 0;
      for (int64_t j = 0; j < kGroup; ++j) sum += group[j];
      in.sums[m * G + g] = static_cast<float>(sum);
    }
  }
  return true;
}

// step_input for each lane of a step, as a table: computed per entry, the divisions made this copy
// most of a small int4 GEMV's fixed time.
constexpr std::array<int64_t, kInt4Step> kStepOrder = [] {
  std::array<int64_t, kInt4Step> order{};
  for (int64_t p = 0; p < kInt4Step; ++p) order[p] = step_input(p);
  return order;
}();

static void order_int4_inputs(int64_t M, int64_t K, RoundedRows& in) {
  in.x.resize(M * K);
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* row = in.rounded.data() + m * K;
    int16_t* out = in.x.data() + m * K;
    for (int64_t base = 0; base < K; base += kInt4Step) {
      for (int64_t p = 0; p < kInt4Step; ++p) out[base + p] = row[base + kStepOrder[p]];
    }
  }
}

// Four weight rows against the one row of x: four accumulator chains share each step of x.
static void int4_rows4_integer(const RoundedRows& in, const uint8_t* const* rows, const float* const* scales,
                               const float* const* lows, int64_t G, float* out) {
  FVec acc0 = fzero(), acc1 = fzero(), acc2 = fzero(), acc3 = fzero();
  for (int64_t g = 0; g < G; g += kInt4GroupsPerStep) {
    const int16_t* x = in.x.data() + g * kGroup;
    const int64_t offset = g * (kGroup / 2);
    acc0 = scaled_add(acc0, nibble_products(x, widen_nibbles(rows[0] + offset)), step_scales(scales[0] + g));
    acc1 = scaled_add(acc1, nibble_products(x, widen_nibbles(rows[1] + offset)), step_scales(scales[1] + g));
    acc2 = scaled_add(acc2, nibble_products(x, widen_nibbles(rows[2] + offset)), step_scales(scales[2] + g));
    acc3 = scaled_add(acc3, nibble_products(x, widen_nibbles(rows[3] + offset)), step_scales(scales[3] + g));
  }
  const float* sums = in.sums.data();
  const float x_scale = in.scales[0];
  out[0] = fsum(add_low_terms(acc0, lows[0], sums, G)) * x_scale;
  out[1] = fsum(add_low_terms(acc1, lows[1], sums, G)) * x_scale;
  out[2] = fsum(add_low_terms(acc2, lows[2], sums, G)) * x_scale;
  out[3] = fsum(add_low_terms(acc3, lows[3], sums, G)) * x_scale;
}

// Batch 1 asks for the weight rows, their scales and their lows this far ahead: the scales and
// lows are streams of their own, a third of the bytes, which no software prefetch covered. On two
// Zen 5 cores, alternating in one engine, int4 batch-1 steps took 0.93-0.96x the time of the
// weight rows alone 8 rows ahead; 8 rows ahead for all three, 0.97x (docs/benchmarks.md,
// "twenty-fourth pass"). 16 rows of int4 weights are the bytes of kPrefetchRows int8 rows.
constexpr int64_t kInt4PrefetchRows = 2 * kPrefetchRows;

// Batch 1: each weight row is widened in registers as it streams by. On AVX2 without AVX512-VNNI,
// int4_byte_inputs.cpp's loop serves instead.
void int4_batch1_rows(const RoundedRows& in, const uint8_t* ps, const float* scales, const float* lows, float* ys,
                      int64_t K, int64_t begin, int64_t end) {
  if (kInt4ByteInputs) return int4_byte_batch1_rows(in, ps, scales, lows, ys, K, begin, end);
  const int64_t G = K / kGroup, row_bytes = K / 2;
  for (int64_t n = begin; n < end; n += 4) {
    const int64_t count = std::min<int64_t>(4, end - n);
    if (const int64_t ahead = n + kInt4PrefetchRows; ahead + 4 <= end) {
      prefetch_rows(ps + ahead * row_bytes, 4 * row_bytes);
      prefetch_rows(scales + ahead * G, 4 * G * sizeof(float));
      prefetch_rows(lows + ahead * G, 4 * G * sizeof(float));
    }
    const uint8_t* rows[4];
    const float *row_scales[4], *row_lows[4];
    for (int i = 0; i < 4; ++i) {  // a tail of fewer than four repeats its last row
      const int64_t r = n + std::min<int64_t>(i, count - 1);
      rows[i] = ps + r * row_bytes;
      row_scales[i] = scales + r * G;
      row_lows[i] = lows + r * G;
    }
    float dots[4];
    int4_rows4_integer(in, rows, row_scales, row_lows, G, dots);
    for (int64_t i = 0; i < count; ++i) ys[n + i] = dots[i];
  }
}

bool int4_batch1_supported(int64_t K) { return kInt4Integer && K % kInt4Step == 0; }

bool round_for_int4(const float* x, int64_t K, RoundedRows& in) {
  if (kInt4ByteInputs) return round_int4_bytes(x, K, in);
  if (!round_int4_inputs(x, 1, K, in)) return false;
  order_int4_inputs(1, K, in);
  return true;
}

// Four rows of x (from row m) against one weight row, widened once into `wide`: each step's
// nibbles and scales are loaded once for all four. Named accumulators: in an array, gcc stored
// all four to the stack every step.
static void int4_wide_row4(const RoundedRows& in, const int16_t* wide, const float* scales, const float* lows,
                           int64_t m, int64_t n, int64_t N, int64_t K, float* ys) {
  const int64_t G = K / kGroup;
  const int16_t *x0 = in.x.data() + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
  FVec acc0 = fzero(), acc1 = fzero(), acc2 = fzero(), acc3 = fzero();
  for (int64_t g = 0; g < G; g += kInt4GroupsPerStep) {
    const int64_t k = g * kGroup;
    const Nibbles w = load_nibbles(wide + k);
    const FVec step_scale = step_scales(scales + g);
    acc0 = scaled_add(acc0, nibble_products(x0 + k, w), step_scale);
    acc1 = scaled_add(acc1, nibble_products(x1 + k, w), step_scale);
    acc2 = scaled_add(acc2, nibble_products(x2 + k, w), step_scale);
    acc3 = scaled_add(acc3, nibble_products(x3 + k, w), step_scale);
  }
  const FVec accs[4] = {acc0, acc1, acc2, acc3};
  for (int i = 0; i < 4; ++i) {
    ys[(m + i) * N + n] = fsum(add_low_terms(accs[i], lows, in.sums.data() + (m + i) * G, G)) * in.scales[m + i];
  }
}

// One row of x against one widened weight row (a batch's last rows).
static void int4_wide_row1(const RoundedRows& in, const int16_t* wide, const float* scales, const float* lows,
                           int64_t m, int64_t n, int64_t N, int64_t K, float* ys) {
  const int64_t G = K / kGroup;
  const int16_t* x = in.x.data() + m * K;
  FVec acc = fzero();
  for (int64_t g = 0; g < G; g += kInt4GroupsPerStep) {
    acc = scaled_add(acc, nibble_products(x + g * kGroup, load_nibbles(wide + g * kGroup)), step_scales(scales + g));
  }
  ys[m * N + n] = fsum(add_low_terms(acc, lows, in.sums.data() + m * G, G)) * in.scales[m];
}

// A decode batch: each weight row's nibbles widen once into a buffer that every row of x reads.
static void int4_linear_rows(const RoundedRows& in, const uint8_t* ps, const float* scales, const float* lows,
                             float* ys, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> wide(K);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = ps + n * row_bytes;
      if (n + kPrefetchRows < end) prefetch_rows(row + kPrefetchRows * row_bytes, row_bytes);
      for (int64_t k = 0; k < K; k += kInt4Step) store_nibbles(widen_nibbles(row + k / 2), wide.data() + k);
      const float *row_scales = scales + n * G, *row_lows = lows + n * G;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int4_wide_row4(in, wide.data(), row_scales, row_lows, m, n, N, K, ys);
      for (; m < M; ++m) int4_wide_row1(in, wide.data(), row_scales, row_lows, m, n, N, K, ys);
    }
  });
}

// False where the float loops must serve: no integer path, or an entry of x not finite.
static bool int4_linear_integer(const float* xs, const uint8_t* ps, const float* scales, const float* lows, float* ys,
                                int64_t M, int64_t N, int64_t K) {
  const bool panels = M >= kInt4PanelMinRows;  // the panels take any group count, the dot-product loops whole steps
  if (!kInt4Integer || (!panels && (K / kGroup) % kInt4GroupsPerStep != 0)) return false;
  RoundedRows in;
  if (M == 1) {
    if (!round_for_int4(xs, K, in)) return false;
    at::parallel_for(0, N, kBatch1Grain,
                     [&](int64_t begin, int64_t end) { int4_batch1_rows(in, ps, scales, lows, ys, K, begin, end); });
    return true;
  }
  if (!round_int4_inputs(xs, M, K, in)) return false;
  if (panels) {
    return int4_linear_panels(in.rounded.data(), in.scales.data(), in.sums.data(), ps, scales, lows, ys, M, N, K);
  }
  order_int4_inputs(M, K, in);
  int4_linear_rows(in, ps, scales, lows, ys, M, N, K);
  return true;
}

static void check_int4_weights(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == N * G, "scale must be float32 [N, K/32]");
  TORCH_CHECK(low.scalar_type() == torch::kFloat32 && low.numel() == N * G, "low must be float32 [N, K/32]");
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, M = x.size(0), G = K / kGroup;
  check_input(x, K);
  check_int4_weights(packed, scale, low);
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const uint8_t* ps = packed.data_ptr<uint8_t>();
  const float* scales = scale.data_ptr<float>();
  const float* lows = low.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  if (int4_linear_integer(xs, ps, scales, lows, ys, M, N, K)) return y;
  if (M > 1) {
    int4_linear_batched(xs, ps, scales, lows, ys, M, N, K);
    return y;
  }
  // Each group's sum of x: the `low` term of a group is low * sum(x over the group).
  auto x_sums = x.view({M, G, kGroup}).sum(-1).contiguous();
  const float* sums = x_sums.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = ps + n * (K / 2);
      if (n + kPrefetchRows < end) prefetch_rows(row + kPrefetchRows * (K / 2), K / 2);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xs + m * K;
        // One partial sum per lane across all groups: a single horizontal sum per row.
        float lanes[kGroup / 2] = {};
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* bytes = row + g * (kGroup / 2);
          const float* xg = xr + g * kGroup;
          const float s = scales[n * G + g];
#pragma omp simd
          for (int64_t j = 0; j < kGroup / 2; ++j) {
            lanes[j] += s * (xg[j] * static_cast<float>(bytes[j] & 15) +
                             xg[j + kGroup / 2] * static_cast<float>(bytes[j] >> 4));
          }
          acc += lows[n * G + g] * sums[m * G + g];
        }
        for (int64_t j = 0; j < kGroup / 2; ++j) acc += lanes[j];
        ys[m * N + n] = acc;
      }
    }
  });
  return y;
}

// The dequantized weights, q * scale + low, as float32 or bfloat16 (rounded to nearest even, as
// torch's .bfloat16() rounds): for prefill chunks, which multiply them densely. In torch the
// unpacking, the float32 copy and then the bfloat16 one each took a pass over the weights: they
// added ~90 ms to a 210-token int4 prefill (Xeon, 2 cores), where int8's conversion is one pass.
// No fused multiply-add: a product and a sum each rounded, as torch computes them, so that these
// are int4_dequantize's weights (quantization.py) bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
static void dequantize_int4_row(const uint8_t* bytes, const float* scales, const float* lows, T* out, int64_t K) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* b = bytes + g * (kGroup / 2);
    const float s = scales[g], low = lows[g];
    T* w = out + g * kGroup;
#pragma omp simd
    for (int64_t j = 0; j < kGroup / 2; ++j) {
      w[j] = from_float<T>(static_cast<float>(b[j] & 15) * s + low);
      w[j + kGroup / 2] = from_float<T>(static_cast<float>(b[j] >> 4) * s + low);
    }
  }
}
#pragma GCC pop_options

template <typename T>
static void dequantize_int4_rows(const uint8_t* ps, const float* scales, const float* lows, T* out, int64_t N,
                                 int64_t K) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      dequantize_int4_row(ps + n * (K / 2), scales + n * G, lows + n * G, out + n * K, K);
    }
  });
}

torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                              bool bfloat16) {
  check_int4_weights(packed, scale, low);
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  auto out = torch::empty({N, K}, packed.options().dtype(bfloat16 ? torch::kBFloat16 : torch::kFloat32));
  const uint8_t* ps = packed.data_ptr<uint8_t>();
  if (bfloat16) {
    dequantize_int4_rows(ps, scale.data_ptr<float>(), low.data_ptr<float>(), cache_data<BFloat16>(out), N, K);
  } else {
    dequantize_int4_rows(ps, scale.data_ptr<float>(), low.data_ptr<float>(), out.data_ptr<float>(), N, K);
  }
  return out;
}

}  // namespace pdserve
