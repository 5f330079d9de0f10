// CUDA indexer at head widths other than the tiled kernels' 128 (indexer_impl.cuh): the key-pooled
// (GLM-5.3-Flash index_head_dim) and QSA (Qwen3.8-Flash-Next indexer_head_dim) indexers, d even
// and <= kMaxIndexerHeadDim. Torch-free; included by indexer_impl.cuh, whose entry points route
// d != 128 here.
//
// A plain kernel, correct before fast: a CTA (128 threads) scores one query row against a tile of
// 32 keys staged as fp32 in shared memory ([32][d + 1], conflict-free columns); thread t takes key
// t % 32 and the heads h = t / 32 (mod 4), the four head-group partials are added in a fixed order
// (deterministic). fp8 and bf16 values are widened exactly to fp32, all sums are fp32 FMAs.
// The fused op scores a bounded chunk of rows (kScratchBudget bytes of scores, never s_q * s_kv)
// into a temporary and selects with the top-k kernels (topk_impl.cuh), chunk after chunk.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace any_detail {

constexpr int kThreads = 128;
constexpr int kKeys = 32;                     // keys per CTA tile
constexpr int kGroups = kThreads / kKeys;     // head groups
constexpr int kLd = kMaxIndexerHeadDim + 1;   // fp32 key row stride in shared memory
constexpr int64_t kScratch = 256ll << 20;     // bytes of scores one fused chunk may hold
constexpr int64_t kMaxGridY = 65535;          // rows per launch (gridDim.y)

struct AnyArgs {
  const void* q;         // [s_q, h, d] dt
  const void* k;         // [s_kv, d] dt
  const float* k_scale;  // [s_kv] or nullptr
  const float* w;        // [s_q, h]
  const int32_t* lo;     // [s_q] sanitized window starts
  const int32_t* hi;     // [s_q] sanitized window ends
  int64_t s_kv, h, d;
  int64_t row0;          // first row of this launch
};

