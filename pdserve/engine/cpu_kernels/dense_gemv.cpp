// Float32 weights against rows of x: y = x @ W.T (float32 decode steps and prefill chunks).
//
// torch's at::linear sends float32 products to MKL, whose kernels on an AMD EPYC (Zen 5, 2 cores)
// are its AVX2 "zen" ones: one row of x streamed a 576 x 49152 LM head at 11 GB/s, with two
// threads no faster than one, against the 38.5 GB/s the machine reads (a float32 decode step took
// 40.8 ms against a 14.1 ms weight floor), and 32 to 256 rows ran 140-215 GFLOP/s
// (docs/benchmarks.md, "fourteenth pass"). Here each thread takes a range of output rows, four
// weight rows at a time, with the rows ahead prefetched, and passes every row of x over them in
// tiles: a tile of 4 rows of x against the 4 weight rows keeps 16 accumulators in registers, so
// each loaded vector feeds four fused multiply-adds (x) or one per row of the tile (weights).
// That ran 1.3-2.1x MKL's rate from 4 rows to 256 on that machine (230-340 GFLOP/s).
//
// Every output is the same sum in the same order whatever the batch, its tiling and the thread
// count (lanes of one vector width along K, the tail masked, then the lanes' sum), so a
// sequence's logits do not change with what it is batched with. That order is not MKL's, so
// results differ from at::linear's by rounding (~1e-6 relative): DESIGN.md's near-tie rule
// covers greedy outputs.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace pdserve {

namespace {

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using Vec = __m512;
using Mask = __mmask16;
inline Mask tail_mask(int64_t left) { return static_cast<Mask>((1u << left) - 1); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload_tail(const float* p, Mask mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return _mm512_fmadd_ps(a, b, acc); }
// The lane sums of four vectors at once, each summed in the order of gcc's _mm512_reduce_add_ps
// (lanes i and i + 8, then i and i + 4, then i and i + 2, then 0 and 1), with a quarter of its
// shuffles: one sum per vector cost a fifth of a tile's instructions at K = 576.
inline void vsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const Vec ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const Vec cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const Vec quarters = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const Vec pairs = _mm512_add_ps(quarters, _mm512_permute_ps(quarters, 0x4E));
  const Vec sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sums);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using Vec = __m256;
using Mask = __m256i;
inline Mask tail_mask(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload_tail(const float* p, Mask mask) { return _mm256_maskload_ps(p, mask); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
// The lane sums of four vectors at once, each in one order (lanes i and i + 4, then i and i + 2,
// then 0 and 1).
inline void vsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const Vec ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const Vec cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  const Vec pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
  const Vec sums = _mm256_add_ps(pairs, _mm256_shuffle_ps(pairs, pairs, 0xB1));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[2], out[3] = lanes[6];
}
#else
constexpr int64_t kWidth = 0;  // no vector path: at::linear serves
#endif

// Rows of x per pass over the weights: a block's rows (144 KiB at K = 576, 384 KiB at 1536) stay
// in L2 while every group of four weight rows passes over them from L1.
constexpr int64_t kBlockRows = 64;
// Rows of x that share each loaded vector of weights: 4 x 4 accumulators, four weight vectors
// and one of x take 21 of AVX-512's 32 registers; AVX2's 16 hold 2 x 4 (13).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 4;
#else
constexpr int64_t kTileRows = 2;
#endif
// Weight rows asked for ahead of use by batches, which compute long enough on each group of four
// rows for L1 to hold the next groups. Batch 1 only streams the rows by: dense_row_stream.
constexpr int64_t kPrefetchRows = 4;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// R rows of x against four weight rows: R x 4 chains, each loaded vector of x feeding four fused
// multiply-adds and each vector of weights R. Every chain is one output's sum in one fixed order
// (vector lanes along K, the tail masked, then the lanes' sum), whatever R is.
template <int R>
inline void dot_tile(const float* const* x, const float* const* w, int64_t K, float* out) {
  Vec acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = vzero();
  int64_t k = 0;
  for (; k + kWidth <= K; k += kWidth) {
    Vec w0 = vload(w[0] + k), w1 = vload(w[1] + k), w2 = vload(w[2] + k), w3 = vload(w[3] + k);
    in_register(w0);
    in_register(w1);
    in_register(w2);
    in_register(w3);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x[r] + k);
      acc[r][0] = vfma(w0, xv, acc[r][0]);
      acc[r][1] = vfma(w1, xv, acc[r][1]);
      acc[r][2] = vfma(w2, xv, acc[r][2]);
      acc[r][3] = vfma(w3, xv, acc[r][3]);
    }
  }
  if (k < K) {
    const Mask mask = tail_mask(K - k);
    const Vec w0 = vload_tail(w[0] + k, mask), w1 = vload_tail(w[1] + k, mask);
    const Vec w2 = vload_tail(w[2] + k, mask), w3 = vload_tail(w[3] + k, mask);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload_tail(x[r] + k, mask);
      acc[r][0] = vfma(w0, xv, acc[r][0]);
      acc[r][1] = vfma(w1, xv, acc[r][1]);
      acc[r][2] = vfma(w2, xv, acc[r][2]);
      acc[r][3] = vfma(w3, xv, acc[r][3]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) vsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], out + r * 4);
}

