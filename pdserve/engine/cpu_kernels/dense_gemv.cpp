// Float32 weights against a few rows of x (float32 decode steps): y = x @ W.T, W streamed once.
//
// torch's at::linear sends one row of x to MKL's sgemv, which on an AMD EPYC (Zen 5, 2 cores)
// streamed a 576 x 49152 LM head at 11 GB/s, with two threads no faster than one, against the
// 38.5 GB/s the machine reads: a float32 decode step took 40.8 ms against a 14.1 ms weight floor
// (docs/benchmarks.md, "fourteenth pass"). Here each thread takes a range of output rows, four
// weight rows at a time, with the rows ahead prefetched, and each loaded vector of x feeds four
// fused multiply-adds.
//
// Every output is the same sum in the same order whatever the batch and the thread count (lanes
// of one vector width along K, the tail masked, then the lanes' sum), so a sequence's logits do
// not change with what it is batched with. That order is not MKL's, so results differ from
// at::linear's by rounding (~1e-6 relative): DESIGN.md's near-tie rule covers greedy outputs.
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
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
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
inline float vsum(Vec v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
#else
constexpr int64_t kWidth = 0;  // no vector path: at::linear serves
#endif

// Rows of x up to this many go through these loops; more go to at::linear, whose blocked GEMM
// reuses each loaded weight across rows of x in registers, which a dot-product loop cannot.
constexpr int64_t kMaxRows = 8;
// Weight rows asked for ahead of use: float32 rows are 4x int8's bytes, so fewer rows cover the
// same distance in bytes as quantized_gemv.cpp's 8.
constexpr int64_t kPrefetchRows = 4;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Four weight rows against one row of x: four chains share each load of x.
inline void dot_rows4(const float* x, const float* const* w, int64_t K, float* out) {
  Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t k = 0;
  for (; k + kWidth <= K; k += kWidth) {
    Vec xv = vload(x + k);
    in_register(xv);
    a0 = vfma(vload(w[0] + k), xv, a0);
    a1 = vfma(vload(w[1] + k), xv, a1);
    a2 = vfma(vload(w[2] + k), xv, a2);
    a3 = vfma(vload(w[3] + k), xv, a3);
  }
  if (k < K) {
    const Mask mask = tail_mask(K - k);
    const Vec xv = vload_tail(x + k, mask);
    a0 = vfma(vload_tail(w[0] + k, mask), xv, a0);
    a1 = vfma(vload_tail(w[1] + k, mask), xv, a1);
    a2 = vfma(vload_tail(w[2] + k, mask), xv, a2);
    a3 = vfma(vload_tail(w[3] + k, mask), xv, a3);
  }
  out[0] = vsum(a0);
  out[1] = vsum(a1);
  out[2] = vsum(a2);
  out[3] = vsum(a3);
}

// Output rows [begin, end) for every row of x: four weight rows at a time (a tail of fewer
// repeats its last row), each group read from memory once and from L1 by the later rows of x.
void dense_rows(const float* xs, const float* ws, float* ys, int64_t M, int64_t N, int64_t K, int64_t begin,
                int64_t end) {
  for (int64_t n = begin; n < end; n += 4) {
    const int64_t count = std::min<int64_t>(4, end - n);
    if (n + 4 + kPrefetchRows <= end) prefetch_rows(ws + (n + kPrefetchRows) * K, 4 * K * 4);
    const float* rows[4];
    for (int i = 0; i < 4; ++i) rows[i] = ws + (n + std::min<int64_t>(i, count - 1)) * K;
    for (int64_t m = 0; m < M; ++m) {
      float dots[4];
      dot_rows4(xs + m * K, rows, K, dots);
      for (int64_t i = 0; i < count; ++i) ys[m * N + n + i] = dots[i];
    }
  }
}
#endif

}  // namespace

torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  const bool ours = kWidth > 0 && x.dim() == 2 && x.size(0) <= kMaxRows && x.scalar_type() == torch::kFloat32 &&
                    weight.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.is_contiguous() &&
                    weight.dim() == 2 && x.size(1) == weight.size(1) && x.device().is_cpu();
  if (!ours) return at::linear(x, weight);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { dense_rows(xs, ws, ys, M, N, K, begin, end); });
  return y;
#else
  return at::linear(x, weight);
#endif
}

}  // namespace pdserve
