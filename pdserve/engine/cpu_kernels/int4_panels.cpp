// int4 weights against decode batches of 16 rows of x and more, in integers: the outer-product
// kernel of int8_panels.cpp, with one scale per group of 32 inputs.
//
// quantized_gemv.cpp's loops reduce each (row of x, weight row) pair along K, so every group of
// every such pair converts its int32 sums to float and takes its scale: about twice int8's work
// per weight, and a batch of 32 took 73 ms of a step's products against int8's 26 (Xeon, 2
// cores). Here a panel of weight rows (16 on AVX512-VNNI, 8 on AVX2) is widened to int16 once,
// laid out pair of inputs by pair of inputs,
//
//   panel[g][p][c][j] = q[n0 + c][32g + 2p + j]     (g: group, p: pair in it, c: an output)
//
// so one vector load holds the panel's weights for two inputs, which a broadcast pair of int16
// inputs of one row of x multiplies and adds into int32 lanes (vpdpwssd, or vpmaddwd and vpaddd):
// one lane per output. After a group's 16 pairs, each row's lanes go to float once, for the whole
// panel: times the group's scales (packed beside the panel), plus the group's lows times the
// row's integer sum over the group. Four rows of x at a time keep 8 accumulators in registers.
//
// Overflow: |x| <= 16383 and q <= 15, so a lane sums at most 32 * 15 * 16383 per group: exact.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace pdserve {

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kPairs = kGroup / 2;
constexpr int kRows = 4;

// Per instruction set: the panel's width (kPanel outputs, one int32 lane each), its vectors, the
// pairwise multiply-add, the packing of one group of a panel's rows, and the (masked) store.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kPanels = true;
constexpr int64_t kPanel = 16;
using IVec = __m512i;
using FVec = __m512;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec load(const int16_t* p) { return _mm512_loadu_si512(p); }
inline IVec broadcast_pair(const int16_t* x) {
  int32_t pair;
  __builtin_memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}
inline IVec multiply_add(IVec acc, IVec x, IVec w) { return _mm512_dpwssd_epi32(acc, x, w); }
inline FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec fload(const float* p) { return _mm512_loadu_ps(p); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec broadcast(float v) { return _mm512_set1_ps(v); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline void store_outputs(float* y, FVec v, int64_t count) {
  _mm512_mask_storeu_ps(y, count >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1), v);
}

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

// One group of 16 weight rows (rows[c] its 16 bytes, or null past N) as 16 vectors, pair p's.
inline void pack_group(const uint8_t* const* rows, int16_t* out) {
  const __m256i mask = _mm256_set1_epi16(15);
  __m512i block[kPanel];
  for (int64_t c = 0; c < kPanel; ++c) {
    if (rows[c] == nullptr) {
      block[c] = _mm512_setzero_si512();
      continue;
    }
    // The 32 nibbles in input order: the 16 low ones (inputs 0..15), then the high ones.
    const __m256i lanes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c])));
    const __m256i low = _mm256_and_si256(lanes, mask), high = _mm256_and_si256(_mm256_srli_epi16(lanes, 4), mask);
    block[c] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  transpose16x16(block);
  for (int64_t p = 0; p < kPairs; ++p) _mm512_storeu_si512(out + p * kPanel * 2, block[p]);
}
#elif defined(__AVX2__)
constexpr bool kPanels = true;
constexpr int64_t kPanel = 8;
using IVec = __m256i;
using FVec = __m256;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec broadcast_pair(const int16_t* x) {
  int32_t pair;
  __builtin_memcpy(&pair, x, sizeof(pair));
  return _mm256_set1_epi32(pair);
}
inline IVec multiply_add(IVec acc, IVec x, IVec w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec broadcast(float v) { return _mm256_set1_ps(v); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline void store_outputs(float* y, FVec v, int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes), v);
}

// One group of 8 weight rows (rows[c] its 16 bytes, or null past N) as 16 vectors, pair p's:
// each row's low nibbles are pairs 0..7, its high ones pairs 8..15, each half an 8 x 8 transpose.
inline void pack_group(const uint8_t* const* rows, int16_t* out) {
  const __m128i mask = _mm_set1_epi8(15);
  __m256i low[kPanel], high[kPanel];
  for (int64_t c = 0; c < kPanel; ++c) {
    if (rows[c] == nullptr) {
      low[c] = high[c] = _mm256_setzero_si256();
      continue;
    }
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c]));
    low[c] = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
    high[c] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  }
  transpose8x8(low);
  transpose8x8(high);
  for (int64_t p = 0; p < 8; ++p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * kPanel * 2), low[p]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 8) * kPanel * 2), high[p]);
  }
}
#else
constexpr bool kPanels = false;  // no AVX2: quantized_gemv.cpp's loops serve
constexpr int64_t kPanel = 8;
using IVec = int;  // never used: int4_linear_panels returns before any of these runs
using FVec = float;
inline IVec izero() { return 0; }
inline IVec load(const int16_t*) { return 0; }
inline IVec broadcast_pair(const int16_t*) { return 0; }
inline IVec multiply_add(IVec, IVec, IVec) { return 0; }
inline FVec to_float(IVec) { return 0.f; }
inline FVec fload(const float*) { return 0.f; }
inline FVec fzero() { return 0.f; }
inline FVec broadcast(float) { return 0.f; }
inline FVec fmadd(FVec, FVec, FVec) { return 0.f; }
inline FVec fmul(FVec, FVec) { return 0.f; }
inline void store_outputs(float*, FVec, int64_t) {}
inline void pack_group(const uint8_t* const*, int16_t*) {}
#endif

