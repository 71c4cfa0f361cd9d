// A batch-1 decode step with integer projections in one parallel region.
//
// DecodeStack::forward runs a step as ~6 parallel regions a layer (each GEMV, attention and its
// merge), with the norms, rotary, KV write, residual adds and activation between them on the
// calling thread, each through a torch tensor. At batch 1 with int8 weights on two AMD EPYC Zen 3
// cores, perf put the second thread idle 33% of a step: waiting for the next region while the
// first ran that serial code (and torch's allocations and dispatch, 13% of the first thread's
// samples), or for the first thread at a region's end. Here one region spans the step: the
// threads split each matrix's rows as at::parallel_for splits them, and the serial parts run
// between barriers, in buffers allocated once a step. The arithmetic is the other path's, op
// for op (the same row functions, the same attention plan and merge), so the result is the same
// bits (test_cpu_decode.py compares them).
//
//   per layer:  [each] h = norm(x), round h  |  [all] qkv rows  |  [one] rotate, write K/V
//               [all] attention shares  |  [each] merge the shares, round the result
//               [all] o rows, x += own rows  |  [each] h = norm(x), round h  |  [all] gate_up rows
//               [each] act = silu(g) * u, round act  |  [all] down rows, x += own rows
//   then, with a (quantized) LM head:  [each] h = final norm(x), round h  |  [all] the head's rows
//
// The head in the region, not as its own call after it (the final norm and the head's input
// rounded through torch, Python's wrapping of the call, a second region): on the Zen 3, alternating
// the two in one engine, an int4 step took 0.97x the time, an int8 step 0.985x (docs/benchmarks.md,
// thirty-first pass).
//
// [one]: one thread while the others wait at a barrier. [each]: every thread computes the same
// values into buffers of its own, so six barriers a layer, not nine, and no thread waits through
// the roundings and norms: on the Zen 3 this stack took ~0.99x the time (int4; int8
// 0.97-0.99x), alternating in one engine (docs/benchmarks.md, twenty-ninth pass).

#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <cmath>
#include <vector>

