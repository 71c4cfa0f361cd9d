// Decode attention over the paged KV cache, reading each sequence's blocks where they lie: no
// gather of the whole context into a padded tensor, no mask.
//
// Work is split by context, not by head: one task takes a chunk of kChunkTokens positions of one
// sequence and computes every query head over it (GQA: query head h reads KV head h / group),
// leaving a partial softmax (its max, its sum and its unnormalized output per head); a second
// pass merges each sequence's chunks. A chunk reads whole token rows (all KV heads, contiguous
// within a block), in order. The first version gave each (sequence, KV head) its own task, which
// read a third of every token row: the hardware prefetchers fetched the rest anyway, and the
// kernel moved 8.5 GB/s of useful bytes. Splitting the context also keeps both cores busy on a
// single long sequence.
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
constexpr int64_t kMaxHeadDim = 256;  // a 16-bit cache row converts into a buffer of this size

// exp(x) for the softmax's x <= 0, in a form the compiler vectorizes (std::exp is a scalar call
// without -ffast-math): exp(x) = 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by
// its Taylor series to r^6 (relative error below 2e-7, about one float ulp).
inline float softmax_exp(float x) {
  x = std::max(x, -87.0f);  // 2^n stays a normal float
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693147181f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Token rows ahead of the one being read: blocks lie anywhere, and a new block is a new stream
// for the hardware prefetcher.
constexpr int64_t kPrefetchTokens = 4;

template <typename T, typename RowOf>
inline void prefetch_token(const RowOf& row_of, const T* cache, int64_t t, int64_t end, int64_t token_stride) {
  if (t >= end) return;
  const T* row = row_of(cache, t, 0);
  for (int64_t i = 0; i < token_stride; i += 64 / sizeof(T)) __builtin_prefetch(row + i);
}

struct Shapes {
  int64_t H, KVH, D, group, block_size, token_stride, block_stride, max_blocks;
};

// One chunk [t0, t1) of sequence b: per head, the chunk's max score, the sum of exp(score - max)
// and the sum of exp(score - max) * v, into `max`, `sum` [H] and `acc` [H, D]. KV head by KV
// head, so that a group's query rows and output sums stay in registers while the chunk's rows
// (a few tens of KB) are read from cache after the first head. kD is the head size when known
// at compile time (the loops then unroll fully), else 0 and s.D is used. T: the caches' element type.
template <int64_t kD, typename T>
void attend_chunk(const float* q, const T* ks, const T* vs, const int64_t* blocks, int64_t t0, int64_t t1,
                  const Shapes& s, float softmax_scale, std::vector<float>& scores, float* max, float* sum,
                  float* acc) {
  const int64_t n = t1 - t0, D = kD ? kD : s.D;
  scores.resize(s.H * n);
  auto row_of = [&](const T* cache, int64_t t, int64_t kv_head) {
    return cache + blocks[t / s.block_size] * s.block_stride + (t % s.block_size) * s.token_stride + kv_head * D;
  };
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_token(row_of, ks, t + kPrefetchTokens, t1, s.token_stride);
    for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
      float k_row[kD ? kD : kMaxHeadDim];
      const float* __restrict k = row_as_float(row_of(ks, t, kv_head), k_row, D);
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
  for (int64_t h = 0; h < s.H; ++h) {
    float* row = scores.data() + h * n;
    const float peak = *std::max_element(row, row + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += (row[i] = softmax_exp(row[i] - peak));
    max[h] = peak;
    sum[h] = total;
  }
  std::fill(acc, acc + s.H * D, 0.f);
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_token(row_of, vs, t + kPrefetchTokens, t1, s.token_stride);
    for (int64_t kv_head = 0; kv_head < s.KVH; ++kv_head) {
      float v_row[kD ? kD : kMaxHeadDim];
      const float* __restrict v = row_as_float(row_of(vs, t, kv_head), v_row, D);
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

}  // namespace

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
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head sizes do not fit");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || D <= kMaxHeadDim, "a 16-bit cache's head size is at most ",
              kMaxHeadDim, ", not ", D);
  TORCH_CHECK(lens.numel() == B && tables.size(0) == B, "one block table and context length per sequence");
  const Shapes shapes{H, KVH, D, H / KVH, block_size, KVH * D, block_size * KVH * D, max_blocks};
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* context = lens.data_ptr<int64_t>();

  // Chunks of sequence b are tasks first_task[b] .. first_task[b + 1] - 1.
  std::vector<int64_t> first_task(B + 1, 0), task_sequence;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(context[b] >= 1 && context[b] <= max_blocks * block_size, "context length out of range");
    const int64_t chunks = (context[b] + kChunkTokens - 1) / kChunkTokens;
    first_task[b + 1] = first_task[b] + chunks;
    task_sequence.insert(task_sequence.end(), chunks, b);
  }
  const int64_t num_tasks = first_task[B];
  std::vector<float> chunk_max(num_tasks * H), chunk_sum(num_tasks * H), chunk_acc(num_tasks * H * D);
  const float* qs = q.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);

  with_cache_type(k_cache, [&](auto element) {
    using T = decltype(element);
    const T* ks = cache_data<T>(k_cache);
    const T* vs = cache_data<T>(v_cache);
    at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task_sequence[task];
        const int64_t t0 = (task - first_task[b]) * kChunkTokens, t1 = std::min(context[b], t0 + kChunkTokens);
        const auto attend = D == 64 ? attend_chunk<64, T> : D == 128 ? attend_chunk<128, T> : attend_chunk<0, T>;
        attend(qs + b * H * D, ks, vs, table + b * max_blocks, t0, t1, shapes, softmax_scale, scores,
               chunk_max.data() + task * H, chunk_sum.data() + task * H, chunk_acc.data() + task * H * D);
      }
    });
  });

  // Merge: out = sum_i acc_i * exp(max_i - max) / sum_i sum_i * exp(max_i - max).
  auto out = torch::empty_like(q);
  float* os = out.data_ptr<float>();
  at::parallel_for(0, B * H, 8, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float peak = -INFINITY;
      for (int64_t task = first_task[b]; task < first_task[b + 1]; ++task) peak = std::max(peak, chunk_max[task * H + h]);
      float* o = os + bh * D;
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (int64_t task = first_task[b]; task < first_task[b + 1]; ++task) {
        const float weight = std::exp(chunk_max[task * H + h] - peak);
        total += chunk_sum[task * H + h] * weight;
        const float* acc = chunk_acc.data() + (task * H + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += acc[d] * weight;
      }
      const float inverse = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inverse;
    }
  });
  return out;
}

}  // namespace pdserve