// Weight rows [n0, n0 + kPanel) into `panel` (G x 16 pairs x kPanel outputs) and their scales
// and lows into `panel_scales` and `panel_lows` (G x kPanel); rows past N are zeros (their
// outputs are dropped).
void pack_panel(const uint8_t* ps, const float* scales, const float* lows, int64_t n0, int64_t N, int64_t K,
                int16_t* panel, float* panel_scales, float* panel_lows) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rows[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      const bool real = n0 + c < N;
      rows[c] = real ? ps + (n0 + c) * row_bytes + g * kPairs : nullptr;
      panel_scales[g * kPanel + c] = real ? scales[(n0 + c) * G + g] : 0.f;
      panel_lows[g * kPanel + c] = real ? lows[(n0 + c) * G + g] : 0.f;
    }
    pack_group(rows, panel + g * kPairs * kPanel * 2);
  }
}

// Rows [m, m + count) of x (count <= 4; a smaller count repeats row m, whose sums are dropped)
// against one panel: y[m + r][n0 .. n0 + kPanel) for the outputs below N.
void panel_rows(const int16_t* xq, const float* x_scales, const float* x_sums, const int16_t* panel,
                const float* panel_scales, const float* panel_lows, float* ys, int64_t m, int64_t count, int64_t n0,
                int64_t N, int64_t K) {
  const int64_t G = K / kGroup;
  const int64_t r1 = count > 1 ? 1 : 0, r2 = count > 2 ? 2 : 0, r3 = count > 3 ? 3 : 0;
  const int16_t *x0 = xq + m * K, *x1 = xq + (m + r1) * K, *x2 = xq + (m + r2) * K, *x3 = xq + (m + r3) * K;
  const float *s0 = x_sums + m * G, *s1 = x_sums + (m + r1) * G, *s2 = x_sums + (m + r2) * G,
              *s3 = x_sums + (m + r3) * G;
  FVec f0 = fzero(), f1 = f0, f2 = f0, f3 = f0;
  for (int64_t g = 0; g < G; ++g) {
    IVec a0 = izero(), a1 = a0, a2 = a0, a3 = a0;
    const int16_t* group = panel + g * kPairs * kPanel * 2;
    const int64_t k = g * kGroup;
    for (int64_t p = 0; p < kPairs; ++p) {
      IVec w = load(group + p * kPanel * 2);
      in_register(w);
      a0 = multiply_add(a0, broadcast_pair(x0 + k + 2 * p), w);
      a1 = multiply_add(a1, broadcast_pair(x1 + k + 2 * p), w);
      a2 = multiply_add(a2, broadcast_pair(x2 + k + 2 * p), w);
      a3 = multiply_add(a3, broadcast_pair(x3 + k + 2 * p), w);
    }
    const FVec scale = fload(panel_scales + g * kPanel), low = fload(panel_lows + g * kPanel);
    f0 = fmadd(low, broadcast(s0[g]), fmadd(to_float(a0), scale, f0));
    f1 = fmadd(low, broadcast(s1[g]), fmadd(to_float(a1), scale, f1));
    f2 = fmadd(low, broadcast(s2[g]), fmadd(to_float(a2), scale, f2));
    f3 = fmadd(low, broadcast(s3[g]), fmadd(to_float(a3), scale, f3));
  }
  const FVec results[kRows] = {f0, f1, f2, f3};
  for (int64_t r = 0; r < count; ++r) {
    store_outputs(ys + (m + r) * N + n0, fmul(results[r], broadcast(x_scales[m + r])), N - n0);
  }
}

}  // namespace

bool int4_linear_panels(const int16_t* xq, const float* x_scales, const float* x_sums, const uint8_t* ps,
                        const float* scales, const float* lows, float* ys, int64_t M, int64_t N, int64_t K) {
  if (!kPanels) return false;
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

}  // namespace pdserve
