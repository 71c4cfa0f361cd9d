// Decode attention over the paged KV cache, reading each sequence's blocks where they lie: no
// gather of the whole context into a padded tensor, no mask.
//
// Work is split by context, not by head: one task takes a chunk of at most kChunkTokens positions of
// one sequence and computes every query head over it (GQA: query head h reads KV head h / group),
// leaving a partial softmax (its max, its sum and its unnormalized output per head); a second
// pass merges each sequence's chunks. A chunk reads whole token rows (all KV heads, contiguous
// within a block), in order. The first version gave each (sequence, KV head) its own task, which
// read a third of every token row: the hardware prefetchers fetched the rest anyway, and the
// kernel moved 8.5 GB/s of useful bytes. Splitting the context also keeps both cores busy on a
// single long sequence.
//
// Head sizes of 64 and 128 take attend_chunk_vectorized: a chunk's rows are located once per KV
// head and read in place (a 16-bit row converts as it loads: converting it once into a buffer
// for the group's heads ran 5-18% slower), each query head scores a vector's width of tokens at a
// time with one transposed reduction for all their dot products, and its output sums stay in
// registers across the chunk. Per dot product the first version (kept for other head sizes)
// did a horizontal sum, and read and wrote its output sums back per token: at batch 32 x 300
// tokens on a 2-core Xeon it ran a layer in 1.13 ms (float32 cache, cold), this one in 0.78.
// 16-bit caches take attend_chunk_token_major, the same arithmetic token by token.
//
// query [B, H, D], k_cache / v_cache [num_blocks, block_size, KVH, D] (float32, contiguous),
// block_tables [B, max_blocks] int64, context_lens [B] int64 -> out [B, H, D]
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdserve {

namespace {

constexpr int64_t kChunkTokens = 64;
// Fewer positions per thread than this run on one: a parallel region costs more than it saves
// (a 12-token context: 7.0 us split, 6.9 whole; 20 tokens: 7.9 and 8.2, on a 2-core Zen 4).
constexpr int64_t kMinSharePositions = 8;
constexpr int64_t kMergeGrain = 8;  // merged rows (sequence, head) a thread takes at the least
constexpr int64_t kMaxHeadDim = 256;  // a 16-bit cache row converts into a buffer of this size

// Token rows ahead of the one being read: blocks lie anywhere, and a new block is a new stream
// for the hardware prefetcher.
constexpr int64_t kPrefetchTokens = 4;

struct Shapes {
  int64_t H, KVH, D, group, block_size, token_stride, block_stride, max_blocks;
};

// Where the row of KV head `kv_head` at position t of a sequence lies (its blocks: `blocks`).
template <typename T>
inline const T* kv_row(const T* cache, const int64_t* blocks, int64_t t, int64_t kv_head, const Shapes& s) {
  return cache + blocks[t / s.block_size] * s.block_stride + (t % s.block_size) * s.token_stride + kv_head * s.D;
}

// Brings the whole token row at position t ahead of use (nothing past `end`).
template <typename T>
inline void prefetch_token(const T* cache, const int64_t* blocks, int64_t t, int64_t end, const Shapes& s) {
  if (t >= end) return;
  const T* row = kv_row(cache, blocks, t, 0, s);
  for (int64_t i = 0; i < s.token_stride; i += 64 / sizeof(T)) __builtin_prefetch(row + i);
}

// Per head, the chunk's n scores (rows of `scores`) become exp(score - max), with that max and their sum.
inline void chunk_softmax(float* scores, int64_t H, int64_t n, float* max, float* sum) {
  for (int64_t h = 0; h < H; ++h) {
    float* row = scores + h * n;
    const float peak = *std::max_element(row, row + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += (row[i] = vector_exp(row[i] - peak));
    max[h] = peak;
    sum[h] = total;
  }
}

// One chunk [t0, t1) of sequence b: per head, the chunk's max score, the sum of exp(score - max)
// and the sum of exp(score - max) * v, into `max`, `sum` [H] and `acc` [H, D]. KV head by KV
// head, so that a group's query rows and output sums stay in registers while the chunk's rows
// (a few tens of KB) are read from cache after the first head. T: the caches' element type. For
// head sizes without a vectorized version, and builds without AVX2.
template <typename T>
void attend_chunk(const float* q, const T* ks, const T* vs, const int64_t* blocks, int64_t t0, int64_t t1,
                  const Shapes& s, float softmax_scale, std::vector<float>& scores, float* max, float* sum,
                  float* acc) {
  const int64_t n = t1 - t0, D = s.D;
  scores.resize(s.H * n);
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_token(ks, blocks, t + kPrefetchTokens, t1, s);
    for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
      float k_row[kMaxHeadDim];
      const float* __restrict k = row_as_float(kv_row(ks, blocks, t, kv_head, s), k_row, D);
      for (int64_t g = 0; g < s.group; ++g) {
        const int64_t h = kv_head * s.group + g;
        const float* __restrict qh = q + h * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
        scores[h * n + (t - t0)] = dot * softmax_scale;
      }
    }
  }
  chunk_softmax(scores.data(), s.H, n, max, sum);
  std::fill(acc, acc + s.H * D, 0.f);
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_token(vs, blocks, t + kPrefetchTokens, t1, s);
    for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
      float v_row[kMaxHeadDim];
      const float* __restrict v = row_as_float(kv_row(vs, blocks, t, kv_head, s), v_row, D);
      for (int64_t g = 0; g < s.group; ++g) {
        const int64_t h = kv_head * s.group + g;
        const float p = scores[h * n + (t - t0)];
        float* __restrict a = acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
      }
    }
  }
}

