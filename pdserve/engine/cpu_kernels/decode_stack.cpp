// A whole decode step of a Llama-family decoder (embedding to final norm) in one call from Python.
//
// At batch 1 the step's ~210 weight matrices stream in ~7 ms (int8, 2 Xeon cores), but the
// Python module tree around them issued ~3000 small torch ops (norms, rotary, slices, casts, the
// KV write) at a few microseconds each, which doubled the step. Here each layer is a handful of
// plain loops around the GEMV and attention kernels of this extension:
//
//   x = embed[ids]
//   per layer:  h = rms_norm(x);  qkv = h @ Wqkv;  rotate q, k;  write k, v at the slots;
//               x += attention(q) @ Wo;  h = rms_norm(x);  g, u = h @ Wgate_up;  x += (silu(g) * u) @ Wdown
//   return rms_norm(x)
//
// Float32 activations; each projection is float32 (at::linear), int8 or int4 (quantized_gemv.cpp);
// the KV caches float32, float16 or bfloat16 (--kv-cache-dtype), written rounded as torch rounds.
// The Python side (pdserve/engine/models/cpu_decode.py) builds the stack from a loaded model and
// calls it only for steps in which every sequence decodes one token. A step of one sequence whose
// projections are all int8 or int4 runs the same arithmetic in one parallel region instead
// (batch1_step.cpp).
#include "decode_stack.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace pdserve {

// transformers' LlamaRMSNorm in float32: w * (x * rsqrt(mean(x^2) + eps)), row by row; rows are
// shared out to the threads (prefill chunks call it too: cpu_decode.py, use_kernel_elementwise), each
// row computed alone, so the same bits at any thread count.
void rms_norm_row(const float* row, const float* w, float* out, int64_t N, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t n = 0; n < N; ++n) squares += row[n] * row[n];
  const float inverse = 1.f / std::sqrt(squares / N + eps);
#pragma omp simd
  for (int64_t n = 0; n < N; ++n) out[n] = w[n] * (row[n] * inverse);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [rows, hidden] float32");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.numel() == x.size(1), "one float32 weight per column");
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) rms_norm_row(xs + m * N, w, os + m * N, N, epsilon);
  });

  return out;
}

// silu(gate) * up for rows laid out [gate | up], vectorized (vector_exp; it needs the build's
// -fno-trapping-math, cpu_kernels/__init__.py): with std::exp, a scalar call per element, the
// default model's 30 layers took 0.2 ms of a 7 ms int8 step here. Rows are shared out to the
// threads, each computed alone (prefill chunks call it too: cpu_decode.py).
void silu_and_mul_row(const float* gate_up, float* out, int64_t I) {
  const float* g = gate_up;
  const float* u = g + I;
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) out[i] = g[i] / (1.f + vector_exp(-g[i])) * u[i];
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * intermediate] float32");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gu = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) silu_and_mul_row(gu + m * 2 * I, os + m * I, I);
  });

  return out;
}

// Rotates the first `heads` heads of each row in place: x * cos + rotate_half(x) * sin, where
// `signed_sin` already carries rotate_half's sign (models/llama.py, rotary_tables).
void rotate(float* rows, int64_t row_stride, const int64_t* positions, int64_t M, int64_t heads, int64_t D,
            const float* cos, const float* signed_sin) {
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cos + positions[m] * D;
    const float* s = signed_sin + positions[m] * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = rows + m * row_stride + h * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * c[d] + x2 * s[d];
        x[d + half] = x2 * c[d + half] + x1 * s[d + half];
      }
    }
  }
}

void DecodeStack::check_step_inputs(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                    const torch::Tensor& slots, const torch::Tensor& context_lens) const {
  for (const auto* t : {&input_ids, &positions, &slots, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->size(0) == input_ids.size(0) &&
                    t->is_contiguous(),
                "input_ids, positions, slots and context_lens must be contiguous int64 [B]");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < input_ids.size(0); ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_.size(0), "position ", pos[b], " outside the rotary table");
  }
}

