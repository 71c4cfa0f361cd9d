// int8 weights against a prefill chunk where the CPU multiplies bfloat16 in hardware (AMX or
// AVX512-BF16): y = float(x_bf16 @ q_bf16.T) * scale, the product by torch's own bfloat16 matmul.
//
// torch's conversions around that matmul cost nearly as much as it did: for a 210-token chunk on
// two Xeon cores, q.bfloat16() took 197 us and y.float() * scale 225 us beside the 3072 x 576
// matmul's 605 us. Both ends are simple here, and one pass each over all threads: an int8 is
// exact in bfloat16 (at most 8 significant bits, so its float's low 16 bits are zero), and a
// bfloat16 is a float's high 16 bits. So the results are torch's to the bit.
#include "kernels.h"
#include <ATen/Parallel.h>

namespace pdserve {

namespace {

// An int8 is exact in bfloat16, so its float's high half is the bfloat16 (no rounding needed).
inline BFloat16 int8_as_bfloat16(int8_t q) {
  const float value = static_cast<float>(q);
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof bits);
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

torch::Tensor widened_to_bfloat16(const torch::Tensor& q) {
  auto weight = torch::empty(q.sizes(), q.options().dtype(torch::kBFloat16));
  const int8_t* source = q.data_ptr<int8_t>();
  auto* target = reinterpret_cast<BFloat16*>(weight.data_ptr<at::BFloat16>());
  at::parallel_for(0, q.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) target[i] = int8_as_bfloat16(source[i]);
  });
  return weight;
}

// float(y) * scale[n], row by row over all threads.
torch::Tensor scaled_to_float(const torch::Tensor& y, const torch::Tensor& scale) {
  const int64_t M = y.size(0), N = y.size(1);
  auto out = torch::empty({M, N}, y.options().dtype(torch::kFloat32));
  const auto* source = reinterpret_cast<const BFloat16*>(y.data_ptr<at::BFloat16>());
  const float* scales = scale.data_ptr<float>();
  float* target = out.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t n = 0; n < N; ++n) target[m * N + n] = to_float(source[m * N + n]) * scales[n];
    }
  });
  return out;
}

}  // namespace

torch::Tensor int8_bfloat16_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [rows, in] bfloat16");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(q.size(1) == x.size(1), "x has ", x.size(1), " inputs, the weights ", q.size(1));
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == q.size(0),
              "one float32 scale per output");
  auto y = at::linear(x, widened_to_bfloat16(q)).contiguous();
  return scaled_to_float(y, scale);
}

}  // namespace pdserve
