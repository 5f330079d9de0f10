// CUDA sparse MLA, absorbed form (DESIGN.md §5). Torch-free kernels and launch code; the op
// glue is in sparse_mla.cu.
//
// One CTA per (query row, group of 16 heads). The row's indices are compacted 128 at a time
// (stable, -1 and out-of-range entries dropped), the valid slots are read in tiles, and an
// online softmax in fp32 folds each tile in; a row with no valid slot writes 0 and lse -inf.
//   - q bf16 with a bf16 or fp8_ds_mla cache (sparse_mla_mma_kernel, 4 warps, tiles of 32
//     keys): the tile is dequantized to bf16 in shared memory (fp8 values times their fp32
//     scale, rounded to bf16, as the CPU does); S = Q K^T with mma.sync m16n8k16, each warp
//     owning a quarter of the 576 dims with its Q fragments in registers, the 4 partial S
//     added in a fixed order; P (bf16) times V with each warp owning a quarter of d_v.
//   - fp32 q or an fp32 cache (sparse_mla_fma_kernel, 256 threads, tiles of 16 keys): plain
//     fp32 FMAs, for the 1e-5 bar.
// Deterministic: fixed summation orders, no atomics.
#pragma once

#include <algorithm>
#include <climits>

#include "common.cuh"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace mla_detail {

constexpr int kMlaHeads = 16;   // heads per CTA (one mma row tile)
constexpr int kMmaThreads = 128;
constexpr int kMmaKeys = 32;    // keys per tile
constexpr int kLdKv = kMlaDim + 8;  // 584: conflict-free fragment loads
constexpr int kLdP = kMmaKeys + 8;  // 40
constexpr int kFmaThreads = 256;
constexpr int kFmaKeys = 16;
constexpr int kLdF = kMlaDim + 1;   // 577

struct MlaMmaSmem {
  uint16_t q[kMlaHeads * kLdKv];
  uint16_t kv[kMmaKeys * kLdKv];
  float sp[4][kMlaHeads][kMmaKeys];  // per-warp partial scores
  uint16_t p[kMlaHeads * kLdP];      // probabilities, bf16
  float alpha[kMlaHeads];
  float m[kMlaHeads];
  float l[kMlaHeads];
  int32_t bad[kMlaHeads];  // a non-finite score was seen: out and lse are NaN (docs/ops.md)
  int32_t list[kMmaThreads];
  uint32_t scan[32];
};

struct MlaFmaSmem {
  float q[kMlaHeads * kLdF];
  float kv[kFmaKeys * kLdF];
  float p[kFmaKeys][kMlaHeads];
  float alpha[kMlaHeads];
  float m[kMlaHeads];
  float l[kMlaHeads];
  int32_t bad[kMlaHeads];
  int32_t list[kFmaThreads];
  uint32_t scan[32];
};

// Column c of cache row `slot` as fp32 (dequantized for fp8_ds_mla), byte-safe loads.
__device__ __forceinline__ float kv_elem(const SparseMlaParams& p, int64_t slot, int c) {
  if (p.kv_dtype == DType::kFp8E4M3) {
    const uint8_t* row = static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes;
    if (c < kMlaLatent) return e4m3_to_float(row[c]) * load_f32_bytes(row + kMlaLatent + 4 * (c / kQuantGroup));
    const uint8_t* r = row + kMlaLatent + 16 + 2 * (c - kMlaLatent);
    return bf16_to_float(static_cast<uint16_t>(r[0] | (r[1] << 8)));
  }
  if (p.kv_dtype == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(p.kv)[slot * kMlaDim + c]);
  return static_cast<const float*>(p.kv)[slot * kMlaDim + c];
}

// Stable compaction of indices [c0, c0 + NT) of row t into list; returns how many are valid.
// Entries other than -1 outside [0, num_slots) are dropped too and counted in err (which
// only the first head group of a row passes, so each entry counts once).
template <int NT>
__device__ __forceinline__ int compact_indices(const SparseMlaParams& p, int64_t t, int64_t c0, int32_t* list,
                                               uint32_t* scan, int32_t* err) {
  const int64_t j = c0 + threadIdx.x;
  int32_t s = -1;
  if (j < p.topk) s = p.indices[t * p.topk + j];
  const bool valid = s >= 0 && s < p.num_slots;
  if (!valid && s != -1) count_error(err);
  uint32_t total;
  const uint32_t incl = block_incl_scan<NT>(valid ? 1u : 0u, scan, total);
  if (valid) list[incl - 1] = s;
  __syncthreads();
  return static_cast<int>(total);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}
