// The Python module of the CPU kernels (pdserve/engine/cpu_kernels/__init__.py loads it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: a node's event loop (token streams, health checks) runs during a prefill.
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("dense_linear", &pdserve::dense_linear, "y = x @ w.T for float32 w; a few rows of x stream w once", no_gil());
  m.def("int8_linear", &pdserve::int8_linear, "y = x @ (q * scale).T for any number of rows of float32 x", no_gil());
  m.def("int8_bfloat16_linear", &pdserve::int8_bfloat16_linear,
        "float(x @ q.T) * scale for bfloat16 x (prefill chunks), by torch's bfloat16 matmul", no_gil());
  m.def("rms_norm", &pdserve::rms_norm, "w * (x * rsqrt(mean(x^2) + eps)) by rows of float32 x", no_gil());
  m.def("silu_and_mul", &pdserve::silu_and_mul, "silu(gate) * up for float32 rows laid out [gate | up]", no_gil());
  m.def("int4_linear", &pdserve::int4_linear, "y = x @ w.T, w in int4 groups of 32, for at most 64 rows of float32 x",
        no_gil());
  m.def("int4_dequantize", &pdserve::int4_dequantize, "q * scale + low as float32, or bfloat16 if asked", no_gil());
  m.def("paged_decode_attention", &pdserve::paged_decode_attention,
        "one query token per sequence attending to its context in the paged KV cache, read in place", no_gil());
  m.def(
      "set_hardware_prefetch", [](bool on) { pdserve::g_hardware_prefetch = on; },
      "batch-1 int8 weight streams: left to the hardware prefetchers (True), or prefetched ahead");
  m.attr("int4_batch1_input_bits") = pdserve::kInt4ByteInputs ? 8 : 16;  // x's rounding at batch 1 (tests)
  m.def("hardware_prefetch", &pdserve::hardware_prefetch_suffices, "what set_hardware_prefetch set");
  pdserve::bind_decode_stack(m);
}
