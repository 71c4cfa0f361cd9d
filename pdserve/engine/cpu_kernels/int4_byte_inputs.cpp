// Batch-1 int4 products on AVX2 CPUs without AVX512-VNNI, with x rounded to int8 per group of 32
// (a scale per group), as llama.cpp multiplies Q4_1 weights with Q8_1 activations: `vpmaddubsw`
// multiplies the nibbles as unsigned bytes with x's signed bytes and adds them in pairs, so a step of
// two groups (32 weight bytes) takes 2 multiply-adds and 3 bit operations to unpack, where x in
// int16 (quantized_gemv.cpp) took 4 multiply-adds and 7 widening operations. That loop bound the
// int4 batch-1 step by its compute on a Zen 3 (docs/benchmarks.md, twenty-sixth pass); on two of
// its cores this one ran a 4.7 MB int4 matrix in L3 1.45x as fast and a 100 MB one from memory
// 1.1-1.2x (twenty-eighth pass). The price is precision: x keeps 8 bits of each group's largest
// entry, not 15 bits of the row's (test_quantization.py measures what that costs).
//
// A group's sum is exact in integers: an int16 lane of vpmaddubsw sums two products, at most
// 2 * 15 * 127 = 3810 in size, and the low and high nibbles' lanes added make 7620, well inside the
// lanes' saturating range; vpmaddwd then adds lanes in pairs into int32.
#include "kernels.h"

#include <limits>

namespace pdserve {

namespace {

constexpr int64_t kGroup = 32;
// The bytes of x one step covers: two groups, whose low nibbles (inputs 0..15 of each) meet x's
// first 32 bytes and whose high nibbles (inputs 16..31) its next 32. So a step holds the first
// group's inputs 0-15, the second's 0-15, the first's 16-31, then the second's 16-31.
constexpr int64_t kStep = 2 * kGroup;

}  // namespace

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))

// One group of x (32 floats) rounded to int8 at factor, to nearest even as _mm256_cvtps_epi32
// rounds under the default MXCSR (as torch.round does, so a test can round x the same way): its
// bytes in x's order, and their sum. Vectorized: the scalar loop with nearbyint took ~5 us of one
// thread per int4 projection (576 inputs) while the other waited; on the Zen 3 the batch-1 decode
// stack took 0.93-0.95x the time with this (docs/benchmarks.md, twenty-ninth pass).
inline __m256i round_group(const float* x, __m256 factor, int32_t& sum) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), factor));
  const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  half = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, 1)));
  // The packs interleave the 128-bit lanes: dwords of x 0-3, 8-11, 16-19, 24-27, 4-7, ... back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float peak_of(const float* x) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 peak = _mm256_and_ps(_mm256_loadu_ps(x), magnitude);
  for (int i = 1; i < 4; ++i) peak = _mm256_max_ps(peak, _mm256_and_ps(_mm256_loadu_ps(x + 8 * i), magnitude));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

bool round_int4_bytes(const float* x, int64_t K, RoundedRows& in) {
  float poison = 0.f;  // NaN iff some entry is inf or NaN
#pragma omp simd reduction(+ : poison)
  for (int64_t k = 0; k < K; ++k) poison += x[k] * 0.f;
  if (poison != 0.f) return false;
  const int64_t G = K / kGroup;
  in.bytes.resize(K);
  in.group_scales.resize(4 * G);
  in.sums.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    const float peak = peak_of(x + g * kGroup), scale = peak / 127.f;
    // Zero for a group of zeros, and where 127 / peak would overflow (every entry under ~4e-37).
    const float factor = peak > 127.f / std::numeric_limits<float>::max() ? 127.f / peak : 0.f;
    int32_t sum;
    const __m256i bytes = round_group(x + g * kGroup, _mm256_set1_ps(factor), sum);
    // In the step's order (kStep): this group's inputs 0-15 after the step's first 16 * (g % 2)
    // bytes, its inputs 16-31 32 bytes further.
    int8_t* step = in.bytes.data() + g / 2 * kStep + g % 2 * 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(step), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(step + 32), _mm256_extracti128_si256(bytes, 1));
    // Each step's scales as its int32 lanes take them: lanes 0-3 sum its first group, 4-7 its second.
    _mm_storeu_ps(in.group_scales.data() + g * 4, _mm_set1_ps(scale));
    in.sums[g] = scale * static_cast<float>(sum);  // the low terms take the rounded x, as the products
  }
  return true;
}