// attend_chunk_vectorized needs a build with AVX-512, or AVX2 and F16C.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#define PDSERVE_VECTORIZED_ATTENTION 1
#endif

#ifdef PDSERVE_VECTORIZED_ATTENTION
// Float vectors of the widest kind this build has. `sum_each` is the transposed reduction: from
// kLanes vectors of a dot product's partial sums, one vector of their kLanes totals, a level of
// shuffles and adds per halving (45 instructions for 16 dot products on AVX-512, where a
// horizontal sum per dot product took about 8 each and serialized on its adds). `load` reads
// float32, float16 (F16C) or bfloat16 (a shift) elements as float32 lanes.
struct FloatVec {
#if defined(__AVX512F__)
  static constexpr int64_t kLanes = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const BFloat16* p) {
    const __m512i widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
  }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V sum_each(const V* p) {
    V pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane: two vectors' lanes {0, 2} and {1, 3} summed, interleaved
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: four vectors' sums over that lane
      const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
      quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i) {  // then the 128-bit lanes of each quad, two by two
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
#else
  static constexpr int64_t kLanes = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const BFloat16* p) {
    const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
  }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V sum_each(const V* p) {
    V pairs[4], quads[2];
    for (int i = 0; i < 4; ++i) {
      pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    }
    for (int i = 0; i < 2; ++i) {
      const __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
      quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }
#endif
};

// Where the chunk's rows of one cache lie, [KVH][kChunkTokens]: read in place by the vector loads
// (a 16-bit row converts as it loads). Whole token rows are prefetched in order, as in attend_chunk.
template <typename T>
void chunk_rows(const T* cache, const int64_t* blocks, int64_t t0, int64_t t1, const Shapes& s, const T** rows) {
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_token(cache, blocks, t + kPrefetchTokens, t1, s);
    for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
      rows[kv_head * kChunkTokens + t - t0] = kv_row(cache, blocks, t, kv_head, s);
    }
  }
}

// The scaled scores of kLanes tokens from their kLanes vectors of partial dot products (one
// transposed reduction); only the first `count` are stored (past a chunk's end, none).
inline void store_scores(const FloatVec::V* partial, FloatVec::V scale, int64_t count, float* scores) {
  float tile[FloatVec::kLanes];
  FloatVec::store(tile, FloatVec::mul(FloatVec::sum_each(partial), scale));
  std::copy(tile, tile + count, scores);
}

