// The kernels each source defines and the others (and the Python bindings) call.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

namespace pdserve {

// Where prefetch_rows brings weight rows (__builtin_prefetch's locality). The batch-1 integer int8
// loop only streams the rows by: to L2 (prefetcht1), since on two Xeon cores prefetcht0 held a batch-1 int8
// step at 7.7 ms and prefetcht1 gave 6.4-6.9 (cold GEMVs 17-20 -> 19-24 GB/s; prefetchnta: 14 ms).
// The loops that compute long on each row (batches, int4, the float fallbacks) keep L1: the LM
// head at 32 rows ran 15-20% faster so, and int4 at batch 1 showed no difference
// (docs/benchmarks.md, "Intel Xeon, sixth pass").
enum class PrefetchTo : int { kL2 = 2, kL1 = 3 };

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

// quantized_gemv.cpp
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low);
// int8_panels.cpp: rows of x already rounded to int16 (one scale each) against int8 weights;
// false where the CPU lacks AVX2
bool int8_linear_panels(const int16_t* xq, const float* x_scales, const int8_t* qs, const float* scales, float* ys,
                        int64_t M, int64_t N, int64_t K);
// paged_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale);
// decode_stack.cpp: its Linear and DecodeStack classes
void bind_decode_stack(pybind11::module& m);

}  // namespace pdserve
