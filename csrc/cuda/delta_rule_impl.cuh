// The gated delta rule on CUDA (indexcache/delta_rule.h; reference.py's delta_rule defines it).
// Torch-free kernel and launch code; the op glue is in delta_rule.cu.
//
// delta_rule_kernel: one CTA per (sequence, value head, tile of kCols value columns), kCols
// threads, one per column. The columns of the state evolve independently (column j's update
// reads only S[:, j], k_t, q_t, the decay and v_t[j]), so a CTA owns its [d_k, kCols] tile of
// the state row in shared memory for the whole sequence and walks the tokens in order: the
// token's q, k and decay exp(g) are staged in shared memory (two barriers per token), then each
// thread decays its column and forms pred = S^T k (one fmaf chain over d_k), u = beta (v - pred),
// adds k u and forms o = scale S^T q. fp32 throughout, fixed orders, no atomics on data: the
// result is deterministic. Plain FMA code (no tensor cores): the recurrent form, which is also
// what decode (one token per sequence, many sequences) wants.
//
// Invalid values (no host check unless INDEXCACHE_CHECK=1): a sequence whose token range is not
// 0 <= cu_seqlens[b] <= cu_seqlens[b+1] <= T is skipped; one whose state row is outside
// [0, n_slots) or already taken by an earlier sequence of the batch writes o = 0 and leaves the
// state alone. Each counts once in the device's error word (kernels.h DeviceEnv::err).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common.cuh"
#include "indexcache/delta_rule.h"
#include "indexcache/fp8.h"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace dr_detail {

constexpr int kCols = 64;  // value columns (= threads) per CTA

__device__ __forceinline__ float load_x(const void* base, int64_t i, bool f32) {
  return f32 ? static_cast<const float*>(base)[i] : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

__global__ void __launch_bounds__(kCols) delta_rule_kernel(DeltaRuleParams p, int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  const int64_t dk = p.d_k;
  float* S = reinterpret_cast<float*>(smem_raw);  // [d_k][kCols]
  float* qs = S + dk * kCols;                     // [d_k]
  float* ks = qs + dk;                            // [d_k]
  float* as = ks + dk;                            // [d_k] exp(g_t)
  const int64_t b = blockIdx.x / p.h_v, h = blockIdx.x % p.h_v, hk = h / (p.h_v / p.h_k);
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kCols + tid;
  const bool col = j < p.d_v;
  const bool counter = h == 0 && blockIdx.y == 0 && tid == 0;  // counts the sequence's errors once
  const int64_t c0 = p.cu_seqlens[b], c1 = p.cu_seqlens[b + 1];
  if (!(0 <= c0 && c0 <= c1 && c1 <= p.T)) {
    if (counter) count_error(err);
    return;
  }
  const int32_t slot = p.state_indices[b];
  // Taken by an earlier sequence? The CTA's threads split the scan (decode calls have many
  // sequences); any finder sets the flag (the same value from every writer).
  __shared__ int taken;
  if (tid == 0) taken = 0;
  __syncthreads();
  for (int64_t e = tid; e < b; e += kCols)
    if (p.state_indices[e] == slot) taken = 1;
  __syncthreads();
  const bool ok = slot >= 0 && slot < p.n_slots && taken == 0;
  const bool f32 = p.dtype == DType::kFloat32;
  if (!ok) {
    if (counter) count_error(err);
    if (col)
      for (int64_t t = c0; t < c1; ++t) {
        const int64_t oi = (t * p.h_v + h) * p.d_v + j;
        if (f32) {
          static_cast<float*>(p.out)[oi] = 0.f;
        } else {
          static_cast<uint16_t*>(p.out)[oi] = 0;
        }
      }
    return;
  }
  float* srow = p.state + (static_cast<int64_t>(slot) * p.h_v + h) * dk * p.d_v;
  if (col)
    for (int64_t c = 0; c < dk; ++c) S[c * kCols + tid] = srow[c * p.d_v + j];
  const int64_t gw = p.g_per_channel ? dk : 1;
  for (int64_t t = c0; t < c1; ++t) {
    __syncthreads();  // the previous token's vectors are no longer read
    const float* g = p.g + (t * p.h_v + h) * gw;
    for (int64_t c = tid; c < dk; c += kCols) {
      qs[c] = load_x(p.q, t * p.q_stride + hk * dk + c, f32);
      ks[c] = load_x(p.k, t * p.k_stride + hk * dk + c, f32);
      as[c] = expf(g[p.g_per_channel ? c : 0]);
    }
    __syncthreads();
    if (!col) continue;
    float pred = 0.f;
    for (int64_t c = 0; c < dk; ++c) {
      const float x = S[c * kCols + tid] * as[c];
      S[c * kCols + tid] = x;
      pred = fmaf(ks[c], x, pred);
    }
    const float u = (load_x(p.v, t * p.v_stride + h * p.d_v + j, f32) - pred) * p.beta[t * p.h_v + h];
    float o = 0.f;
    for (int64_t c = 0; c < dk; ++c) {
      const float x = fmaf(ks[c], u, S[c * kCols + tid]);
      S[c * kCols + tid] = x;
      o = fmaf(qs[c], x, o);
    }
    const int64_t oi = (t * p.h_v + h) * p.d_v + j;
    if (f32) {
      static_cast<float*>(p.out)[oi] = o * p.scale;
    } else {
      static_cast<uint16_t*>(p.out)[oi] = float_to_bf16(o * p.scale);
    }
  }
  if (col)
    for (int64_t c = 0; c < dk; ++c) srow[c * p.d_v + j] = S[c * kCols + tid];
}

inline int64_t smem_bytes(const DeltaRuleParams& p) { return 4 * (p.d_k * kCols + 3 * p.d_k); }

}  // namespace dr_detail

inline void delta_rule_cuda(const DeltaRuleParams& p, const DeviceEnv& env) {
  using namespace dr_detail;
  if (p.batch == 0 || p.T == 0) return;
  const int64_t ctas = p.batch * p.h_v, tiles = (p.d_v + kCols - 1) / kCols;
  TORCH_CHECK(ctas <= INT_MAX && tiles <= 65535, "delta_rule: batch x h_v = ", ctas, " and d_v = ", p.d_v,
              " are too many for one CUDA launch");
  const int64_t bytes = smem_bytes(p), budget = static_cast<int64_t>(env.smem_optin) - 64;
  TORCH_CHECK(bytes <= budget, "delta_rule on CUDA needs ", bytes, " bytes of shared memory for d_k = ", p.d_k,
              "; the device allows ", budget);
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(delta_rule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  IC_LAUNCH(delta_rule_kernel, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(tiles)), kCols, bytes,
            env.stream, p, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