__device__ __forceinline__ float warp_max_f(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// ------------------------------------------------------------------ bf16 tensor-core path

// Cache row `slot` -> 576 bf16 in shared memory (dst 16-byte aligned). Vec: the cache base
// is 16-byte aligned, so every 16-byte piece of a row is too (rows are 1152 or 656 bytes,
// the fp8 RoPE part starts at byte 528) and no byte loads are needed.
template <bool Vec>
__device__ __forceinline__ void stage_kv_row_bf16(const SparseMlaParams& p, int64_t slot, uint16_t* dst, int part) {
  // part: one 16-byte piece of the destination row (72 per row). The cache is bf16 or
  // fp8_ds_mla here (fp32 caches take the FMA kernel).
  uint16_t v[8];
  if constexpr (Vec) {
    if (p.kv_dtype == DType::kBFloat16) {
      *reinterpret_cast<uint4*>(dst + part * 8) =
          *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.kv) + slot * kMlaDim + part * 8);
      return;
    }
    const uint8_t* row = static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes;
    if (part >= kMlaLatent / 8) {
      // The 64 bf16 RoPE values are stored as they are staged: one 16-byte copy per piece.
      *reinterpret_cast<uint4*>(dst + part * 8) =
          *reinterpret_cast<const uint4*>(row + kMlaLatent + 16 + (part - kMlaLatent / 8) * 16);
      return;
    }
    const float scale = *reinterpret_cast<const float*>(row + kMlaLatent + 4 * (part * 8 / kQuantGroup));
    const uint2 u = *reinterpret_cast<const uint2*>(row + part * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint8_t b = static_cast<uint8_t>((i < 4 ? u.x : u.y) >> (8 * (i & 3)));
      v[i] = float_to_bf16(e4m3_to_float(b) * scale);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = float_to_bf16(kv_elem(p, slot, part * 8 + i));
  }
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(v[2 * i]) | (static_cast<uint32_t>(v[2 * i + 1]) << 16);
  *reinterpret_cast<uint4*>(dst + part * 8) = make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool Vec>
__global__ void __launch_bounds__(kMmaThreads) sparse_mla_mma_kernel(SparseMlaParams p, int32_t* err) {
  constexpr bool vec = Vec;
  IC_DYNAMIC_SMEM(smem_raw);
  MlaMmaSmem& sm = *reinterpret_cast<MlaMmaSmem*>(smem_raw);
  const int64_t groups = (p.h_q + kMlaHeads - 1) / kMlaHeads;
  const int64_t t = blockIdx.x / groups;
  const int64_t h0 = (blockIdx.x % groups) * kMlaHeads;
  const int nh = static_cast<int>(std::min<int64_t>(kMlaHeads, p.h_q - h0));
  int32_t* const row_err = h0 == 0 ? err : nullptr;  // each index entry counted once
  const int warp = warp_id(), lane = lane_id();
  const int g = lane >> 2, tq = lane & 3;
  constexpr int kChunks = kMlaDim / 8;  // 16-byte pieces per 576-value bf16 row

  // q rows (bf16) -> shared, zeros past the last head.
  const uint16_t* qg = static_cast<const uint16_t*>(p.q) + (t * p.h_q + h0) * kMlaDim;
  for (int c = threadIdx.x; c < kMlaHeads * kChunks; c += kMmaThreads) {
    const int hh = c / kChunks, part = c % kChunks;
    uint16_t* d = sm.q + hh * kLdKv + part * 8;
    if (hh >= nh) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    } else if (vec) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(qg + hh * kMlaDim + part * 8);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) d[i] = qg[hh * kMlaDim + part * 8 + i];
    }
  }
  __syncthreads();
  // This warp's quarter of the 36 k-steps of Q, kept in registers.
  constexpr int kSteps = kMlaDim / 16 / 4;  // 9
  uint32_t qa[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) load_a_frag(qa[s], sm.q, kLdKv, 0, (warp * kSteps + s) * 16);

  const int cw = static_cast<int>(p.d_v) / 4;  // value columns per warp (multiple of 16)
  const int nts = cw / 8;
  float o[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m_run[4], l_run[4];  // heads 4 * warp + i (the softmax owner of each head)
  bool bad_run[4];          // a valid key's score was NaN or +-inf
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m_run[i] = -__int_as_float(0x7f800000);
    l_run[i] = 0.f;
    bad_run[i] = false;
  }

  for (int64_t c0 = 0; c0 < p.topk; c0 += kMmaThreads) {
    const int nv = compact_indices<kMmaThreads>(p, t, c0, sm.list, sm.scan, row_err);
    for (int k0 = 0; k0 < nv; k0 += kMmaKeys) {
      const int nk = nv - k0 < kMmaKeys ? nv - k0 : kMmaKeys;
      for (int c = threadIdx.x; c < kMmaKeys * kChunks; c += kMmaThreads) {
        const int j = c / kChunks, part = c % kChunks;
        uint16_t* d = sm.kv + j * kLdKv;
        if (j < nk) {
          stage_kv_row_bf16<Vec>(p, sm.list[k0 + j], d, part);
        } else {
          *reinterpret_cast<uint4*>(d + part * 8) = make_uint4(0, 0, 0, 0);
        }
      }
      __syncthreads();
      // Partial S over this warp's 144 dims: 16 heads x 32 keys.
#pragma unroll
      for (int nt = 0; nt < kMmaKeys / 8; ++nt) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          uint32_t b0, b1;
          load_b_frag_nk(b0, b1, sm.kv, kLdKv, nt * 8, (warp * kSteps + s) * 16);
          mma_bf16_16816(acc, qa[s], b0, b1);
        }
        sm.sp[warp][g][nt * 8 + 2 * tq] = acc[0];
        sm.sp[warp][g][nt * 8 + 2 * tq + 1] = acc[1];
        sm.sp[warp][g + 8][nt * 8 + 2 * tq] = acc[2];
        sm.sp[warp][g + 8][nt * 8 + 2 * tq + 1] = acc[3];
      }
      __syncthreads();
      // Online softmax: warp w owns heads 4w..4w+3, lane = key.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int hh = warp * 4 + i;
        const bool valid = lane < nk;
        float s = (((sm.sp[0][hh][lane] + sm.sp[1][hh][lane]) + sm.sp[2][hh][lane]) + sm.sp[3][hh][lane]) * p.sm_scale;
        bad_run[i] = bad_run[i] || __ballot_sync(kFullMask, valid && !is_finite_f(s)) != 0u;
        s = valid ? s : -__int_as_float(0x7f800000);
        const float m_new = fmaxf(m_run[i], warp_max_f(s));
        const float alpha = expf(m_run[i] - m_new);
        const float e = valid ? expf(s - m_new) : 0.f;
        l_run[i] = l_run[i] * alpha + warp_sum(e);
        m_run[i] = m_new;
        sm.p[hh * kLdP + lane] = float_to_bf16(e);
        if (lane == 0) sm.alpha[hh] = alpha;
      }
      __syncthreads();
      // O[:, warp's columns] = alpha * O + P V.
      const float a_lo = sm.alpha[g], a_hi = sm.alpha[g + 8];
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        o[nt][0] *= a_lo;
        o[nt][1] *= a_lo;
        o[nt][2] *= a_hi;
        o[nt][3] *= a_hi;
      }
