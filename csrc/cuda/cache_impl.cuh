// Element-wise CUDA ops: fp8 quantization, the index-K and MLA cache inserts, position ->
// slot. One warp per 128-value group (4 contiguous values per lane, 16-byte loads where
// aligned); rounding goes through the same helpers as the CPU (indexcache/fp8.h), and the
// Hadamard butterflies run in the same order, so the bytes and scales are bit-identical.
// Torch-free kernels and launch code; the op glue is in cache_ops.cu.
#pragma once

#include <algorithm>

#include "common.cuh"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace cache_detail {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 32 * kWarpsPerBlock;

// The 4 values [offset + 4 * lane, +4) of a float32 or bf16 array, as float.
__device__ __forceinline__ void load4(const void* src, DType dt, int64_t offset, bool vec, float (&v)[4]) {
  const int64_t i0 = offset + 4 * lane_id();
  if (dt == DType::kFloat32) {
    const float* s = static_cast<const float*>(src) + i0;
    if (vec) {
      const float4 f = *reinterpret_cast<const float4*>(s);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = s[i];
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + i0;
    if (vec) {
      const uint2 u = *reinterpret_cast<const uint2*>(s);
      v[0] = bf16_to_float(static_cast<uint16_t>(u.x & 0xffffu));
      v[1] = bf16_to_float(static_cast<uint16_t>(u.x >> 16));
      v[2] = bf16_to_float(static_cast<uint16_t>(u.y & 0xffffu));
      v[3] = bf16_to_float(static_cast<uint16_t>(u.y >> 16));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = bf16_to_float(s[i]);
    }
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = nan_max(x, __shfl_xor_sync(kFullMask, x, o));  // NaN kept
  return x;
}

// The orthonormal 128-point Walsh-Hadamard rotation of one group held 4 values per lane
// (element e = 4 * lane + i). Stage h: x[e] = x[e] + x[e+h] when bit h of e is clear,
// x[e] = x[e-h] - x[e] when set, exactly hadamard_128_inplace's operations.
__device__ __forceinline__ void hadamard_warp(float (&v)[4]) {
  float a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = a + b, v[1] = a - b, v[2] = c + d, v[3] = c - d;  // h = 1
  a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = a + c, v[1] = b + d, v[2] = a - c, v[3] = b - d;  // h = 2
  const int lane = lane_id();
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // h = 4 m
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float o = __shfl_xor_sync(kFullMask, v[i], m);
      v[i] = upper ? o - v[i] : v[i] + o;
    }
  }
  const float s = 0.08838834764831845f;  // 128^-1/2 rounded to fp32, as on the CPU
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= s;
}

// Quantize one 128-value group (called by a whole warp); returns the scale on every lane.
__device__ __forceinline__ float quantize_group_warp(const void* src, DType dt, int64_t offset, float eps,
                                                     bool hadamard, bool vec_in, uint8_t* dst, bool vec_out) {
  float v[4];
  load4(src, dt, offset, vec_in, v);
  if (hadamard) hadamard_warp(v);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = nan_max(amax, fabsf(v[i]));
  amax = warp_max(amax);
  // A NaN or inf in the group: NaN scale and NaN bytes (docs/ops.md), as on the CPU.
  const bool bad = !is_finite_f(amax);
  const float scale = bad ? quiet_nan() : ue8m0_scale(amax, eps);
  const float inv = 1.0f / scale;  // exact: a power of two
  uint8_t b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = bad ? kE4m3NaN : float_to_e4m3(v[i] * inv);
  uint8_t* d = dst + 4 * lane_id();
  if (vec_out) {
    *reinterpret_cast<uint32_t*>(d) = static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
                                      (static_cast<uint32_t>(b[2]) << 16) | (static_cast<uint32_t>(b[3]) << 24);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = b[i];
  }
  return scale;
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(QuantParams p, int64_t groups, bool vec_in, bool vec_out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp_id();
  if (g >= groups) return;  // whole warps leave together
  const float s = quantize_group_warp(p.x, p.x_dtype, g * kQuantGroup, p.eps, p.hadamard, vec_in,
                                      p.values + g * kQuantGroup, vec_out);
  if (lane_id() == 0) p.scales[g] = s;
}

// One warp per token; d == 128, so one scale per token (DESIGN.md §4 page layout).
// A slot outside [-1, num_slots) is skipped like -1 and counted in err (whole warps leave).
__device__ __forceinline__ bool slot_ok(int64_t slot, int64_t num_slots, int32_t* err) {
  if (slot == -1) return false;
  if (slot < 0 || slot >= num_slots) {
    if (lane_id() == 0) count_error(err);
    return false;
  }
  return true;
}

__global__ void __launch_bounds__(kThreads) index_k_insert_kernel(IndexKInsertParams p, bool vec_in, bool vec_out,
                                                                  int32_t* err) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp_id();
  if (i >= p.n) return;
  const int64_t slot = p.slot_mapping[i];
  if (!slot_ok(slot, p.num_blocks * p.block_size, err)) return;
  uint8_t* block = p.cache + (slot / p.block_size) * p.block_size * (p.d + 4);
  const int64_t off = slot % p.block_size;
  const float s = quantize_group_warp(p.k, p.k_dtype, i * p.d, kIndexKEps, p.hadamard, vec_in, block + off * p.d,
                                      vec_out);
  if (lane_id() == 0) store_f32_bytes(block + p.block_size * p.d + off * 4, s);
}