namespace pdserve {

namespace {

// Thread `tid`'s part [begin, end) of [0, n), as at::parallel_for(0, n, grain) gives it out with
// `threads` threads (OpenMP backend).
struct Share {
  int64_t begin, end;
};
Share share_of(int64_t n, int64_t grain, int64_t tid, int64_t threads) {
  if (n <= grain || threads == 1) return tid == 0 ? Share{0, n} : Share{0, 0};
  const int64_t used = std::min(threads, (n + grain - 1) / grain);
  const int64_t chunk = (n + used - 1) / used;
  const int64_t begin = std::min(n, tid * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// The step's activations that the threads share, allocated once per step: each projection's
// output, whose rows the threads write in shares.
struct Buffers {
  explicit Buffers(int64_t hidden, int64_t qkv, int64_t gate_up) : qkv(qkv), projected(hidden), gate_up(gate_up) {}
  std::vector<float> qkv, projected, gate_up;
};

// What each thread computes for itself between the projections: the same values on every thread.
struct OwnBuffers {
  OwnBuffers(int64_t hidden, int64_t q_size, int64_t intermediate) : h(hidden), attended(q_size), act(intermediate) {}
  std::vector<float> h, attended, act;
  RoundedRows rounded;  // the input of the next projection
};

}  // namespace

torch::Tensor DecodeStack::forward_batch1(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                          const torch::Tensor& slots, const torch::Tensor& block_tables,
                                          const torch::Tensor& context_lens, const Linear* head) const {
  const auto tables = block_tables.contiguous();
  const int64_t pos = positions.data_ptr<int64_t>()[0], slot = slots.data_ptr<int64_t>()[0];
  // Every check before the region: an exception may not leave it.
  for (const Layer& layer : layers_) {
    check_attention_shapes(layer.k_cache, tables, context_lens, 1, H_, D_);
    TORCH_CHECK(slot >= 0 && slot < layer.k_cache.size(0) * layer.k_cache.size(1), "KV slot ", slot,
                " outside the cache");
  }
  if (layers_.empty()) return {};
  for (const Layer& layer : layers_) {  // the buffers take the first layer's sizes
    if (layer.qkv.rows() != layers_[0].qkv.rows() || layer.gate_up.rows() != layers_[0].gate_up.rows()) return {};
  }
  auto x = embedding_.index_select(0, input_ids);
  const int64_t hidden = x.size(1), q_size = H_ * D_, kv_size = KVH_ * D_, threads = at::get_num_threads();
  float* xs = x.data_ptr<float>();
  Buffers buffers(hidden, layers_[0].qkv.rows(), layers_[0].gate_up.rows());
  DecodeAttention attention(context_lens.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), 1, tables.size(1), H_, D_,
                            threads, 1.0 / std::sqrt(static_cast<double>(D_)));
  // Every thread rounds the same values, so all of them find the same entry not finite and leave
  // the layer loop at the same point; each says so here.
  std::atomic<bool> finite{true};
  torch::Tensor logits = head != nullptr ? torch::empty({1, head->rows()}, x.options()) : torch::Tensor();

#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    Buffers& b = buffers;
    OwnBuffers own(hidden, q_size, layers_[0].gate_up.rows() / 2);
    // Rows [begin, end) of `linear` applied to own.rounded into y; with `residual`, then x += y there.
    auto project = [&](const Linear& linear, float* y, bool residual) {
      const Share share = share_of(linear.rows(), kBatch1Grain, tid, team);
      linear.batch1_rows(own.rounded, y, share.begin, share.end);
      if (residual) {
        for (int64_t n = share.begin; n < share.end; ++n) xs[n] += y[n];
      }
    };
    // `values` rounded for `linear`, then its rows into y. False where an entry is not finite.
    auto round_then_project = [&](const float* values, int64_t K, const Linear& linear, float* y, bool residual) {
      if (!linear.round_input(values, K, own.rounded)) {
        finite = false;
        return false;
      }
      project(linear, y, residual);
      return true;
    };
    auto norm_then_project = [&](const torch::Tensor& norm, const Linear& linear, float* y) {
      rms_norm_row(xs, norm.data_ptr<float>(), own.h.data(), hidden, eps_);
      return round_then_project(own.h.data(), hidden, linear, y, false);
    };
    for (const Layer& layer : layers_) {
      if (!norm_then_project(layer.input_norm, layer.qkv, b.qkv.data())) break;
#pragma omp barrier
#pragma omp single
      {
        const int64_t row_stride = static_cast<int64_t>(b.qkv.size());
        rotate(b.qkv.data(), row_stride, &pos, 1, H_ + KVH_, D_, cos_.data_ptr<float>(), sin_.data_ptr<float>());
        write_kv(b.qkv.data(), row_stride, q_size, kv_size, &slot, 1, layer);
      }
      const Share shares = share_of(attention.num_shares(), 1, tid, team);
      attention.attend(b.qkv.data(), layer.k_cache, layer.v_cache, shares.begin, shares.end);
#pragma omp barrier
      attention.merge(own.attended.data(), 0, H_);
      if (!round_then_project(own.attended.data(), q_size, layer.o, b.projected.data(), true)) break;
#pragma omp barrier
      if (!norm_then_project(layer.post_attention_norm, layer.gate_up, b.gate_up.data())) break;
#pragma omp barrier
      const int64_t intermediate = static_cast<int64_t>(own.act.size());
      silu_and_mul_row(b.gate_up.data(), own.act.data(), intermediate);
      if (!round_then_project(own.act.data(), intermediate, layer.down, b.projected.data(), true)) break;
#pragma omp barrier
    }
    // After the last layer's barrier x is whole; a thread that left the loop early left it with
    // all the others (see `finite`).
    if (head != nullptr && finite) {
      rms_norm_row(xs, final_norm_.data_ptr<float>(), own.h.data(), hidden, eps_);
      round_then_project(own.h.data(), hidden, *head, logits.data_ptr<float>(), false);
    }
  }
  // An entry that is not finite: the float loops of the per-operation path propagate it as torch
  // would. That path recomputes the step from the embedding and rewrites every layer's K/V.
  if (!finite) return {};
  return head != nullptr ? logits : rms_norm(x, final_norm_, eps_);
}

}  // namespace pdserve