// The two weight scales of a step in lanes 0-3 and 4-7.
inline __m256 weight_scales(const float* scales) {
  const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// A step's 64 products of one weight row, summed per group in int32 lanes (0-3, 4-7), as float.
inline __m256 step_products(__m256i x_low, __m256i x_high, const uint8_t* bytes) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i low = _mm256_and_si256(nibbles, mask);
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), mask);
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float lanes_sum(__m256 lanes) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

// acc's lane sum plus lows[g] * sums[g] for g < G.
inline float with_low_terms(__m256 acc, const float* lows, const float* sums, int64_t G) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(lows + g), _mm256_loadu_ps(sums + g), acc);
  float sum = lanes_sum(acc);
  for (; g < G; ++g) sum += lows[g] * sums[g];
  return sum;
}

// One weight row against x, step by step in one accumulator: x's bytes and scales come from L1.
inline float byte_row(const RoundedRows& in, const uint8_t* row, const float* scales, const float* lows, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g += 2) {
    const int8_t* x = in.bytes.data() + g * kGroup;
    const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
    const __m256 products = _mm256_mul_ps(step_products(x_low, x_high, row + g * (kGroup / 2)),
                                          _mm256_loadu_ps(in.group_scales.data() + g * 4));
    acc = _mm256_fmadd_ps(products, weight_scales(scales + g), acc);
  }
  return with_low_terms(acc, lows, in.sums.data(), G);
}

// A thread's rows one at a time, in address order, as the batch-1 int8 loop reads them: the
// nibbles, scales and lows are then three plain streams. Four rows at a time, with x's bytes held
// in registers for all four, interleaved four streams of nibbles and four of scales; on two Zen 3
// cores, 180 matrices of the down projection's shape (576 x 1536, cycled from memory) read 7-9
// GB/s that way and 15-19 GB/s this way, the other shapes 1.0-1.15x as fast, and an int4 engine's
// batch-1 step took 0.86x the time (median of 16 alternations; docs/benchmarks.md, thirtieth pass).
// The sums are those of the four-row loop, in the same order.
//
// The nibbles are asked for kAheadBytes ahead of the row in use, and the scales and lows, a quarter
// of the nibbles' bytes a row, a quarter as far: the same rows. 1-2 KB ahead read the fastest
// (4-8 KB: 0.9-0.95x).
constexpr int64_t kAheadBytes = 2048;

void int4_byte_batch1_rows(const RoundedRows& in, const uint8_t* ps, const float* scales, const float* lows,
                           float* ys, int64_t K, int64_t begin, int64_t end) {
  const int64_t G = K / kGroup, row_bytes = K / 2;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = ps + n * row_bytes;
    const float *row_scales = scales + n * G, *row_lows = lows + n * G;
    prefetch_rows(row + kAheadBytes, row_bytes);  // past the matrix's end too: a prefetch cannot fault
    prefetch_rows(reinterpret_cast<const char*>(row_scales) + kAheadBytes / 4, G * sizeof(float));
    prefetch_rows(reinterpret_cast<const char*>(row_lows) + kAheadBytes / 4, G * sizeof(float));
    ys[n] = byte_row(in, row, row_scales, row_lows, G);
  }
}

#else  // elsewhere quantized_gemv.cpp's int16 loops serve batch 1 (kInt4ByteInputs is false)

bool round_int4_bytes(const float*, int64_t, RoundedRows&) { return false; }
void int4_byte_batch1_rows(const RoundedRows&, const uint8_t*, const float*, const float*, float*, int64_t, int64_t,
                           int64_t) {}

#endif

}  // namespace pdserve