torch::Tensor DecodeStack::logits(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                  const torch::Tensor& slots, const torch::Tensor& block_tables,
                                  const torch::Tensor& context_lens) const {
  TORCH_CHECK(lm_head_.has_value(), "the stack has no LM head (set_lm_head)");
  check_step_inputs(input_ids, positions, slots, context_lens);
  if (takes_one_region(input_ids.size(0)) && lm_head_->batch1_supported()) {
    auto logits = forward_batch1(input_ids, positions, slots, block_tables, context_lens, &*lm_head_);
    if (logits.defined()) return logits;
  }
  return (*lm_head_)(hidden_states(input_ids, positions, slots, block_tables, context_lens));
}

// input_ids, positions, slots [B]; block_tables [B, max_blocks]; context_lens [B] (all int64)
// -> the final-normed hidden states [B, hidden]. Writes each layer's new K/V at `slots`.
torch::Tensor DecodeStack::forward(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                  const torch::Tensor& slots, const torch::Tensor& block_tables,
                                  const torch::Tensor& context_lens) const {
  check_step_inputs(input_ids, positions, slots, context_lens);
  return hidden_states(input_ids, positions, slots, block_tables, context_lens);
}

torch::Tensor DecodeStack::hidden_states(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                         const torch::Tensor& slots, const torch::Tensor& block_tables,
                                         const torch::Tensor& context_lens) const {
  const int64_t B = input_ids.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  if (takes_one_region(B)) {
    auto x = forward_batch1(input_ids, positions, slots, block_tables, context_lens);
    if (x.defined()) return x;
  }
  const int64_t q_size = H_ * D_, kv_size = KVH_ * D_;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D_));
  auto x = embedding_.index_select(0, input_ids);
  for (const Layer& layer : layers_) {
    auto qkv = layer.qkv(rms_norm(x, layer.input_norm, eps_));
    float* rows = qkv.data_ptr<float>();
    const int64_t row_stride = qkv.size(1);
    rotate(rows, row_stride, pos, B, H_ + KVH_, D_, cos_.data_ptr<float>(), sin_.data_ptr<float>());
    write_kv(rows, row_stride, q_size, kv_size, slot, B, layer);
    auto query = qkv.narrow(1, 0, q_size).view({B, H_, D_});
    auto attended = paged_decode_attention(query, layer.k_cache, layer.v_cache, block_tables, context_lens, scale);
    x.add_(layer.o(attended.view({B, q_size})));
    x.add_(layer.down(silu_and_mul(layer.gate_up(rms_norm(x, layer.post_attention_norm, eps_)))));
  }
  return rms_norm(x, final_norm_, eps_);
}

void DecodeStack::write_kv(const float* rows, int64_t row_stride, int64_t q_size, int64_t kv_size,
                           const int64_t* slot, int64_t B, const Layer& layer) const {
  const int64_t num_slots = layer.k_cache.size(0) * layer.k_cache.size(1);
  with_cache_type(layer.k_cache, [&](auto element) {
    using T = decltype(element);
    T* ks = cache_data<T>(layer.k_cache);
    T* vs = cache_data<T>(layer.v_cache);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "KV slot ", slot[b], " outside the cache");
      const float* k = rows + b * row_stride + q_size;
      std::transform(k, k + kv_size, ks + slot[b] * kv_size, from_float<T>);
      std::transform(k + kv_size, k + 2 * kv_size, vs + slot[b] * kv_size, from_float<T>);
    }
  });
}

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Linear>(m, "Linear", "a projection: kind 'dense' [weight], 'int8' [q, scale] or 'int4' [packed, scale, low]")
      .def(py::init<std::string, std::vector<torch::Tensor>, std::optional<torch::Tensor>>(), py::arg("kind"),
           py::arg("weights"), py::arg("bias"))
      .def("__call__", &Linear::operator());
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step of a Llama-family decoder, embedding to final norm")
      .def(py::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("embedding"),
           py::arg("cos"), py::arg("signed_sin"), py::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_lm_head", &DecodeStack::set_lm_head)
      .def_property_readonly("has_lm_head", &DecodeStack::has_lm_head)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("logits", &DecodeStack::logits, py::call_guard<py::gil_scoped_release>())
      .def_readwrite("one_region_batch1", &DecodeStack::one_region_batch1)
      .def_property_readonly("batch1_supported", &DecodeStack::batch1_supported)
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}

}  // namespace pdserve