// Rows [m, m + count) of x against four weight rows, count <= kTileRows.
inline void dot_rows(const float* const* x, int64_t count, const float* const* w, int64_t K, float* out) {
  switch (count) {
    case 1: return dot_tile<1>(x, w, K, out);
    case 2: return dot_tile<2>(x, w, K, out);
#if defined(__AVX512F__)
    case 3: return dot_tile<3>(x, w, K, out);
    case 4: return dot_tile<4>(x, w, K, out);
#endif
  }
}

// Batch 1: weight rows one after another, no software prefetch, each row in one chain of
// multiply-adds summed as dot_tile sums it, so the same sums as a batch. Against four rows side by
// side with a 16 KB prefetch to L2, a float32 step took 10.9-12.0 ms against 16.4-16.6 on two Zen 4
// cores (memory at 59-64 GB/s), and 24.2-25.5 against 26.2-27.6 on two Xeon cores (26 GB/s), where a
// prefetch 4-32 KB ahead of the rows gained nothing (docs/benchmarks.md, twenty-first and
// twenty-second passes). Unlike int8's (quantized_gemv.cpp), on both vendors.
void dense_row_stream(const float* x, const float* ws, float* ys, int64_t K, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* w = ws + n * K;
    Vec acc = vzero();
    int64_t k = 0;
    for (; k + kWidth <= K; k += kWidth) acc = vfma(vload(w + k), vload(x + k), acc);
    if (k < K) {
      const Mask mask = tail_mask(K - k);
      acc = vfma(vload_tail(w + k, mask), vload_tail(x + k, mask), acc);
    }
    float sums[4];
    vsum4(acc, acc, acc, acc, sums);
    ys[n] = sums[0];
  }
}

// Output rows [begin, end) for every row of x: four weight rows at a time (a tail of fewer
// repeats its last row), each group read from memory once and from L1 by every tile of x rows.
void dense_rows(const float* xs, const float* ws, float* ys, int64_t M, int64_t N, int64_t K, int64_t begin,
                int64_t end) {
  if (M == 1) return dense_row_stream(xs, ws, ys, K, begin, end);
  for (int64_t n = begin; n < end; n += 4) {
    const int64_t count = std::min<int64_t>(4, end - n);
    if (n + 4 + kPrefetchRows <= end) prefetch_rows(ws + (n + kPrefetchRows) * K, 4 * K * 4);
    const float* rows[4];
    for (int i = 0; i < 4; ++i) rows[i] = ws + (n + std::min<int64_t>(i, count - 1)) * K;
    for (int64_t m = 0; m < M; m += kTileRows) {
      const int64_t tile = std::min(kTileRows, M - m);
      const float* x[kTileRows];
      for (int64_t r = 0; r < tile; ++r) x[r] = xs + (m + r) * K;
      float dots[kTileRows * 4];
      dot_rows(x, tile, rows, K, dots);
      for (int64_t r = 0; r < tile; ++r) {
        for (int64_t i = 0; i < count; ++i) ys[(m + r) * N + n + i] = dots[r * 4 + i];
      }
    }
  }
}
#endif

}  // namespace

torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  const bool ours = kWidth > 0 && x.dim() == 2 && x.scalar_type() == torch::kFloat32 &&
                    weight.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.is_contiguous() &&
                    weight.dim() == 2 && x.size(1) == weight.size(1) && x.device().is_cpu();
  if (!ours) return at::linear(x, weight);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, M - m);
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      dense_rows(xs + m * K, ws, ys + m * N, rows, N, K, begin, end);
    });
  }
  return y;
#else
  return at::linear(x, weight);
#endif
}

}  // namespace pdserve
