// The gated delta rule on CPU (indexcache/delta_rule.h; reference.py's delta_rule defines it).
//
// One task per (sequence, value head), spread over the threads by at::parallel_for; a task
// owns its state row, so tasks never share a write and the result does not depend on the
// thread count. A sequence of at least kMinChunked tokens copies its state row into a padded
// fp32 tile and runs chunks of 64 tokens (delta_rule_impl.h: the UT-transform triangular solve
// within a chunk, matmul-shaped updates between chunks), then writes the row back; a shorter
// one (decode: one token per sequence, or a few draft tokens) runs the recurrence token by
// token straight on the state row in memory.
//
// ISA paths: the bodies are compiled three times: portable (baseline x86-64 / any CPU), AVX2+FMA
// (the avx2 path) and AVX-512 (the avx512bf16 path; blas has none of its own and goes on to
// it); isa.h's cpu_op_path(CpuOp::kDeltaRule, dtype) picks one at run time.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../delta_rule_checks.h"
#include "indexcache/delta_rule.h"
#include "isa.h"
#include "registry.h"

namespace indexcache {
namespace {

// Below this many tokens a sequence runs the recurrence (docs/performance.md: the crossover).
constexpr int64_t kMinChunked = 16;

#define IC_DELTA_RULE_DRIVER                                                                               \
  void delta_rule(const DeltaRuleParams& p) {                                                              \
    const int64_t es = p.dtype == DType::kFloat32 ? 4 : 2, group = p.h_v / p.h_k;                          \
    const int64_t gw = p.g_per_channel ? p.d_k : 1;                                                        \
    at::parallel_for(0, p.batch * p.h_v, 1, [&](int64_t w0, int64_t w1) {                                  \
      Work w;                                                                                              \
      w.init(p.d_k, p.d_v);                                                                                \
      for (int64_t task = w0; task < w1; ++task) {                                                         \
        const int64_t b = task / p.h_v, h = task % p.h_v, hk = h / group;                                  \
        const int64_t start = p.cu_seqlens[b], len = p.cu_seqlens[b + 1] - start;                          \
        if (len <= 0) continue;                                                                            \
        TaskRef r;                                                                                         \
        r.q = static_cast<const char*>(p.q) + (start * p.q_stride + hk * p.d_k) * es;                      \
        r.k = static_cast<const char*>(p.k) + (start * p.k_stride + hk * p.d_k) * es;                      \
        r.v = static_cast<const char*>(p.v) + (start * p.v_stride + h * p.d_v) * es;                       \
        r.g = p.g + (start * p.h_v + h) * gw;                                                              \
        r.beta = p.beta + start * p.h_v + h;                                                               \
        r.out = static_cast<char*>(p.out) + (start * p.h_v + h) * p.d_v * es;                              \
        r.q_step = p.q_stride * es;                                                                        \
        r.k_step = p.k_stride * es;                                                                        \
        r.v_step = p.v_stride * es;                                                                        \
        r.g_step = p.h_v * gw;                                                                             \
        r.b_step = p.h_v;                                                                                  \
        r.o_step = p.h_v * p.d_v * es;                                                                     \
        float* s = p.state + (static_cast<int64_t>(p.state_indices[b]) * p.h_v + h) * p.d_k * p.d_v;       \
        if (len < kMinChunked) {                                                                           \
          run_recurrent(p, w, r, s, 0, len);                                                               \
          continue;                                                                                        \
        }                                                                                                  \
        for (int64_t c = 0; c < p.d_k; ++c) std::memcpy(&w.S[c * w.dvp], s + c * p.d_v, 4 * p.d_v);        \
        for (int64_t t0 = 0; t0 < len; t0 += kChunk) run_chunk(p, w, r, t0, std::min(kChunk, len - t0));   \
        for (int64_t c = 0; c < p.d_k; ++c) std::memcpy(s + c * p.d_v, &w.S[c * w.dvp], 4 * p.d_v);        \
      }                                                                                                    \
    });                                                                                                    \
  }

#define IC_VEC_BYTES 16
namespace portable {
#include "delta_rule_impl.h"
IC_DELTA_RULE_DRIVER
}  // namespace portable

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#undef IC_VEC_BYTES
#define IC_VEC_BYTES 32
namespace avx2 {
#include "delta_rule_impl.h"
IC_DELTA_RULE_DRIVER
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#undef IC_VEC_BYTES
#define IC_VEC_BYTES 64
namespace avx512 {
#include "delta_rule_impl.h"
IC_DELTA_RULE_DRIVER
}  // namespace avx512
#pragma GCC pop_options
#endif

void delta_rule_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, at::Tensor& state, const at::Tensor& cu_seqlens,
                   const at::Tensor& state_indices, double scale, at::Tensor& out) {
  delta_rule_cpu(delta_rule_checks::make_delta_rule_params(q, k, v, g, beta, state, cu_seqlens, state_indices, scale,
                                                           out, true));
}

}  // namespace

void register_delta_rule_cpu(torch::Library& m) { m.impl("delta_rule", &delta_rule_op); }

void delta_rule_cpu(const DeltaRuleParams& p) {
  if (p.batch == 0 || p.T == 0) return;
#if defined(__x86_64__)
  const CpuPath path = cpu_op_path(CpuOp::kDeltaRule, p.dtype);
  if (path == CpuPath::kAvx512Bf16) return avx512::delta_rule(p);
  if (path == CpuPath::kAvx2) return avx2::delta_rule(p);
#endif
  portable::delta_rule(p);
}

}  // namespace indexcache