// attend_chunk for head sizes that are whole vectors: a query head's scores kLanes tokens at a
// time (kLanes dot products, then one transposed reduction), and its output sums kept in
// registers across the chunk's tokens instead of read and written back per token.
template <int64_t kD, typename T>
void attend_chunk_vectorized(const float* q, const T* ks, const T* vs, const int64_t* blocks, int64_t t0, int64_t t1,
                             const Shapes& s, float softmax_scale, std::vector<float>& scores,
                             std::vector<const T*>& rows, float* max, float* sum, float* acc) {
  using Vec = FloatVec;
  constexpr int64_t kLanes = Vec::kLanes, kVectors = kD / kLanes;
  static_assert(kD % kLanes == 0, "a head is a whole number of vectors");
  const int64_t n = t1 - t0;
  scores.resize(s.H * n);
  rows.resize(s.KVH * kChunkTokens);
  chunk_rows(ks, blocks, t0, t1, s, rows.data());
  const typename Vec::V scale = Vec::broadcast(softmax_scale);
  for (int64_t h = 0; h < s.H; ++h) {
    const T* const* keys = rows.data() + (h / s.group) * kChunkTokens;
    typename Vec::V query[kVectors];
    for (int64_t j = 0; j < kVectors; ++j) query[j] = Vec::load(q + h * kD + j * kLanes);
    for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
      typename Vec::V partial[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        const T* k = keys[std::min(i0 + i, n - 1)];  // past the chunk's end: a real row, result unused
        typename Vec::V dot = Vec::mul(query[0], Vec::load(k));
        for (int64_t j = 1; j < kVectors; ++j) dot = Vec::fmadd(query[j], Vec::load(k + j * kLanes), dot);
        partial[i] = dot;
      }
      store_scores(partial, scale, std::min(kLanes, n - i0), scores.data() + h * n + i0);
    }
  }
  chunk_softmax(scores.data(), s.H, n, max, sum);
  chunk_rows(vs, blocks, t0, t1, s, rows.data());
  for (int64_t h = 0; h < s.H; ++h) {
    const T* const* values = rows.data() + (h / s.group) * kChunkTokens;
    const float* p = scores.data() + h * n;
    typename Vec::V out[kVectors];
    for (int64_t j = 0; j < kVectors; ++j) out[j] = Vec::zero();
    for (int64_t i = 0; i < n; ++i) {
      const typename Vec::V weight = Vec::broadcast(p[i]);
      for (int64_t j = 0; j < kVectors; ++j) out[j] = Vec::fmadd(weight, Vec::load(values[i] + j * kLanes), out[j]);
    }
    for (int64_t j = 0; j < kVectors; ++j) Vec::store(acc + h * kD + j * kLanes, out[j]);
  }
}