__device__ __forceinline__ float load_value(const void* base, DType dt, int64_t i) {
  return dt == DType::kFloat32 ? static_cast<const float*>(base)[i]
                               : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

// One warp per token.
__global__ void __launch_bounds__(kThreads) mla_insert_kernel(MlaInsertParams p, int32_t* err) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp_id();
  if (i >= p.n) return;
  const int64_t slot = p.slot_mapping[i];
  if (!slot_ok(slot, p.num_slots, err)) return;
  const int lane = lane_id();
  if (p.cache_dtype == DType::kFp8E4M3) {
    uint8_t* row = static_cast<uint8_t*>(p.cache) + slot * kMlaFp8Bytes;
    for (int g = 0; g < kMlaLatent / kQuantGroup; ++g) {
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = load_value(p.kv_c, p.src_dtype, i * kMlaLatent + g * kQuantGroup + 4 * lane + j);
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) amax = nan_max(amax, fabsf(v[j]));
      amax = warp_max(amax);
      const bool bad = !is_finite_f(amax);  // NaN scale and bytes, as quantize (docs/ops.md)
      const float scale = bad ? quiet_nan() : (amax < kMlaFp8Eps ? kMlaFp8Eps : amax) / kFp8Max;
#pragma unroll
      for (int j = 0; j < 4; ++j) row[g * kQuantGroup + 4 * lane + j] = bad ? kE4m3NaN : float_to_e4m3(v[j] / scale);
      if (lane == 0) store_f32_bytes(row + kMlaLatent + 4 * g, scale);
    }
    uint8_t* rope = row + kMlaLatent + 16;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 2 * lane + j;
      const uint16_t h = float_to_bf16(load_value(p.k_pe, p.src_dtype, i * kMlaRope + c));
      rope[2 * c] = static_cast<uint8_t>(h & 0xffu);
      rope[2 * c + 1] = static_cast<uint8_t>(h >> 8);
    }
  } else {
    const int lat = static_cast<int>(p.d_latent), width = lat + kMlaRope;  // 576, or 512 (DeepSeek-V4)
    for (int c = lane; c < width; c += 32) {
      const float v = c < lat ? load_value(p.kv_c, p.src_dtype, i * lat + c)
                              : load_value(p.k_pe, p.src_dtype, i * kMlaRope + c - lat);
      if (p.cache_dtype == DType::kFloat32) {
        static_cast<float*>(p.cache)[slot * width + c] = v;
      } else {
        static_cast<uint16_t*>(p.cache)[slot * width + c] = float_to_bf16(v);
      }
    }
  }
}

// Entries the CPU op rejects (a position < -1, a request outside the block table, a block
// past its columns, a block id outside the cache) become -1, each counted once in err.
__global__ void __launch_bounds__(kThreads) positions_to_slots_kernel(SlotParams p, int32_t* err) {
  const int64_t total = p.n * p.k;
  int bad = 0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = idx / p.k;
    const int32_t pos = p.positions[idx];
    int32_t out = -1;
    if (pos >= 0) {
      const int32_t req = p.req_of_row[r];
      const int64_t blk = pos / p.block_size;
      int64_t id = -1;
      if (req >= 0 && req < p.batch && blk < p.max_blocks) id = p.block_table[req * p.max_blocks + blk];
      if (id >= 0 && id < p.num_blocks) {
        out = static_cast<int32_t>(id * p.block_size + pos % p.block_size);
      } else {
        ++bad;
      }
    } else if (pos != -1) {
      ++bad;
    }
    p.slots[idx] = out;
  }
  count_error(err, bad);
}

inline bool is_aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

unsigned warp_blocks(int64_t items) { return static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace cache_detail

void quantize_fp8_cuda(const QuantParams& p, const DeviceEnv& env) {
  using namespace cache_detail;
  const int64_t groups = p.rows * (p.d / kQuantGroup);
  if (groups == 0) return;
  const bool vec_in = is_aligned(p.x, p.x_dtype == DType::kFloat32 ? 16 : 8);
  IC_LAUNCH(quantize_kernel, dim3(warp_blocks(groups)), kThreads, 0, env.stream, p, groups, vec_in,
            is_aligned(p.values, 4));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void index_k_insert_cuda(const IndexKInsertParams& p, const DeviceEnv& env) {
  using namespace cache_detail;
  if (p.n == 0) return;
  const bool vec_in = is_aligned(p.k, p.k_dtype == DType::kFloat32 ? 16 : 8);
  IC_LAUNCH(index_k_insert_kernel, dim3(warp_blocks(p.n)), kThreads, 0, env.stream, p, vec_in,
            is_aligned(p.cache, 4), env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void mla_insert_cuda(const MlaInsertParams& p, const DeviceEnv& env) {
  using namespace cache_detail;
  if (p.n == 0) return;
  IC_LAUNCH(mla_insert_kernel, dim3(warp_blocks(p.n)), kThreads, 0, env.stream, p, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void positions_to_slots_cuda(const SlotParams& p, const DeviceEnv& env) {
  using namespace cache_detail;
  const int64_t total = p.n * p.k;
  if (total == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65536));
  IC_LAUNCH(positions_to_slots_kernel, dim3(blocks), kThreads, 0, env.stream, p, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
