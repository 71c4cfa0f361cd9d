// The decode stack's parts (decode_stack.cpp) that its batch-1 step (batch1_step.cpp) shares.
#pragma once

#include "kernels.h"

#include <optional>
#include <string>
#include <vector>

namespace pdserve {

// One projection: "dense" {weight}, "int8" {q, scale} or "int4" {packed, scale, low}, and a bias.
struct Linear {
  enum class Kind { kDense, kInt8, kInt4 };

  Linear(const std::string& name, std::vector<torch::Tensor> weights, std::optional<torch::Tensor> bias)
      : kind(kind_of(name)), weights(std::move(weights)), bias(std::move(bias)) {
    const size_t expected = kind == Kind::kDense ? 1 : kind == Kind::kInt8 ? 2 : 3;
    TORCH_CHECK(this->weights.size() == expected, "a ", name, " projection takes ", expected, " tensors, got ",
                this->weights.size());
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y = kind == Kind::kDense  ? dense_linear(x, weights[0])
                      : kind == Kind::kInt8 ? int8_linear(x, weights[0], weights[1])
                                            : int4_linear(x, weights[0], weights[1], weights[2]);
    if (bias) y.add_(*bias);
    return y;
  }

  int64_t rows() const { return weights[0].size(0); }

  // Whether the batch-1 step (batch1_step.cpp) can run this projection in its own threads: the
  // integer loops of int8 and int4, for this width.
  bool batch1_supported() const {
    const int64_t K = kind == Kind::kInt4 ? weights[0].size(1) * 2 : weights[0].size(1);
    return kind == Kind::kInt8 ? int8_batch1_supported(K) : kind == Kind::kInt4 && int4_batch1_supported(K);
  }

  // Rounds the one row of x for the integer loops; false if an entry is not finite.
  bool round_input(const float* x, int64_t K, RoundedRows& in) const {
    return kind == Kind::kInt8 ? round_for_int8(x, K, in) : round_for_int4(x, K, in);
  }

  // Rows [begin, end) of y = x @ W.T (+ bias) for the rounded row of x.
  void batch1_rows(const RoundedRows& in, float* y, int64_t begin, int64_t end) const {
    if (kind == Kind::kInt8) {
      int8_batch1_rows(in.rounded.data(), in.scales[0], weights[0].data_ptr<int8_t>(), weights[1].data_ptr<float>(), y,
                       weights[0].size(1), begin, end);
    } else {
      int4_batch1_rows(in, weights[0].data_ptr<uint8_t>(), weights[1].data_ptr<float>(), weights[2].data_ptr<float>(),
                       y, weights[0].size(1) * 2, begin, end);
    }
    if (bias) {
      const float* b = bias->data_ptr<float>();
      for (int64_t n = begin; n < end; ++n) y[n] += b[n];
    }
  }

  static Kind kind_of(const std::string& name) {
    if (name == "dense") return Kind::kDense;
    if (name == "int8") return Kind::kInt8;
    TORCH_CHECK(name == "int4", "a projection is dense, int8 or int4, not ", name);
    return Kind::kInt4;
  }

  Kind kind;
  std::vector<torch::Tensor> weights;
  std::optional<torch::Tensor> bias;
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim], float32
};

// One row of rms_norm (w * (x * rsqrt(mean(x^2) + eps))) and of silu_and_mul ([gate | up] of 2I
// -> I): what the torch-facing functions in decode_stack.cpp compute per row.
void rms_norm_row(const float* row, const float* w, float* out, int64_t N, float eps);
void silu_and_mul_row(const float* gate_up, float* out, int64_t I);

