// int4 weights against decode batches of 16 rows of x and more, in integers, on AVX512-VNNI: the
// outer-product kernel of int8_panels.cpp, with one scale per group of 32 inputs.
//
// quantized_gemv.cpp's loops reduce each (row of x, weight row) pair along K, so every group of
// every such pair converts its int32 sums to float and takes its scale: about twice int8's work
// per weight, and a batch of 32 took 73 ms of a step's products against int8's 26. Here 16 weight
// rows are widened to int16 once into a panel laid out pair of inputs by pair of inputs,
//
//   panel[g][p][c][j] = q[n0 + c][32g + 2p + j]     (g: group, p: pair in it, c: one of 16 outputs)
//
// so one 512-bit load holds the 16 outputs' weights for two inputs, which a broadcast pair of
// int16 inputs of one row of x multiplies and adds into 16 int32 lanes (vpdpwssd): one lane per
// output. After a group's 16 pairs, each row's lanes go to float once, for the 16 outputs
// together: times the group's scales (packed beside the panel), plus the group's lows times the
// row's integer sum over the group. Four rows of x at a time keep 8 accumulators in registers.
//
// Overflow: |x| <= 16383 and q <= 15, so a lane sums at most 32 * 15 * 16383 per group: exact.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace pdserve {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kPairs = kGroup / 2;
constexpr int64_t kPanel = 16;  // outputs per panel: one int32 lane each
constexpr int kRows = 4;

// The 16 x 16 transpose of 32-bit elements: rows[i] holds element j of row i -> rows[j] holds
// element i of each.
inline void transpose16x16(__m512i rows[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // within each 128-bit lane: 4 x 4 done
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // the 128-bit lanes: a 4 x 4 transpose of them
    t[i] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    rows[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    rows[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// One group's 32 nibbles as int16 in input order: the 16 low nibbles (inputs 0..15), then the 16
// high ones (16..31); as 32-bit elements, pair p of the group is element p.
inline __m512i widen_group(const uint8_t* bytes) {
  const __m256i lanes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i mask = _mm256_set1_epi16(15);
  const __m256i low = _mm256_and_si256(lanes, mask), high = _mm256_and_si256(_mm256_srli_epi16(lanes, 4), mask);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// Weight rows [n0, n0 + 16) into `panel` (G x 16 pairs x 16 outputs) and their scales and lows
// into `panel_scales` and `panel_lows` (G x 16); rows past N are zeros (their outputs are dropped).
void pack_panel(const uint8_t* ps, const float* scales, const float* lows, int64_t n0, int64_t N, int64_t K,
                int16_t* panel, float* panel_scales, float* panel_lows) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  for (int64_t g = 0; g < G; ++g) {
    __m512i rows[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      const bool real = n0 + c < N;
      rows[c] = real ? widen_group(ps + (n0 + c) * row_bytes + g * kPairs) : _mm512_setzero_si512();
      panel_scales[g * kPanel + c] = real ? scales[(n0 + c) * G + g] : 0.f;
      panel_lows[g * kPanel + c] = real ? lows[(n0 + c) * G + g] : 0.f;
    }
    transpose16x16(rows);
    for (int64_t p = 0; p < kPairs; ++p) _mm512_storeu_si512(panel + (g * kPairs + p) * kPanel * 2, rows[p]);
  }
}

inline __m512i broadcast_pair(const int16_t* x) {
  int32_t pair;
  __builtin_memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// Rows [m, m + count) of x (count <= 4; a smaller count repeats row m, whose sums are dropped)
// against one panel: y[m + r][n0 .. n0 + 16) for the outputs below N.
void panel_rows(const int16_t* xq, const float* x_scales, const float* x_sums, const int16_t* panel,
                const float* panel_scales, const float* panel_lows, float* ys, int64_t m, int64_t count, int64_t n0,
                int64_t N, int64_t K) {
  const int64_t G = K / kGroup;
  const int64_t r1 = count > 1 ? 1 : 0, r2 = count > 2 ? 2 : 0, r3 = count > 3 ? 3 : 0;
  const int16_t *x0 = xq + m * K, *x1 = xq + (m + r1) * K, *x2 = xq + (m + r2) * K, *x3 = xq + (m + r3) * K;
  const float *s0 = x_sums + m * G, *s1 = x_sums + (m + r1) * G, *s2 = x_sums + (m + r2) * G,
              *s3 = x_sums + (m + r3) * G;
  __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
  for (int64_t g = 0; g < G; ++g) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const int16_t* group = panel + g * kPairs * kPanel * 2;
    const int64_t k = g * kGroup;
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512i w = _mm512_loadu_si512(group + p * kPanel * 2);
      in_register(w);
      a0 = _mm512_dpwssd_epi32(a0, broadcast_pair(x0 + k + 2 * p), w);
      a1 = _mm512_dpwssd_epi32(a1, broadcast_pair(x1 + k + 2 * p), w);
      a2 = _mm512_dpwssd_epi32(a2, broadcast_pair(x2 + k + 2 * p), w);
      a3 = _mm512_dpwssd_epi32(a3, broadcast_pair(x3 + k + 2 * p), w);
    }
    const __m512 scale = _mm512_loadu_ps(panel_scales + g * kPanel), low = _mm512_loadu_ps(panel_lows + g * kPanel);
    f0 = _mm512_fmadd_ps(low, _mm512_set1_ps(s0[g]), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), scale, f0));
    f1 = _mm512_fmadd_ps(low, _mm512_set1_ps(s1[g]), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), scale, f1));
    f2 = _mm512_fmadd_ps(low, _mm512_set1_ps(s2[g]), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), scale, f2));
    f3 = _mm512_fmadd_ps(low, _mm512_set1_ps(s3[g]), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a3), scale, f3));
  }
  const __mmask16 outputs = N - n0 >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  const __m512 results[kRows] = {f0, f1, f2, f3};
  for (int64_t r = 0; r < count; ++r) {
    const __m512 y = _mm512_mul_ps(results[r], _mm512_set1_ps(x_scales[m + r]));
    _mm512_mask_storeu_ps(ys + (m + r) * N + n0, outputs, y);
  }
}

}  // namespace

bool int4_linear_panels(const int16_t* xq, const float* x_scales, const float* x_sums, const uint8_t* ps,
                        const float* scales, const float* lows, float* ys, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / kGroup, num_panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> panel(K * kPanel);
    std::vector<float> panel_scales(G * kPanel), panel_lows(G * kPanel);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t n0 = index * kPanel;
      pack_panel(ps, scales, lows, n0, N, K, panel.data(), panel_scales.data(), panel_lows.data());
      // The next panel's weights, while this one multiplies.
      if (index + 1 < end) prefetch_rows(ps + (n0 + kPanel) * (K / 2), std::min(kPanel, N - n0 - kPanel) * (K / 2));
      for (int64_t m = 0; m < M; m += kRows) {
        panel_rows(xq, x_scales, x_sums, panel.data(), panel_scales.data(), panel_lows.data(), ys, m,
                   std::min<int64_t>(kRows, M - m), n0, N, K);
      }
    }
  });
  return true;
}

#else

bool int4_linear_panels(const int16_t*, const float*, const float*, const uint8_t*, const float*, const float*, float*,
                        int64_t, int64_t, int64_t) {
  return false;  // no AVX512-VNNI: quantized_gemv.cpp's loops serve
}

#endif

}  // namespace pdserve