#pragma unroll
      for (int ks = 0; ks < kMmaKeys / 16; ++ks) {
        uint32_t pa[4];
        load_a_frag(pa, sm.p, kLdP, 0, ks * 16);
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          if (nt < nts) {
            uint32_t b0, b1;
            load_b_frag_kn(b0, b1, sm.kv, kLdKv, warp * cw + nt * 8, ks * 16);
            mma_bf16_16816(o[nt], pa, b0, b1);
          }
        }
      }
      __syncthreads();  // kv, sp, p, alpha are rewritten by the next tile
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sm.m[warp * 4 + i] = m_run[i];
      sm.l[warp * 4 + i] = l_run[i];
      sm.bad[warp * 4 + i] = bad_run[i] ? 1 : 0;
    }
  }
  __syncthreads();
  const float ninf = -__int_as_float(0x7f800000);
  if (threadIdx.x < nh) {
    const float l = sm.l[threadIdx.x];
    p.lse[t * p.h_q + h0 + threadIdx.x] =
        sm.bad[threadIdx.x] ? quiet_nan() : (l > 0.f ? sm.m[threadIdx.x] + logf(l) : ninf);
  }
  uint16_t* out = static_cast<uint16_t*>(p.out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int hh = g + 8 * half;
    if (hh >= nh) continue;
    const float l = sm.l[hh];
    // NaN times anything is NaN: a bad head's whole row comes out NaN.
    const float inv = sm.bad[hh] ? quiet_nan() : (l > 0.f ? 1.0f / l : 0.f);
    uint16_t* orow = out + (t * p.h_q + h0 + hh) * p.d_v;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      if (nt < nts) {
        const int col = warp * cw + nt * 8 + 2 * tq;
        orow[col] = float_to_bf16(o[nt][2 * half] * inv);
        orow[col + 1] = float_to_bf16(o[nt][2 * half + 1] * inv);
      }
    }
  }
}

