// int8 weights against many rows of x (prefill chunks, larger decode batches) in integers, on AVX2:
// an outer-product kernel in the shape of a BLAS micro-kernel.
//
// The dot-product loops of quantized_gemv.cpp reduce each (row of x, row of W) pair along K, so
// every weight row reloads the rows of x; with x blocked in L2 those loads, not the multiplies,
// bounded them (~45 GMAC/s on two AMD EPYC cores, float32's rate). Here 16 weight rows are
// widened to int16 once into a panel laid out k-pair by k-pair,
//
//   panel[p][c][j] = q[n0 + c][2p + j]      (p: pair of inputs, c: one of 16 outputs, j: 0 or 1)
//
// so one 256-bit load holds 8 outputs' weights for inputs 2p and 2p + 1. A pair of int16 inputs
// of one row of x, broadcast to every 32-bit lane, multiplies it with vpmaddwd into 8 int32
// partial sums at once: four rows of x against the 16 outputs keep 8 accumulators in registers,
// and each loaded vector feeds four (weights) or two (x) multiply-adds. The panel (K x 16 int16,
// 18 KiB at K = 576) stays in L1 while every row of x passes over it. Packing is vectorized too
// (widen, then an 8 x 8 transpose), and the next panel's weights are prefetched.
// A layer's four int8 products for a 210-token prefill on two AMD EPYC (Zen 3) cores: 14.5 ms
// -> 10.2-12.4 ms (docs/benchmarks.md); with the accumulators kept in registers, 1.4-1.5x less
// again from 16 rows to 208.
//
// Overflow: |x| <= 16383 (rows rounded by quantized_gemv.cpp), |q| <= 127, so a lane gains at
// most 2 * 16383 * 127 per pair of inputs and could overflow only past 516 pairs: the lanes go to
// float every kPairsPerChunk pairs.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace pdserve {

#if defined(__AVX2__)

namespace {

constexpr int64_t kPairsPerChunk = 512;
// Four rows of x by 16 outputs (two vectors of 8 lanes): 8 accumulators, 2 weight vectors and the
// four broadcast pairs of x fit in the 16 vector registers. Six rows (12 accumulators) spilled to the stack;
// 6 x 16, 4 x 24, 3 x 32 and 2 x 32 all ran slower on two AMD EPYC (Zen 3) cores.
constexpr int kRows = 4;
constexpr int kVecs = 2;
constexpr int64_t kPanel = kVecs * 8;

// Widens weight rows [n0, n0 + 16) into `panel`, eight rows by eight pairs of inputs at a time:
// each row's 16 int8 widen to 8 int16 pairs (32-bit elements), and a transpose turns 8 rows of
// pairs into 8 pairs of rows. Rows past N read `zeros` (their outputs are dropped). K % 16 == 0.
void pack_panel(const int8_t* qs, const int8_t* zeros, int64_t n0, int64_t N, int64_t K, int16_t* panel) {
  for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
    const int8_t* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = n0 + c0 + i < N ? qs + (n0 + c0 + i) * K : zeros;
    for (int64_t k = 0; k < K; k += 16) {
      __m256i block[8];
      for (int i = 0; i < 8; ++i) {
        block[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + k)));
      }
      transpose8x8(block);
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((k / 2 + j) * kPanel + c0) * 2), block[j]);
      }
    }
  }
}

inline __m256i broadcast_pair(const int16_t* x) {
  int32_t pair;
  __builtin_memcpy(&pair, x, sizeof(pair));
  return _mm256_set1_epi32(pair);
}

inline __m256i multiply_add(__m256i acc, __m256i x, __m256i w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }

// sums[r][c] += x[r] . panel column c over the pairs [p_begin, p_end), for the four rows of x
// (a smaller count repeats row 0; the caller drops those sums). Named accumulators, not an array.
inline void multiply_rows(const int16_t* const* x, const int16_t* panel, int64_t p_begin, int64_t p_end, float* sums) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
  for (int64_t p = p_begin; p < p_end; ++p) {
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + p * kPanel * 2));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + p * kPanel * 2 + 16));
    in_register(w0);
    in_register(w1);
    const __m256i x0 = broadcast_pair(x[0] + 2 * p), x1 = broadcast_pair(x[1] + 2 * p);
    const __m256i x2 = broadcast_pair(x[2] + 2 * p), x3 = broadcast_pair(x[3] + 2 * p);
    a0 = multiply_add(a0, x0, w0);
    a1 = multiply_add(a1, x0, w1);
    b0 = multiply_add(b0, x1, w0);
    b1 = multiply_add(b1, x1, w1);
    c0 = multiply_add(c0, x2, w0);
    c1 = multiply_add(c1, x2, w1);
    d0 = multiply_add(d0, x3, w0);
    d1 = multiply_add(d1, x3, w1);
  }
  const __m256i lanes[kRows][kVecs] = {{a0, a1}, {b0, b1}, {c0, c1}, {d0, d1}};
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      const __m256 partial = _mm256_add_ps(_mm256_loadu_ps(sums + r * kPanel + 8 * v), _mm256_cvtepi32_ps(lanes[r][v]));
      _mm256_storeu_ps(sums + r * kPanel + 8 * v, partial);
    }
  }
}

// Rows [m, m + count) of x (count <= kRows) against one packed panel, scaled and written to y.
void panel_rows(const int16_t* xq, const float* x_scales, const int16_t* panel, const float* scales, float* ys,
                int64_t m, int64_t count, int64_t n0, int64_t N, int64_t K) {
  const int16_t* x[kRows];
  for (int r = 0; r < kRows; ++r) x[r] = xq + (m + (r < count ? r : 0)) * K;
  alignas(32) float sums[kRows * kPanel] = {};
  for (int64_t p = 0; p < K / 2; p += kPairsPerChunk) {
    multiply_rows(x, panel, p, std::min(K / 2, p + kPairsPerChunk), sums);
  }
  const int64_t outputs = std::min(kPanel, N - n0);
  for (int r = 0; r < count; ++r) {
    float* y = ys + (m + r) * N + n0;
    for (int64_t c = 0; c < outputs; ++c) y[c] = sums[r * kPanel + c] * x_scales[m + r] * scales[n0 + c];
  }
}

}  // namespace

bool int8_linear_panels(const int16_t* xq, const float* x_scales, const int8_t* qs, const float* scales, float* ys,
                        int64_t M, int64_t N, int64_t K) {
  if (K % 16 != 0) return false;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> panel(K * kPanel);
    const std::vector<int8_t> zeros(K, 0);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t n0 = index * kPanel;
      pack_panel(qs, zeros.data(), n0, N, K, panel.data());
      // The next panel's weights, while this one multiplies: without this an 8-row product with
      // the 49152 x 576 LM head read its weights at under 3 GB/s.
      if (index + 1 < end) prefetch_rows(qs + (n0 + kPanel) * K, std::min(kPanel, N - n0 - kPanel) * K);
      for (int64_t m = 0; m < M; m += kRows) {
        panel_rows(xq, x_scales, panel.data(), scales, ys, m, std::min<int64_t>(kRows, M - m), n0, N, K);
      }
    }
  });
  return true;
}

#else

bool int8_linear_panels(const int16_t*, const float*, const int8_t*, const float*, float*, int64_t, int64_t, int64_t) {
  return false;  // no AVX2: quantized_gemv.cpp's other loops serve
}

#endif

}  // namespace pdserve
