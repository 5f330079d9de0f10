// The pooled indexer's paged key pooling on CUDA (indexcache/kpool_pool.h; reference.py's
// kpool_pool_paged defines it). Torch-free kernel and launch code; the op glue is in kpool_pool.cu.
//
// kpool_pool_kernel: CTA (b, y) pools request b's completing pools j = done + y, done + y + kSplit,
// ... (done = ctx_lens[b] / P), kThreads threads, each owning channels c = tid, tid + kThreads, ..:
// the max of gate + ape over the pool's P tokens, then sum_t e_t and sum_t e_t k_t (expf, fmaf)
// with t ascending, as the CPU's portable loop; no atomics on data, so deterministic. A NaN or
// +inf logit makes its channel NaN (as torch's softmax).
//
// Invalid values (no host check unless INDEXCACHE_CHECK=1): a request with a negative length or
// more completed positions than its table row holds is skipped; a pool whose block id is outside
// [0, num_blocks) is skipped. Each counts once in the device's error word (kernels.h DeviceEnv::err).
#pragma once

#include <climits>
#include <cstdint>

#include "common.cuh"
#include "indexcache/fp8.h"
#include "indexcache/kpool_pool.h"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace kp_detail {

constexpr int kThreads = 128;
constexpr int kSplit = 16;  // CTAs per request, striding over its completing pools

__device__ __forceinline__ float load_v(const void* base, int64_t i, DType dt) {
  return dt == DType::kFloat32 ? static_cast<const float*>(base)[i] : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

__global__ void __launch_bounds__(kThreads) kpool_pool_kernel(KpoolPoolParams p, int32_t* err) {
  const int64_t b = blockIdx.x, y = blockIdx.y;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t ctx = p.ctx_lens[b], q = p.q_lens[b];
  const int64_t done = ctx / p.P, total = (ctx + q) / p.P;
  if (ctx < 0 || q < 0 || (total > done && total * p.P > p.max_blocks * p.block_size)) {
    if (y == 0 && tid == 0) count_error(err);
    return;
  }
  const int64_t w = 2 * p.d, per_block = p.block_size / p.P;
  for (int64_t j = done + y; j < total; j += kSplit) {
    const int64_t first = j * p.P, blk = p.block_table[b * p.max_blocks + first / p.block_size];
    if (blk < 0 || blk >= p.num_blocks) {
      if (tid == 0) count_error(err);
      continue;
    }
    const int64_t row = first % p.block_size, raw0 = (blk * p.block_size + row) * w;
    const int64_t out0 = (blk * per_block + row / p.P) * p.d;
    for (int64_t c = tid; c < p.d; c += kThreads) {
      float mx = -INFINITY;
      for (int64_t i = 0; i < p.P; ++i) {
        const float l = load_v(p.raw, raw0 + i * w + p.d + c, p.raw_dtype) + load_v(p.ape, i * p.d + c, p.ape_dtype);
        mx = l > mx ? l : mx;  // a NaN logit is skipped here and makes its e NaN below
      }
      float sum = 0.f, num = 0.f;
      for (int64_t i = 0; i < p.P; ++i) {
        const float l = load_v(p.raw, raw0 + i * w + p.d + c, p.raw_dtype) + load_v(p.ape, i * p.d + c, p.ape_dtype);
        const float e = expf(l - mx);
        sum += e;
        num = fmaf(e, load_v(p.raw, raw0 + i * w + c, p.raw_dtype), num);
      }
      const float v = num / sum;
      if (p.pool_dtype == DType::kFloat32)
        static_cast<float*>(p.pool)[out0 + c] = v;
      else
        static_cast<uint16_t*>(p.pool)[out0 + c] = float_to_bf16(v);
    }
  }
}

}  // namespace kp_detail

inline void kpool_pool_cuda(const KpoolPoolParams& p, const DeviceEnv& env) {
  using namespace kp_detail;
  if (p.B == 0 || p.d == 0) return;
  TORCH_CHECK(p.B <= INT_MAX, "kpool_pool_paged: batch ", p.B, " is too many for one CUDA launch");
  IC_LAUNCH(kpool_pool_kernel, dim3(static_cast<unsigned>(p.B), kSplit), kThreads, 0, env.stream, p, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
