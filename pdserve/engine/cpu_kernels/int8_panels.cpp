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
// -> 10.2-12.4 ms (docs/benchmarks.md).
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
// broadcast x fit in the 16 vector registers. Six rows (12 accumulators) spilled to the stack;
// 6 x 16, 4 x 24, 3 x 32 and 2 x 32 all ran slower on two AMD EPYC (Zen 3) cores.
constexpr int kRows = 4;
constexpr int kVecs = 2;
constexpr int64_t kPanel = kVecs * 8;

// The 8 x 8 transpose of 32-bit elements: rows[i] holds element j of row i -> rows[j] holds
// element i of each.
inline void transpose8x8(__m256i rows[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    rows[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

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

// Asks for the next panel's weights while this one is multiplied: a decode step's matrices come
// from memory, not cache, and without this an 8-row product with the 49152 x 576 LM head read its
// weights at under 3 GB/s.
inline void prefetch_rows(const int8_t* begin, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(begin + offset);
}

// sums[r][c] += x[r] . panel column c over the pairs [p_begin, p_end), for kCount rows of x.
template <int kCount>
inline void multiply_rows(const int16_t* const* x, const int16_t* panel, int64_t p_begin, int64_t p_end,
                          float* sums) {
  __m256i lanes[kCount][kVecs];
  for (int r = 0; r < kCount; ++r)
    for (int v = 0; v < kVecs; ++v) lanes[r][v] = _mm256_setzero_si256();
  for (int64_t p = p_begin; p < p_end; ++p) {
    __m256i w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (p * kPanel + v * 8) * 2));
    for (int r = 0; r < kCount; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x[r] + 2 * p, sizeof(pair));
      const __m256i xv = _mm256_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) lanes[r][v] = _mm256_add_epi32(lanes[r][v], _mm256_madd_epi16(xv, w[v]));
    }
  }
  for (int r = 0; r < kCount; ++r) {
    alignas(32) float as_float[kPanel];
    for (int v = 0; v < kVecs; ++v) _mm256_store_ps(as_float + 8 * v, _mm256_cvtepi32_ps(lanes[r][v]));
    for (int c = 0; c < kPanel; ++c) sums[r * kPanel + c] += as_float[c];
  }
}

// Rows [m, m + count) of x (count <= kRows) against one packed panel, scaled and written to y.
template <int kCount = kRows>
void panel_rows(const int16_t* xq, const float* x_scales, const int16_t* panel, const float* scales, float* ys,
                int64_t m, int64_t count, int64_t n0, int64_t N, int64_t K) {
  if constexpr (kCount > 1) {
    if (count < kCount) return panel_rows<kCount - 1>(xq, x_scales, panel, scales, ys, m, count, n0, N, K);
  }
  const int16_t* x[kCount];
  for (int r = 0; r < kCount; ++r) x[r] = xq + (m + r) * K;
  float sums[kCount * kPanel] = {};
  for (int64_t p = 0; p < K / 2; p += kPairsPerChunk) {
    multiply_rows<kCount>(x, panel, p, std::min(K / 2, p + kPairsPerChunk), sums);
  }
  const int64_t outputs = std::min(kPanel, N - n0);
  for (int r = 0; r < kCount; ++r) {
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
