// The Python module of the CPU kernels (pdserve/engine/cpu_kernels/__init__.py loads it).
#include <torch/extension.h>

namespace pdserve {
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low);
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale);
void bind_decode_stack(pybind11::module& m);
}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &pdserve::int8_linear, "y = x @ (q * scale).T for at most 64 rows of float32 x");
  m.def("int4_linear", &pdserve::int4_linear, "y = x @ w.T, w in int4 groups of 32, for at most 64 rows of float32 x");
  m.def("paged_decode_attention", &pdserve::paged_decode_attention,
        "one query token per sequence attending to its context in the paged KV cache, read in place");
  pdserve::bind_decode_stack(m);
}