// attend_chunk_vectorized for 16-bit caches, token by token: each token's K row (all KV heads,
// contiguous) converts once and scores every query head before the next token's, and its V row
// adds into every head's output sums (kept in L1, read and written per token). Head by head, all
// of a chunk's misses fell in each KV head's first query head, and the other heads computed with
// nothing in flight: compute and memory took turns. Decode steps of 8 x 800 tokens (int8, float16
// cache, 2-core Xeon) took 0.92x the time, 32 x 300 and 1 x 800 0.96x; with a float32 cache 1.10x,
// so float32 rows stay head by head (docs/benchmarks.md, twenty-third pass).
template <int64_t kD, typename T>
void attend_chunk_token_major(const float* q, const T* ks, const T* vs, const int64_t* blocks, int64_t t0, int64_t t1,
                              const Shapes& s, float softmax_scale, std::vector<float>& scores,
                              std::vector<FloatVec::V>& partial, float* max, float* sum, float* acc) {
  using Vec = FloatVec;
  using V = typename Vec::V;
  constexpr int64_t kLanes = Vec::kLanes, kVectors = kD / kLanes;
  static_assert(kD % kLanes == 0, "a head is a whole number of vectors");
  const int64_t n = t1 - t0, H = s.H;
  scores.resize(H * n);
  partial.resize(H * kLanes);  // each head's dot products of kLanes tokens, before their reduction
  const V scale = Vec::broadcast(softmax_scale);
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t t = t0 + std::min(i0 + i, n - 1);  // past the chunk's end: a real row, result unused
      for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
        const T* k = kv_row(ks, blocks, t, kv_head, s);
        V key[kVectors];
        for (int64_t j = 0; j < kVectors; ++j) key[j] = Vec::load(k + j * kLanes);
        for (int64_t h = kv_head * s.group; h < (kv_head + 1) * s.group; ++h) {
          V dot = Vec::mul(Vec::load(q + h * kD), key[0]);
          for (int64_t j = 1; j < kVectors; ++j) dot = Vec::fmadd(Vec::load(q + h * kD + j * kLanes), key[j], dot);
          partial[h * kLanes + i] = dot;
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      store_scores(partial.data() + h * kLanes, scale, std::min(kLanes, n - i0), scores.data() + h * n + i0);
    }
  }
  chunk_softmax(scores.data(), H, n, max, sum);
  std::fill(acc, acc + H * kD, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
      const T* v = kv_row(vs, blocks, t0 + i, kv_head, s);
      V value[kVectors];
      for (int64_t j = 0; j < kVectors; ++j) value[j] = Vec::load(v + j * kLanes);
      for (int64_t h = kv_head * s.group; h < (kv_head + 1) * s.group; ++h) {
        const V weight = Vec::broadcast(scores[h * n + i]);
        float* out = acc + h * kD;
        for (int64_t j = 0; j < kVectors; ++j) {
          Vec::store(out + j * kLanes, Vec::fmadd(weight, value[j], Vec::load(out + j * kLanes)));
        }
      }
    }
  }
}
#endif

ChunkPlan plan_chunks(const int64_t* context, int64_t B, int64_t num_shares) {
  ChunkPlan plan;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += context[b];
  num_shares = std::max<int64_t>(1, std::min(num_shares, total / kMinSharePositions));
  plan.first_task_of_sequence.assign(B + 1, 0);
  int64_t b = 0, sequence_start = 0, position = 0;  // position: in the end-to-end layout
  for (int64_t share = 0; share < num_shares; ++share) {
    plan.first_task_of_share.push_back(static_cast<int64_t>(plan.tasks.size()));
    const int64_t share_end = (share + 1) * total / num_shares;
    while (position < share_end) {
      while (position >= sequence_start + context[b]) sequence_start += context[b++];
      const int64_t end = std::min({share_end, sequence_start + context[b], position + kChunkTokens});
      plan.tasks.push_back({b, position - sequence_start, end - sequence_start});
      position = end;
    }
  }
  plan.first_task_of_share.push_back(static_cast<int64_t>(plan.tasks.size()));
  for (const AttentionChunk& chunk : plan.tasks) ++plan.first_task_of_sequence[chunk.sequence + 1];
  for (int64_t i = 0; i < B; ++i) plan.first_task_of_sequence[i + 1] += plan.first_task_of_sequence[i];
  return plan;
}

}  // namespace

DecodeAttention::DecodeAttention(const int64_t* context, const int64_t* table, int64_t B, int64_t max_blocks,
                                 int64_t H, int64_t D, int64_t num_threads, double scale)
    : H_(H), D_(D), max_blocks_(max_blocks), table_(table),
      scale_(static_cast<float>(scale)), plan_(plan_chunks(context, B, num_threads)) {
  const int64_t num_tasks = static_cast<int64_t>(plan_.tasks.size());
  chunk_max_.resize(num_tasks * H);
  chunk_sum_.resize(num_tasks * H);
  chunk_acc_.resize(num_tasks * H * D);
}

