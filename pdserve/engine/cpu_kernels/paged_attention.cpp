// Decode attention over the paged KV cache, reading each sequence's blocks where they lie: no
// gather of the whole context into a padded tensor, no mask. One task per (sequence, KV head)
// computes every query head of that KV head's group (GQA), so each K and V row is loaded once
// per group.
//
// query [B, H, D], k_cache / v_cache [num_blocks, block_size, KVH, D] (float32, contiguous),
// block_tables [B, max_blocks] int64, context_lens [B] int64 -> out [B, H, D]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace pdserve {

torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32, "query must be float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous(),
              "k_cache must be contiguous float32 [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(), "v_cache must match k_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  const auto q = query.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head sizes do not fit");
  const int64_t group = H / KVH;
  const int64_t token_stride = KVH * D, block_stride = block_size * token_stride;
  auto out = torch::empty_like(q);
  const float* qs = q.data_ptr<float>();
  const float* ks = k_cache.data_ptr<float>();
  const float* vs = v_cache.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* context = lens.data_ptr<int64_t>();
  float* os = out.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kv_head = task % KVH, length = context[b];
      TORCH_CHECK(length >= 1 && length <= max_blocks * block_size, "context length out of range");
      scores.assign(group * length, 0.f);
      const int64_t* blocks = table + b * max_blocks;
      // Scores: q . k for every position, each K row loaded once for the group's query heads.
      for (int64_t t = 0; t < length; ++t) {
        const float* k = ks + blocks[t / block_size] * block_stride + (t % block_size) * token_stride + kv_head * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qs + (b * H + kv_head * group + g) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
          scores[g * length + t] = dot * softmax_scale;
        }
      }
      // Softmax per query head, then the weighted sum of V rows.
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * length;
        const float peak = *std::max_element(row, row + length);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) total += (row[t] = std::exp(row[t] - peak));
        const float inverse = 1.f / total;
        for (int64_t t = 0; t < length; ++t) row[t] *= inverse;
        float* o = os + (b * H + kv_head * group + g) * D;
        std::fill(o, o + D, 0.f);
      }
      for (int64_t t = 0; t < length; ++t) {
        const float* v = vs + blocks[t / block_size] * block_stride + (t % block_size) * token_stride + kv_head * D;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + t];
          float* o = os + (b * H + kv_head * group + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}

}  // namespace pdserve
