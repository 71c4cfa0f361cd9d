// The kernels each source defines and the others (and the Python bindings) call.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pdserve {

// Where prefetch_rows brings weight rows (__builtin_prefetch's locality). The batch-1 integer int8
// loop only streams the rows by: to L2 (prefetcht1), since on two Xeon cores prefetcht0 held a batch-1 int8
// step at 7.7 ms and prefetcht1 gave 6.4-6.9 (cold GEMVs 17-20 -> 19-24 GB/s; prefetchnta: 14 ms).
// The loops that compute long on each row (batches, int4, the float fallbacks) keep L1: the LM
// head at 32 rows ran 15-20% faster so, and int4 at batch 1 showed no difference
// (docs/benchmarks.md, "Intel Xeon, sixth pass").
enum class PrefetchTo : int { kL2 = 2, kL1 = 3 };

// Whether the batch-1 int8 loops leave their weight stream to the hardware prefetchers, with no
// software prefetch ahead of the rows. Set once when the module loads (cpu_kernels/__init__.py: by
// default on AMD CPUs with AVX-512, where with the weights on huge pages Zen 4's prefetchers alone
// read the rows at a plain sum's speed and the prefetch held them to ~70% of it). Elsewhere the loops
// prefetch: on two Xeon cores a batch-1 int8 step took 5.7-6.7 ms with it and 8.1-8.4 without, and
// on an AVX2-only Zen 3 0.93x as long as without (docs/benchmarks.md, twenty-first, twenty-second
// and twenty-fifth passes). The float32 batch-1 rows stream without it everywhere.
inline bool g_hardware_prefetch = false;
inline bool hardware_prefetch_suffices() { return g_hardware_prefetch; }

// Asks for `bytes` from `begin` ahead of use: the weights of a step come from memory, not cache.
template <PrefetchTo kTo = PrefetchTo::kL1>
inline void prefetch_rows(const void* begin, int64_t bytes) {
  const char* bytes_begin = static_cast<const char*>(begin);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(bytes_begin + offset, 0, static_cast<int>(kTo));
  }
}

// Keeps a loaded vector in a register: gcc otherwise folds every use of it back into a memory
// operand (one load per multiply-add, and the loads, not the multiplies, bounded the int8 loops),
// and kept an array of accumulators on the stack. A no-op for the scalar stand-in of builds
// without AVX2.
template <typename T>
inline void in_register(T& v) {
  if constexpr (!std::is_arithmetic_v<T>) __asm__("" : "+v"(v));
}

// exp(x) in a form the compiler vectorizes (std::exp is a scalar call without -ffast-math), given
// -fno-trapping-math: under gcc's default the clamp below is a branch, and no loop calling this
// vectorized (gcc 12, -fopt-info-vec-missed: "control flow in loop"):
// exp(x) = 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by its Taylor series to
// r^6 (relative error below 2e-7, about one float ulp). x is clamped to [-87, 88], where 2^n stays
// a normal float: below, the result is 1.6e-38 where exp underflows; above, 1.7e38 where it
// overflows (so silu(g) = g / (1 + exp(-g)) for g below -88 is g / 1.7e38, not -0).
inline float vector_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693147181f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX2__)
// The 8 x 8 transpose of 32-bit elements: rows[i] holds element j of row i -> rows[j] holds
// element i of each (the panel kernels' packing).
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
#endif

// A KV cache element of each dtype the caches hold (--kv-cache-dtype), read as float: 16-bit caches
// halve the bytes a decode step's attention reads. bfloat16 is the high half of a float32 (a shift
// in a vectorized loop); float16 rows go through row_as_float below.
using Half = _Float16;
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(Half x) { return static_cast<float>(x); }
inline float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> cache element, rounding to nearest even as torch's .to(dtype) does, so that the C++
// decode step and the torch path write the same cache.
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline Half from_float<Half>(float x) { return static_cast<Half>(x); }
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffff) > 0x7f800000) return BFloat16{static_cast<uint16_t>((bits >> 16) | 0x40)};  // NaN stays NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

// A row of n cache elements as float32: the row itself for a float32 cache, else converted into
// `scratch` (n floats). gcc 12 leaves a loop of _Float16 conversions scalar under -march=native on
// CPUs with AVX512-FP16 (one vcvtsh2ss per element: a float16 cache ran 5x slower than float32),
// so float16 rows convert with F16C / AVX-512 instructions here.
inline const float* row_as_float(const float* row, float*, int64_t) { return row; }
inline const float* row_as_float(const BFloat16* row, float* scratch, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) scratch[i] = to_float(row[i]);
  return scratch;
}
inline const float* row_as_float(const Half* row, float* scratch, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(scratch + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i))));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(scratch + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
  }
#endif
  for (; i < n; ++i) scratch[i] = to_float(row[i]);
  return scratch;
}

// Calls fn(T{}) with T the element type of a KV cache tensor (float32, float16 or bfloat16).
template <typename F>
decltype(auto) with_cache_type(const torch::Tensor& cache, const F& fn) {
  switch (cache.scalar_type()) {
    case torch::kFloat32:
      return fn(float{});
    case torch::kFloat16:
      return fn(Half{});
    case torch::kBFloat16:
      return fn(BFloat16{});
    default:
      TORCH_CHECK(false, "KV caches are float32, float16 or bfloat16, not ", cache.scalar_type());
  }
}

// The elements of a KV cache tensor of element type T.
template <typename T>
inline T* cache_data(const torch::Tensor& cache) {
  return static_cast<T*>(cache.data_ptr());
}