// ------------------------------------------------------------------ fp32 FMA path

__global__ void __launch_bounds__(kFmaThreads) sparse_mla_fma_kernel(SparseMlaParams p, int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  MlaFmaSmem& sm = *reinterpret_cast<MlaFmaSmem*>(smem_raw);
  const int64_t groups = (p.h_q + kMlaHeads - 1) / kMlaHeads;
  const int64_t t = blockIdx.x / groups;
  const int64_t h0 = (blockIdx.x % groups) * kMlaHeads;
  const int nh = static_cast<int>(std::min<int64_t>(kMlaHeads, p.h_q - h0));
  int32_t* const row_err = h0 == 0 ? err : nullptr;
  const bool q32 = p.q_dtype == DType::kFloat32;
  for (int idx = threadIdx.x; idx < kMlaHeads * kMlaDim; idx += kFmaThreads) {
    const int hh = idx / kMlaDim, c = idx % kMlaDim;
    float v = 0.f;
    if (hh < nh) {
      const int64_t at = (t * p.h_q + h0 + hh) * kMlaDim + c;
      v = q32 ? static_cast<const float*>(p.q)[at] : bf16_to_float(static_cast<const uint16_t*>(p.q)[at]);
    }
    sm.q[hh * kLdF + c] = v;
  }
  // Thread (head hh, key j) in the score phase; columns tid, tid + 256 in the P V phase.
  const int hh = threadIdx.x / kFmaKeys, j = threadIdx.x % kFmaKeys;
  float m_run = -__int_as_float(0x7f800000), l_run = 0.f;
  int bad_run = 0;  // a valid key's score was NaN or +-inf
  float acc[kMlaHeads][2];
#pragma unroll
  for (int h = 0; h < kMlaHeads; ++h) acc[h][0] = acc[h][1] = 0.f;
  for (int64_t c0 = 0; c0 < p.topk; c0 += kFmaThreads) {
    const int nv = compact_indices<kFmaThreads>(p, t, c0, sm.list, sm.scan, row_err);  // barrier inside
    for (int k0 = 0; k0 < nv; k0 += kFmaKeys) {
      const int nk = nv - k0 < kFmaKeys ? nv - k0 : kFmaKeys;
      for (int idx = threadIdx.x; idx < kFmaKeys * kMlaDim; idx += kFmaThreads) {
        const int jj = idx / kMlaDim, c = idx % kMlaDim;
        sm.kv[jj * kLdF + c] = jj < nk ? kv_elem(p, sm.list[k0 + jj], c) : 0.f;
      }
      __syncthreads();
      const float* qr = sm.q + hh * kLdF;
      const float* kr = sm.kv + j * kLdF;
      float d = 0.f;
#pragma unroll 8
      for (int c = 0; c < kMlaDim; ++c) d = fmaf(qr[c], kr[c], d);
      const bool valid = j < nk;
      const float s = valid ? d * p.sm_scale : -__int_as_float(0x7f800000);
      // The 16 threads of head hh are 16 consecutive lanes of one warp.
      float mx = s;
      int bad = valid && !is_finite_f(s) ? 1 : 0;
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
        bad |= __shfl_xor_sync(kFullMask, bad, o);
      }
      bad_run |= bad;
      const float m_new = fmaxf(m_run, mx);
      const float alpha = expf(m_run - m_new);
      float e = valid ? expf(s - m_new) : 0.f;
      float sum = e;
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      sm.p[j][hh] = e;
      if (j == 0) sm.alpha[hh] = alpha;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = threadIdx.x + i * kFmaThreads;
        if (c >= p.d_v) continue;
#pragma unroll
        for (int h = 0; h < kMlaHeads; ++h) acc[h][i] *= sm.alpha[h];
        for (int jj = 0; jj < nk; ++jj) {
          const float v = sm.kv[jj * kLdF + c];
#pragma unroll
          for (int h = 0; h < kMlaHeads; ++h) acc[h][i] = fmaf(sm.p[jj][h], v, acc[h][i]);
        }
      }
      __syncthreads();
    }
  }
  if (j == 0) {
    sm.m[hh] = m_run;
    sm.l[hh] = l_run;
    sm.bad[hh] = bad_run;
  }
  __syncthreads();
  const float ninf = -__int_as_float(0x7f800000);
  if (threadIdx.x < nh) {
    const float l = sm.l[threadIdx.x];
    p.lse[t * p.h_q + h0 + threadIdx.x] =
        sm.bad[threadIdx.x] ? quiet_nan() : (l > 0.f ? sm.m[threadIdx.x] + logf(l) : ninf);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = threadIdx.x + i * kFmaThreads;
    if (c >= p.d_v) continue;
#pragma unroll
    for (int h = 0; h < kMlaHeads; ++h) {
      if (h >= nh) continue;
      const float l = sm.l[h];
      const float v = sm.bad[h] ? quiet_nan() : (l > 0.f ? acc[h][i] / l : 0.f);
      const int64_t at = (t * p.h_q + h0 + h) * p.d_v + c;
      if (q32) {
        static_cast<float*>(p.out)[at] = v;
      } else {
        static_cast<uint16_t*>(p.out)[at] = float_to_bf16(v);
      }
    }
  }
}