void DecodeAttention::attend(const float* qs, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             int64_t share_begin, int64_t share_end) {
  const int64_t H = H_, D = D_, block_size = k_cache.size(1), KVH = k_cache.size(2);
  const Shapes shapes{H, KVH, D, H / KVH, block_size, KVH * D, block_size * KVH * D, max_blocks_};
  with_cache_type(k_cache, [&](auto element) {
    using T = decltype(element);
    const T* ks = cache_data<T>(k_cache);
    const T* vs = cache_data<T>(v_cache);
    std::vector<float> scores;
    std::vector<const T*> rows;
#ifdef PDSERVE_VECTORIZED_ATTENTION
    std::vector<FloatVec::V> partial;
#endif
    for (int64_t task = plan_.first_task_of_share[share_begin]; task < plan_.first_task_of_share[share_end]; ++task) {
      const AttentionChunk& chunk = plan_.tasks[task];
      const int64_t b = chunk.sequence;
      float *max = chunk_max_.data() + task * H, *sum = chunk_sum_.data() + task * H;
      float* acc = chunk_acc_.data() + task * H * D;
      const float* qb = qs + b * H * D;
      const int64_t* blocks = table_ + b * max_blocks_;
#ifdef PDSERVE_VECTORIZED_ATTENTION
      if (D == 64 || D == 128) {
        // 16-bit rows token by token; float32 rows head by head, which measured faster for them.
        if constexpr (sizeof(T) == 2) {
          const auto attend = D == 64 ? attend_chunk_token_major<64, T> : attend_chunk_token_major<128, T>;
          attend(qb, ks, vs, blocks, chunk.t0, chunk.t1, shapes, scale_, scores, partial, max, sum, acc);
        } else {
          const auto attend = D == 64 ? attend_chunk_vectorized<64, T> : attend_chunk_vectorized<128, T>;
          attend(qb, ks, vs, blocks, chunk.t0, chunk.t1, shapes, scale_, scores, rows, max, sum, acc);
        }
        continue;
      }
#endif
      attend_chunk<T>(qb, ks, vs, blocks, chunk.t0, chunk.t1, shapes, scale_, scores, max, sum, acc);
    }
  });
}

// out = sum_i acc_i * exp(max_i - max) / sum_i sum_i * exp(max_i - max), over sequence b's chunks i.
void DecodeAttention::merge(float* os, int64_t begin, int64_t end) const {
  const int64_t H = H_, D = D_;
  const std::vector<int64_t>& first_task = plan_.first_task_of_sequence;
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    float peak = -INFINITY;
    for (int64_t task = first_task[b]; task < first_task[b + 1]; ++task) peak = std::max(peak, chunk_max_[task * H + h]);
    float* o = os + bh * D;
    std::fill(o, o + D, 0.f);
    float total = 0.f;
    for (int64_t task = first_task[b]; task < first_task[b + 1]; ++task) {
      const float weight = std::exp(chunk_max_[task * H + h] - peak);
      total += chunk_sum_[task * H + h] * weight;
      const float* acc = chunk_acc_.data() + (task * H + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += acc[d] * weight;
    }
    const float inverse = 1.f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inverse;
  }
}

torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32, "query must be float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous(),
              "k_cache must be contiguous [blocks, block_size, kv_heads, D] (float32, float16 or bfloat16)");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "v_cache must match k_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  const auto q = query.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_attention_shapes(k_cache, tables, lens, B, H, D);
  DecodeAttention attention(lens.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), B, tables.size(1), H, D,
                            at::get_num_threads(), scale);
  const float* qs = q.data_ptr<float>();
  at::parallel_for(0, attention.num_shares(), 1,
                   [&](int64_t begin, int64_t end) { attention.attend(qs, k_cache, v_cache, begin, end); });
  auto out = torch::empty_like(q);
  float* os = out.data_ptr<float>();
  at::parallel_for(0, B * H, kMergeGrain, [&](int64_t begin, int64_t end) { attention.merge(os, begin, end); });
  return out;
}

void check_attention_shapes(const torch::Tensor& k_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, int64_t B, int64_t H, int64_t D) {
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head sizes do not fit");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || D <= kMaxHeadDim, "a 16-bit cache's head size is at most ",
              kMaxHeadDim, ", not ", D);
  TORCH_CHECK(context_lens.numel() == B && block_tables.dim() == 2 && block_tables.size(0) == B,
              "one block table and context length per sequence");
  const int64_t* context = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(context[b] >= 1 && context[b] <= max_blocks * block_size, "context length out of range");
  }
}

}  // namespace pdserve