// dense_gemv.cpp: float32 weights, at::linear's result (rounded differently) for any x
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight);
// quantized_gemv.cpp
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low);
// The batch-1 integer loops, for a caller that shares a matrix's rows out to its own threads
// (decode_stack.cpp's batch-1 step). x is rounded once (round_for_int8 / round_for_int4: false if
// an entry is not finite, where the float loops must serve), then each thread multiplies its
// rows [begin, end). int8_linear and int4_linear split rows between torch's threads the same way,
// kBatch1Grain at the least.
struct RoundedRows {
  std::vector<int16_t> rounded;  // [M, K]
  std::vector<int16_t> x;        // [M, K] in int4's step order (its dot-product loops only)
  std::vector<float> scales;     // [M]
  std::vector<float> sums;       // [M, K / 32] each int4 group's sum of `rounded` (int4_byte_inputs.cpp: of x as
                                 // its bytes and scales give it)
  std::vector<int8_t> bytes;     // [K] int4_byte_inputs.cpp: x rounded to int8 per group, in its step order
  std::vector<float> group_scales;  // [K / 32 * 4] int4_byte_inputs.cpp: each group's scale, once per int32 lane
};
constexpr int64_t kBatch1Grain = 64;
bool int8_batch1_supported(int64_t K);
bool round_for_int8(const float* x, int64_t K, RoundedRows& in);
void int8_batch1_rows(const int16_t* xq, float x_scale, const int8_t* qs, const float* scales, float* ys, int64_t K,
                      int64_t begin, int64_t end);
bool int4_batch1_supported(int64_t K);
bool round_for_int4(const float* x, int64_t K, RoundedRows& in);
void int4_batch1_rows(const RoundedRows& in, const uint8_t* ps, const float* scales, const float* lows, float* ys,
                      int64_t K, int64_t begin, int64_t end);
torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                              bool bfloat16);
// int4_byte_inputs.cpp: batch 1 where AVX2 lacks AVX512-VNNI, with x rounded to int8 per group of 32
// (round_for_int4 and int4_batch1_rows call these there, in the int16 loops' place)
constexpr bool kInt4ByteInputs =
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
    true;
#else
    false;
#endif
bool round_int4_bytes(const float* x, int64_t K, RoundedRows& in);
// Weight rows [begin, end) against the one row of x that round_int4_bytes rounded.
void int4_byte_batch1_rows(const RoundedRows& in, const uint8_t* ps, const float* scales, const float* lows,
                           float* ys, int64_t K, int64_t begin, int64_t end);
// bfloat16_prefill.cpp
torch::Tensor int8_bfloat16_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale);
// int8_panels.cpp: rows of x already rounded to int16 (one scale each) against int8 weights;
// false where the CPU lacks AVX2
bool int8_linear_panels(const int16_t* xq, const float* x_scales, const int8_t* qs, const float* scales, float* ys,
                        int64_t M, int64_t N, int64_t K);
// int4_panels.cpp: rows of x already rounded to int16 (one scale each, and each group's integer
// sum) against int4 weights; false where the CPU lacks AVX2
bool int4_linear_panels(const int16_t* xq, const float* x_scales, const float* x_sums, const uint8_t* ps,
                        const float* scales, const float* lows, float* ys, int64_t M, int64_t N, int64_t K);
// paged_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale);
// The checks paged_decode_attention makes of the caches' and the tables' shapes against [B, H, D].
void check_attention_shapes(const torch::Tensor& k_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, int64_t B, int64_t H, int64_t D);

// A piece [t0, t1) of one sequence's context: one task.
struct AttentionChunk {
  int64_t sequence, t0, t1;
};

// The tasks of a batch and the threads' shares of them. Lay every sequence's positions end to end
// (S in all): share i of n takes positions [i * S / n, (i + 1) * S / n), cut at sequence ends and
// every kChunkTokens, so that each thread reads the same number of KV rows. Cutting each sequence
// into whole chunks of kChunkTokens instead left a batch of one sequence shorter than a chunk on
// one thread while the other waited, and gave one thread 3 chunks against 2 at 300 tokens: at
// batch 1 on a 2-core Zen 4 this split takes 0.80x the time at 40 tokens, 0.65x at 130, 0.83x at
// 300, and the same at 1000 and at batches of 4-32 (docs/benchmarks.md, eighteenth pass).
// Tasks are in (sequence, position) order: sequence b's are first_task_of_sequence[b] ..
// first_task_of_sequence[b + 1] - 1.
struct ChunkPlan {
  std::vector<AttentionChunk> tasks;
  std::vector<int64_t> first_task_of_share, first_task_of_sequence;
};

// A decode step's attention in two parts that threads share: attend() the chunk tasks of shares
// [begin, end) of one layer (each leaves a partial softmax), then merge() rows [begin, end) of the
// [B * H, D] output. The plan depends only on the context lengths, so one serves every layer of a
// step (whose caches share their shapes); the block tables must outlive it.
class DecodeAttention {
 public:
  DecodeAttention(const int64_t* context_lens, const int64_t* block_tables, int64_t B, int64_t max_blocks, int64_t H,
                  int64_t D, int64_t num_threads, double scale);
  int64_t num_shares() const { return static_cast<int64_t>(plan_.first_task_of_share.size()) - 1; }
  void attend(const float* query, const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t share_begin,
              int64_t share_end);
  void merge(float* out, int64_t begin, int64_t end) const;

 private:
  int64_t H_, D_, max_blocks_;
  const int64_t* table_;
  float scale_;
  ChunkPlan plan_;
  std::vector<float> chunk_max_, chunk_sum_, chunk_acc_;  // [tasks, H], [tasks, H], [tasks, H, D]
};
// decode_stack.cpp: its norm and activation (prefill chunks call them too), and its Linear and
// DecodeStack classes
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
void bind_decode_stack(pybind11::module& m);

}  // namespace pdserve