__device__ __forceinline__ float widen(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float widen(const uint16_t* p, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
}
__device__ __forceinline__ float widen(const uint8_t* p, int64_t i) { return e4m3_to_float(p[i]); }

// Grid (key tiles, rows of this launch). Writes row (row0 + blockIdx.y)'s columns of the tile:
// the score inside the row's window, -inf outside it (and nothing at or past o.cols).
template <typename Elem>
__global__ void __launch_bounds__(kThreads) indexer_logits_any_kernel(AnyArgs a, LogitsOut o) {
  __shared__ float kt[kKeys * kLd];
  __shared__ float part[kGroups][kKeys];
  const int64_t r = a.row0 + blockIdx.y;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t lo = a.lo[r], hi = a.hi[r];
  float* dst = o.logits + (r - a.row0) * o.stride;
  const int t = static_cast<int>(threadIdx.x), j = t % kKeys, g = t / kKeys;
  const float ninf = -__int_as_float(0x7f800000);
  if (s0 >= hi || s0 + kKeys <= lo) {  // the whole tile is outside the window
    if (t < kKeys && s0 + t < o.cols) dst[s0 + t] = ninf;
    return;
  }
  const Elem* k = static_cast<const Elem*>(a.k);
  for (int64_t i = t; i < kKeys * a.d; i += kThreads) {
    const int64_t jj = i / a.d, c = i % a.d, s = s0 + jj;
    kt[jj * kLd + c] = s < a.s_kv ? widen(k, s * a.d + c) : 0.f;
  }
  __syncthreads();
  const Elem* q = static_cast<const Elem*>(a.q) + r * a.h * a.d;
  const float* w = a.w + r * a.h;
  const float* kr = kt + j * kLd;
  float acc = 0.f;
  for (int64_t hh = g; hh < a.h; hh += kGroups) {
    float dot = 0.f;
    for (int64_t c = 0; c < a.d; ++c) dot = fmaf(widen(q, hh * a.d + c), kr[c], dot);
    acc = fmaf(relu_nan(dot), w[hh], acc);
  }
  part[g][j] = acc;
  __syncthreads();
  if (t < kKeys) {
    const int64_t s = s0 + t;
    if (s >= o.cols) return;
    float v = ((part[0][t] + part[1][t]) + part[2][t]) + part[3][t];
    if (a.k_scale != nullptr && s < a.s_kv) v *= a.k_scale[s];
    dst[s] = (s >= lo && s < hi) ? v : ninf;
  }
}

// Rows [row0, row0 + rows) into o (o's row 0 is row0), launched in gridDim.y pieces.
inline void launch_any(const IndexerParams& p, const int32_t* lo, const int32_t* hi, int64_t row0, int64_t rows,
                       const LogitsOut& o, const DeviceEnv& env) {
  const int64_t tiles = (o.cols + kKeys - 1) / kKeys;
  if (rows <= 0 || tiles <= 0) return;
  TORCH_CHECK(tiles <= 0x7fffffff, "too many keys for the CUDA indexer: ", o.cols);
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGridY) {
    const int64_t n = std::min(kMaxGridY, rows - r0);
    const AnyArgs a{p.q, p.k, p.k_scale, p.weights, lo, hi, p.s_kv, p.h, p.d, row0 + r0};
    const LogitsOut oo{o.logits + r0 * o.stride, o.stride, o.cols};
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(n));
    if (p.qk_dtype == DType::kFloat32) {
      IC_LAUNCH(indexer_logits_any_kernel<float>, grid, kThreads, 0, env.stream, a, oo);
    } else if (p.qk_dtype == DType::kBFloat16) {
      IC_LAUNCH(indexer_logits_any_kernel<uint16_t>, grid, kThreads, 0, env.stream, a, oo);
    } else {
      IC_LAUNCH(indexer_logits_any_kernel<uint8_t>, grid, kThreads, 0, env.stream, a, oo);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The windows checked on the device: a bad one becomes empty, counted in env.err (as the tiled path).
inline void device_windows(const IndexerParams& p, const DeviceEnv& env, int32_t*& lo, int32_t*& hi) {
  lo = static_cast<int32_t*>(env.alloc(std::max<int64_t>(p.s_q, 1) * 4));
  hi = static_cast<int32_t*>(env.alloc(std::max<int64_t>(p.s_q, 1) * 4));
  sanitize_windows_cuda(p.ks, p.ke, p.s_q, p.s_kv, lo, hi, env);
}

}  // namespace any_detail

inline void indexer_logits_any_cuda(const IndexerParams& p, const LogitsOut& o, const DeviceEnv& env) {
  using namespace any_detail;
  if (p.s_q == 0) return;
  int32_t *lo, *hi;
  device_windows(p, env, lo, hi);
  launch_any(p, lo, hi, 0, p.s_q, o, env);
}

inline void indexer_topk_any_cuda(const IndexerParams& p, const TopkOut& o, const DeviceEnv& env) {
  using namespace any_detail;
  if (p.s_q == 0) return;
  int32_t *lo, *hi;
  device_windows(p, env, lo, hi);
  const int64_t cols = std::max<int64_t>(p.s_kv, 1);
  const int64_t chunk = std::clamp<int64_t>(kScratch / (cols * 4), 1, p.s_q);
  float* tmp = static_cast<float*>(env.alloc(chunk * cols * 4));
  for (int64_t r0 = 0; r0 < p.s_q; r0 += chunk) {
    const int64_t rows = std::min(chunk, p.s_q - r0);
    launch_any(p, lo, hi, r0, rows, LogitsOut{tmp, cols, cols}, env);
    const TopkParams tp{tmp, lo + r0, hi + r0, rows, cols};
    topk_launch(tp, TopkOut{o.out + r0 * o.stride, o.stride, o.width, o.topk}, p.s_kv, env);
  }
}

}  // namespace cuda
}  // namespace indexcache