// Rotates the first `heads` heads of each row in place: x * cos + rotate_half(x) * sin, where
// `signed_sin` already carries rotate_half's sign (models/llama.py, rotary_tables).
void rotate(float* rows, int64_t row_stride, const int64_t* positions, int64_t M, int64_t heads, int64_t D,
            const float* cos, const float* signed_sin);

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, torch::Tensor embedding,
              torch::Tensor cos, torch::Tensor signed_sin, torch::Tensor final_norm)
      : H_(num_heads), KVH_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        embedding_(std::move(embedding)), cos_(std::move(cos)), sin_(std::move(signed_sin)),
        final_norm_(std::move(final_norm)) {
    for (const auto* t : {&embedding_, &cos_, &sin_, &final_norm_}) {
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->device().is_cpu(),
                  "the decode stack runs on contiguous float32 CPU tensors");
    }
    TORCH_CHECK(cos_.size(1) == D_ && sin_.sizes() == cos_.sizes(), "rotary tables must be [positions, head_dim]");
  }

  void add_layer(torch::Tensor input_norm, Linear qkv, Linear o, torch::Tensor post_attention_norm, Linear gate_up,
                 Linear down, torch::Tensor k_cache, torch::Tensor v_cache) {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == KVH_ && k_cache.size(3) == D_ && k_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                    v_cache.is_contiguous(),
                "KV caches must be contiguous [blocks, block_size, kv_heads, head_dim], K and V of one dtype");
    with_cache_type(k_cache, [](auto) {});  // float32, float16 or bfloat16
    for (const Linear* linear : {&qkv, &o, &gate_up, &down}) batch1_supported_ &= linear->batch1_supported();
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                            std::move(gate_up), std::move(down), std::move(k_cache), std::move(v_cache)});
  }

  // The LM head that `logits` applies: a quantized one, whose batch-1 rows the step's own
  // threads compute at the end of its parallel region (batch1_step.cpp).
  void set_lm_head(Linear head) {
    TORCH_CHECK(head.kind != Linear::Kind::kDense, "the stack takes a quantized LM head");
    lm_head_ = std::move(head);
  }
  bool has_lm_head() const { return lm_head_.has_value(); }

  // input_ids, positions, slots [B]; block_tables [B, max_blocks]; context_lens [B] (all int64)
  // -> the final-normed hidden states [B, hidden]. Writes each layer's new K/V at `slots`.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& slots,
                        const torch::Tensor& block_tables, const torch::Tensor& context_lens) const;

  // forward's inputs -> the LM head's logits [B, vocab]: the same bits as the head applied to
  // forward's result, in one parallel region at batch 1 where forward takes one.
  torch::Tensor logits(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& slots,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens) const;

  // Whether batch-1 steps run in one parallel region (batch1_step.cpp); off, they take the
  // per-operation path that batches take (tests compare the two).
  bool one_region_batch1 = true;
  bool batch1_supported() const { return batch1_supported_; }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // The checked batch-1 step in one parallel region: the final-normed hidden state, or with
  // `head` that head's logits. An undefined tensor where it cannot run (no layers, a projection
  // without batch-1 integer loops, layers of different sizes) or met an entry that is not finite.
  torch::Tensor forward_batch1(const torch::Tensor& input_ids, const torch::Tensor& positions,
                               const torch::Tensor& slots, const torch::Tensor& block_tables,
                               const torch::Tensor& context_lens, const Linear* head = nullptr) const;
  // forward after check_step_inputs (logits checks its inputs once, before either path).
  torch::Tensor hidden_states(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& slots,
                              const torch::Tensor& block_tables, const torch::Tensor& context_lens) const;
  bool takes_one_region(int64_t B) const { return B == 1 && one_region_batch1 && batch1_supported_; }
  void check_step_inputs(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& slots,
                         const torch::Tensor& context_lens) const;
  void write_kv(const float* rows, int64_t row_stride, int64_t q_size, int64_t kv_size, const int64_t* slot, int64_t B,
                const Layer& layer) const;
  bool batch1_supported_ = true;  // every projection so far has batch-1 integer loops

  int64_t H_, KVH_, D_;
  float eps_;
  torch::Tensor embedding_, cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
  std::optional<Linear> lm_head_;
};

}  // namespace pdserve