template <typename Kernel>
int mla_smem(Kernel kernel, int bytes, const DeviceEnv& env) {
  TORCH_CHECK(bytes <= env.smem_optin, "sparse MLA needs ", bytes, " bytes of shared memory; the device allows ",
              env.smem_optin);
  if (bytes > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return bytes;
}

}  // namespace mla_detail

void sparse_mla_cuda(const SparseMlaParams& p, const DeviceEnv& env) {
  using namespace mla_detail;
  const int64_t groups = (p.h_q + kMlaHeads - 1) / kMlaHeads;
  const int64_t ctas = p.s_q * groups;
  if (ctas == 0) return;
  TORCH_CHECK(ctas <= INT_MAX, "too many (query, head group) pairs for the CUDA sparse MLA: ", ctas);
  if (p.q_dtype == DType::kBFloat16 && p.kv_dtype != DType::kFloat32) {
    const uintptr_t qa = reinterpret_cast<uintptr_t>(p.q), ka = reinterpret_cast<uintptr_t>(p.kv);
    // bf16 rows are 1152 B, fp8 rows 656 B: both keep 16-byte alignment from the base.
    const bool vec = (qa % 16 == 0) && (ka % 16 == 0);
    if (vec) {
      const int smem = mla_smem(sparse_mla_mma_kernel<true>, static_cast<int>(sizeof(MlaMmaSmem)), env);
      IC_LAUNCH(sparse_mla_mma_kernel<true>, dim3(static_cast<unsigned>(ctas)), kMmaThreads, smem, env.stream, p,
                env.err);
    } else {
      const int smem = mla_smem(sparse_mla_mma_kernel<false>, static_cast<int>(sizeof(MlaMmaSmem)), env);
      IC_LAUNCH(sparse_mla_mma_kernel<false>, dim3(static_cast<unsigned>(ctas)), kMmaThreads, smem, env.stream, p,
                env.err);
    }
  } else {
    const int smem = mla_smem(sparse_mla_fma_kernel, static_cast<int>(sizeof(MlaFmaSmem)), env);
    IC_LAUNCH(sparse_mla_fma_kernel, dim3(static_cast<unsigned>(ctas)), kFmaThreads, smem, env.stream, p, env.err);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
