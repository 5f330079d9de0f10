// CUDA sparse MLA, absorbed form (DESIGN.md §5). Torch-free kernels and launch code; the op
// glue is in sparse_mla.cu.
//
// The row's indices are compacted (stable, -1 and out-of-range entries dropped), the valid
// slots are read in tiles, and an online softmax in fp32 folds each tile in; a row with no
// valid slot writes 0 and lse -inf (the sink with sinks). An attention sink (p.sinks) only
// changes the final normalisation (mla_finish in ops.h: after the last tile, or in the merge).
//   - q bf16 with a bf16 or fp8_ds_mla cache (sparse_mla_mma_kernel<NG, Vec>): a CTA serves
//     one query row and NG groups of 16 heads (up to 64) sharing one staged tile of 32 keys,
//     dequantized to bf16 in shared memory (fp8 values times their fp32 scale, rounded to bf16,
//     as the CPU does); S = Q K^T and P V with mma.sync m16n8k16 (see the section below). With
//     few (row, head-group) CTAs a row's index list is split across CTAs and
//     sparse_mla_merge_kernel combines their partial results by log-sum-exp.
//   - fp32 q or an fp32 cache (sparse_mla_fma_kernel, 256 threads, 16 heads, tiles of 16
//     keys): plain fp32 FMAs, for the 1e-5 bar.
// Both kernels are templates on the row width D = d_qk: 576 (DSA, absorbed) or 512 (DeepSeek-V4's
// shared K=V head: the value is the key row itself, so the value tile is the key tile; no fp8).
// A row's key list is its indices followed by its extra_indices (mla_entry): the compaction
// walks both, and every later stage (tiles, splits, merge) sees one list.
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

constexpr int kMlaHeads = 16;   // heads per mma row tile (one head group; the FMA kernel's CTA)
constexpr int kGroupThreads = 128;  // 4 warps per head group
constexpr int kMmaKeys = 32;    // keys per tile
constexpr int kMinSplitEntries = 256;  // index entries per split at least
constexpr int kMaxSplits = 32;
constexpr int kMergeThreads = 128;
// Shared-memory row stride of a D-wide bf16 row: D + 8 (584 / 520: 292 / 260 words, 4 mod 32,
// so the 8 rows of an ldmatrix / fragment load hit distinct banks).
template <int D>
constexpr int ld_kv() { return D + 8; }
constexpr int kLdP = kMmaKeys + 8;  // 40
constexpr int kFmaThreads = 256;
constexpr int kFmaKeys = 16;

template <int D>
struct MlaFmaSmem {
  static constexpr int kLdF = D + 1;  // 577 / 513: odd, conflict-free column reads
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

// Column c of cache row `slot` (D wide) as fp32 (dequantized for fp8_ds_mla), byte-safe loads.
template <int D>
__device__ __forceinline__ float kv_elem(const SparseMlaParams& p, int64_t slot, int c) {
  if constexpr (D == kMlaDim) {
    if (p.kv_dtype == DType::kFp8E4M3) {
      const uint8_t* row = static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes;
      if (c < kMlaLatent) return e4m3_to_float(row[c]) * load_f32_bytes(row + kMlaLatent + 4 * (c / kQuantGroup));
      const uint8_t* r = row + kMlaLatent + 16 + 2 * (c - kMlaLatent);
      return bf16_to_float(static_cast<uint16_t>(r[0] | (r[1] << 8)));
    }
  }
  if (p.kv_dtype == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(p.kv)[slot * D + c]);
  return static_cast<const float*>(p.kv)[slot * D + c];
}

// Stable compaction of entries [c0, c0 + NT) of row t's key list (indices, then extra_indices)
// into list; returns how many are valid.
// Entries other than -1 outside [0, num_slots) are dropped too and counted in err (which
// only the first head group of a row passes, so each entry counts once).
template <int NT>
__device__ __forceinline__ int compact_indices(const SparseMlaParams& p, int64_t t, int64_t c0, int64_t end,
                                               int32_t* list, uint32_t* scan, int32_t* err) {
  const int64_t j = c0 + threadIdx.x;
  int32_t s = -1;
  if (j < end) s = mla_entry(p, t, j);
  const bool valid = s >= 0 && s < p.num_slots;
  if (!valid && s != -1) count_error(err);
  uint32_t total;
  const uint32_t incl = block_incl_scan<NT>(valid ? 1u : 0u, scan, total);
  if (valid) list[incl - 1] = s;
  __syncthreads();
  return static_cast<int>(total);
}

// Indices [c0, c1) of row t (c1 - c0 <= the list's size) compacted into list, NT at a time.
template <int NT>
__device__ __forceinline__ int compact_chunk(const SparseMlaParams& p, int64_t t, int64_t c0, int64_t c1, int32_t* list,
                                             uint32_t* scan, int32_t* err) {
  int n = 0;
  for (int64_t c = c0; c < c1; c += NT) n += compact_indices<NT>(p, t, c, c1, list + n, scan, err);
  return n;
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
//
// CTA = NG head groups x 4 warps (NG = 1, 2, 4: up to 64 heads, 512 threads). Every group does
// for its 16 heads what one 4-warp CTA used to do (partial S per warp over a quarter of the 576
// dims, owned softmax heads, P V over a quarter of d_v; Q stays in shared memory because the
// 64 accumulators of O fill the 128 registers a 512-thread CTA allows), and all
// groups read one staged KV tile, so a selected row is fetched and dequantized once per 64
// heads. Aligned caches are copied with cp.async into a double buffer (bf16 rows straight to
// their tile, fp8_ds_mla rows as raw bytes that are dequantized in shared memory), the next
// tile in flight while the current one is computed. A CTA may own only part of the row's
// index list (split): it then writes fp32 partial O (not normalised) and (m, l) to scratch and
// sparse_mla_merge_kernel combines the splits in a fixed order.

// Cache row `slot`, 16-byte piece `part` (of D / 8) -> 8 bf16 in shared memory, byte-safe loads
// (caches that are not 16-byte aligned).
template <int D>
__device__ __forceinline__ void stage_kv_piece_bytes(const SparseMlaParams& p, int64_t slot, uint16_t* dst, int part) {
  uint16_t v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = float_to_bf16(kv_elem<D>(p, slot, part * 8 + i));
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(v[2 * i]) | (static_cast<uint32_t>(v[2 * i + 1]) << 16);
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

template <int D>
constexpr int kv_tile_elems() { return kMmaKeys * ld_kv<D>(); }  // one bf16 tile
template <int D>
constexpr int kv_tile_bytes() { return kv_tile_elems<D>() * 2; }  // 37376 / 33280
constexpr int kRawTileBytes = kMmaKeys * kMlaFp8Bytes;         // 20992: 32 raw fp8_ds_mla rows
constexpr int kFp8Pieces = kMlaFp8Bytes / 16;                  // 41 16-byte pieces per row
// The KV region: two bf16 tiles, or (576, aligned fp8_ds_mla) one bf16 tile + two raw buffers.
template <int D>
constexpr int kv_region_bytes() {
  return D == kMlaDim ? kv_tile_bytes<D>() + 2 * kRawTileBytes : 2 * kv_tile_bytes<D>();
}
static_assert(kv_region_bytes<kMlaDim>() >= 2 * kv_tile_bytes<kMlaDim>(), "region holds two bf16 tiles");
static_assert(kMlaFp8Bytes % 16 == 0 && kv_tile_bytes<kMlaDim>() % 16 == 0 && kv_tile_bytes<kMlaLatent>() % 16 == 0 &&
                  (ld_kv<kMlaDim>() * 2) % 16 == 0 && (ld_kv<kMlaLatent>() * 2) % 16 == 0,
              "16-byte pieces");

// Starts the copy (or, misaligned, does it) of tile `it` (valid slots list[32 it ...]) into
// buffer b: bf16 tile b of the region, or (aligned fp8_ds_mla) raw buffer b. Rows past the
// last valid slot become zeros in the bf16 tile (their P is 0, and 0 * garbage could be NaN).
template <int NT, bool Vec, int D>
__device__ __forceinline__ void issue_kv_tile(const SparseMlaParams& p, const int32_t* list, int nv, int it, int b,
                                              unsigned char* region) {
  constexpr int kLdKv = ld_kv<D>();
  const int k0 = it * kMmaKeys;
  const int nk = nv - k0 < kMmaKeys ? nv - k0 : kMmaKeys;
  uint16_t* const tile = reinterpret_cast<uint16_t*>(region) + b * kv_tile_elems<D>();
  constexpr int kChunks = D / 8;
  if constexpr (Vec) {
    if constexpr (D == kMlaDim) {
      if (p.kv_dtype == DType::kFp8E4M3) {
        unsigned char* const rb = region + kv_tile_bytes<D>() + b * kRawTileBytes;
        const uint8_t* const kvb = static_cast<const uint8_t*>(p.kv);
        for (int c = threadIdx.x; c < nk * kFp8Pieces; c += NT) {
          const int j = c / kFp8Pieces, piece = c % kFp8Pieces;
          cp_async_16(rb + j * kMlaFp8Bytes + piece * 16,
                      kvb + static_cast<int64_t>(list[k0 + j]) * kMlaFp8Bytes + piece * 16);
        }
        return;
      }
    }
    const uint16_t* const kvh = static_cast<const uint16_t*>(p.kv);
    for (int c = threadIdx.x; c < kMmaKeys * kChunks; c += NT) {
      const int j = c / kChunks, part = c % kChunks;
      uint16_t* d = tile + j * kLdKv + part * 8;
      if (j < nk) {
        cp_async_16(d, kvh + static_cast<int64_t>(list[k0 + j]) * D + part * 8);
      } else {
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    }
  } else {
    for (int c = threadIdx.x; c < kMmaKeys * kChunks; c += NT) {
      const int j = c / kChunks, part = c % kChunks;
      uint16_t* d = tile + j * kLdKv + part * 8;
      if (j < nk) {
        stage_kv_piece_bytes<D>(p, list[k0 + j], d, part);
      } else {
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// Raw fp8_ds_mla rows (shared) -> the bf16 tile 0: value x its group's fp32 scale, rounded
// to bf16 (as the CPU does); the RoPE part is copied; rows past nk become zeros.
template <int NT>
__device__ __forceinline__ void dequant_raw_tile(const unsigned char* rb, int nk, uint16_t* tile) {
  constexpr int kChunks = kMlaDim / 8;
  constexpr int kLdKv = ld_kv<kMlaDim>();
  for (int c = threadIdx.x; c < kMmaKeys * kChunks; c += NT) {
    const int j = c / kChunks, part = c % kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (j < nk) {
      const unsigned char* r = rb + j * kMlaFp8Bytes;
      if (part >= kMlaLatent / 8) {
        v = *reinterpret_cast<const uint4*>(r + kMlaLatent + 16 + (part - kMlaLatent / 8) * 16);
      } else {
        const float scale = *reinterpret_cast<const float*>(r + kMlaLatent + 4 * (part * 8 / kQuantGroup));
        v = e4m3x8_scaled_to_bf16(*reinterpret_cast<const uint2*>(r + part * 8), scale);
      }
    }
    *reinterpret_cast<uint4*>(tile + j * kLdKv + part * 8) = v;
  }
}

template <int NG, int D>
struct MlaMmaSmem {
  static constexpr int kHeads = kMlaHeads * NG;
  // Index entries compacted per pass (the pipeline drains at each pass's end). NG = 1 keeps
  // it at 1024 so that two CTAs fit an SM (112,064 B each at D = 576).
  static constexpr int kIdxChunk = NG == 1 ? 1024 : 2048;
  // KV tiles: bf16 tiles 0 and 1, or (576, aligned fp8) bf16 tile 0 + raw buffers 0 and 1.
  alignas(16) unsigned char region[kv_region_bytes<D>()];
  alignas(16) uint16_t q[kHeads * ld_kv<D>()];  // A fragments are read from here (registers are full)
  float sp[NG][4][kMlaHeads][kMmaKeys];  // per-warp partial scores of each head group
  uint16_t p[kHeads * kLdP];             // probabilities, bf16
  float alpha[kHeads];
  float m[kHeads];
  float l[kHeads];
  int32_t bad[kHeads];  // a non-finite score was seen: out and lse are NaN (docs/ops.md)
  float sink[kHeads];   // each head's sink logit (-inf: none), read once up front
  int32_t list[kIdxChunk];
  uint32_t scan[32];
};

// How a row's index list is split across CTAs: split s owns entries [s chunk, (s+1) chunk).
// splits == 1: the CTA writes out and lse itself (o_part == nullptr).
struct MlaSplit {
  int splits = 1;
  int64_t chunk = 0;
  float* o_part = nullptr;  // [splits][s_q][h_q][d_v], unnormalised
  float* ml = nullptr;      // [splits][s_q][h_q][2]: running max (NaN: a non-finite score), sum
};

template <int NG, bool Vec, int D>
__global__ void __launch_bounds__(NG * kGroupThreads, 1)
    sparse_mla_mma_kernel(SparseMlaParams p, MlaSplit sp, int32_t* err) {
  constexpr int NT = NG * kGroupThreads;
  constexpr int kHeads = kMlaHeads * NG;
  constexpr int kLdKv = ld_kv<D>();
  IC_DYNAMIC_SMEM(smem_raw);
  MlaMmaSmem<NG, D>& sm = *reinterpret_cast<MlaMmaSmem<NG, D>*>(smem_raw);
  const int64_t hctas = (p.h_q + kHeads - 1) / kHeads;
  const int split = static_cast<int>(blockIdx.x % static_cast<unsigned>(sp.splits));
  const int64_t rest = blockIdx.x / static_cast<unsigned>(sp.splits);
  const int64_t t = rest / hctas;
  const int64_t h0 = (rest % hctas) * kHeads;
  const int nh = static_cast<int>(std::min<int64_t>(kHeads, p.h_q - h0));
  int32_t* const row_err = h0 == 0 ? err : nullptr;  // each index entry counted once
  const int warp = warp_id(), lane = lane_id();
  const int gi = warp >> 2, wq = warp & 3;  // head group, quarter within it
  const int hg = kMlaHeads * gi;            // the group's first head in the CTA
  const bool active = hg < nh;              // warp-uniform: the group has a real head
  const int g = lane >> 2, tq = lane & 3;
  constexpr int kChunks = D / 8;  // 16-byte pieces per D-value bf16 row
  uint16_t* const tiles = reinterpret_cast<uint16_t*>(sm.region);
  const bool raw_fp8 = Vec && D == kMlaDim && p.kv_dtype == DType::kFp8E4M3;

  // q rows (bf16) -> shared, zeros past the last head.
  const uint16_t* qg = static_cast<const uint16_t*>(p.q) + (t * p.h_q + h0) * D;
  for (int c = threadIdx.x; c < kHeads * kChunks; c += NT) {
    const int hh = c / kChunks, part = c % kChunks;
    uint16_t* d = sm.q + hh * kLdKv + part * 8;
    if (hh >= nh) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    } else if (Vec) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(qg + hh * D + part * 8);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) d[i] = qg[hh * D + part * 8 + i];
    }
  }
  // (The first barrier inside the loop orders these stores before the fragment loads.)
  constexpr int kSteps = D / 16 / 4;  // 9 (576) or 8 (512) k-steps: this warp's quarter of the dims
  static_assert(D % 64 == 0, "the four warps of a group split D in k-steps of 16");

  const int cw = static_cast<int>(p.d_v) / 4;  // value columns per warp (multiple of 16)
  const int nts = cw / 8;
  float o[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  // The running max, sum and non-finite flag of each head live in shared memory (sm.m, sm.l,
  // sm.bad), written only by lane 0 of the head's softmax owner (registers are full).
  if (threadIdx.x < kHeads) {
    sm.m[threadIdx.x] = -__int_as_float(0x7f800000);
    sm.l[threadIdx.x] = 0.f;
    sm.bad[threadIdx.x] = 0;
    sm.sink[threadIdx.x] = threadIdx.x < nh ? mla_sink(p, h0 + threadIdx.x) : -__int_as_float(0x7f800000);
  }

  const int64_t e0 = split * sp.chunk;
  const int64_t e1 = std::min<int64_t>(p.topk + p.n_extra, e0 + sp.chunk);
  constexpr int kIdxChunk = MlaMmaSmem<NG, D>::kIdxChunk;
  for (int64_t c0 = e0; c0 < e1; c0 += kIdxChunk) {
    const int nv = compact_chunk<NT>(p, t, c0, std::min<int64_t>(e1, c0 + kIdxChunk), sm.list, sm.scan, row_err);
    const int ntiles = (nv + kMmaKeys - 1) / kMmaKeys;
    if (ntiles > 0) {
      issue_kv_tile<NT, Vec, D>(p, sm.list, nv, 0, 0, sm.region);
      cp_async_commit();
    }
    for (int it = 0; it < ntiles; ++it) {
      const int b = it & 1;
      // The next tile's buffer was last read before the previous iteration's final barrier.
      if (it + 1 < ntiles) issue_kv_tile<NT, Vec, D>(p, sm.list, nv, it + 1, b ^ 1, sm.region);
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of tile `it` have landed
      __syncthreads();     // ... and everyone's
      const int nk = nv - it * kMmaKeys < kMmaKeys ? nv - it * kMmaKeys : kMmaKeys;
      const uint16_t* kv = tiles + (raw_fp8 ? 0 : b * kv_tile_elems<D>());
      if constexpr (D == kMlaDim) {
        if (raw_fp8) {
          dequant_raw_tile<NT>(sm.region + kv_tile_bytes<D>() + b * kRawTileBytes, nk, tiles);
          __syncthreads();
        }
      }
      // Partial S over this warp's D / 4 dims (144 / 128): 16 heads x 32 keys.
      if (active) {
        float acc[kMmaKeys / 8][4];
#pragma unroll
        for (int nt = 0; nt < kMmaKeys / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          uint32_t qa[4];
          load_a_frag(qa, sm.q, kLdKv, hg, (wq * kSteps + s) * 16);
#pragma unroll
          for (int nt = 0; nt < kMmaKeys / 8; ++nt) {
            uint32_t b0, b1;
            load_b_frag_nk(b0, b1, kv, kLdKv, nt * 8, (wq * kSteps + s) * 16);
            mma_bf16_16816(acc[nt], qa, b0, b1);
          }
        }
#pragma unroll
        for (int nt = 0; nt < kMmaKeys / 8; ++nt) {
          sm.sp[gi][wq][g][nt * 8 + 2 * tq] = acc[nt][0];
          sm.sp[gi][wq][g][nt * 8 + 2 * tq + 1] = acc[nt][1];
          sm.sp[gi][wq][g + 8][nt * 8 + 2 * tq] = acc[nt][2];
          sm.sp[gi][wq][g + 8][nt * 8 + 2 * tq + 1] = acc[nt][3];
        }
      }
      __syncthreads();
      // Online softmax: warp (gi, wq) owns heads 4 wq .. 4 wq + 3 of group gi, lane = key.
      if (active) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int hh = wq * 4 + i;
          const bool valid = lane < nk;
          const float m_run = sm.m[hg + hh];
          float s = (((sm.sp[gi][0][hh][lane] + sm.sp[gi][1][hh][lane]) + sm.sp[gi][2][hh][lane]) +
                     sm.sp[gi][3][hh][lane]) *
                    p.sm_scale;
          const bool bad = __ballot_sync(kFullMask, valid && !is_finite_f(s)) != 0u;
          s = valid ? s : -__int_as_float(0x7f800000);
          const float m_new = fmaxf(m_run, warp_max_f(s));
          const float alpha = expf(m_run - m_new);
          const float e = valid ? expf(s - m_new) : 0.f;
          const float sum = warp_sum(e);
          sm.p[(hg + hh) * kLdP + lane] = float_to_bf16(e);
          __syncwarp();  // every lane has read sm.m before lane 0 rewrites it
          if (lane == 0) {
            sm.l[hg + hh] = sm.l[hg + hh] * alpha + sum;
            sm.m[hg + hh] = m_new;
            if (bad) sm.bad[hg + hh] = 1;
            sm.alpha[hg + hh] = alpha;
          }
        }
      }
      __syncthreads();
      // O[group's heads, warp's columns] = alpha * O + P V; V is the first d_v columns of the
      // same tile (for D = 512 and d_v = 512 the whole key row: K = V).
      if (active) {
        const float a_lo = sm.alpha[hg + g], a_hi = sm.alpha[hg + g + 8];
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
          load_a_frag(pa, sm.p, kLdP, hg, ks * 16);
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) {
            if (nt < nts) {
              uint32_t b0, b1;
              load_b_frag_kn(b0, b1, kv, kLdKv, wq * cw + nt * 8, ks * 16);
              mma_bf16_16816(o[nt], pa, b0, b1);
            }
          }
        }
      }
      __syncthreads();  // the tile buffers, sp, p, alpha are rewritten next
    }
  }
  __syncthreads();
  if (sp.o_part == nullptr) {
    // One thread per head finishes the softmax (sink included) and leaves the output scale in
    // sm.l, so the 64 live O accumulators below never share registers with the finish's math.
    if (threadIdx.x < nh) {
      const int hh = threadIdx.x;
      const MlaFinish f = mla_finish(sm.m[hh], sm.l[hh], sm.bad[hh] != 0, sm.sink[hh]);
      p.lse[t * p.h_q + h0 + hh] = f.lse;
      sm.l[hh] = f.scale;
    }
    __syncthreads();
    uint16_t* out = static_cast<uint16_t*>(p.out);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int hh = hg + g + 8 * half;
      if (hh >= nh) continue;
      // NaN times anything is NaN: a bad head's whole row comes out NaN.
      const float inv = sm.l[hh];
      uint16_t* orow = out + (t * p.h_q + h0 + hh) * p.d_v;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        if (nt < nts) {
          const int col = wq * cw + nt * 8 + 2 * tq;
          orow[col] = float_to_bf16(o[nt][2 * half] * inv);
          orow[col + 1] = float_to_bf16(o[nt][2 * half + 1] * inv);
        }
      }
    }
  } else {
    // This split's share: unnormalised O and (m, l); a non-finite score marks m NaN.
    const int64_t base = (split * p.s_q + t) * p.h_q + h0;
    if (threadIdx.x < nh) {
      sp.ml[2 * (base + threadIdx.x)] = sm.bad[threadIdx.x] ? quiet_nan() : sm.m[threadIdx.x];
      sp.ml[2 * (base + threadIdx.x) + 1] = sm.l[threadIdx.x];
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int hh = hg + g + 8 * half;
      if (hh >= nh) continue;
      float* orow = sp.o_part + (base + hh) * p.d_v;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        if (nt < nts) {
          const int col = wq * cw + nt * 8 + 2 * tq;
          orow[col] = o[nt][2 * half];
          orow[col + 1] = o[nt][2 * half + 1];
        }
      }
    }
  }
}

// One CTA per (query row, head): combines the splits' partials in split order (deterministic).
// Any split with a non-finite score: out and lse NaN; no valid slot in any split: 0 and -inf.
__global__ void __launch_bounds__(kMergeThreads) sparse_mla_merge_kernel(SparseMlaParams p, MlaSplit sp) {
  __shared__ float w[kMaxSplits];
  __shared__ float inv_s;
  const int64_t row = blockIdx.x;  // t * h_q + h
  const int64_t rows = p.s_q * p.h_q;
  if (threadIdx.x == 0) {
    const float ninf = -__int_as_float(0x7f800000);
    float mx = ninf;
    bool bad = false;
    for (int s = 0; s < sp.splits; ++s) {
      const float m = sp.ml[2 * (s * rows + row)], l = sp.ml[2 * (s * rows + row) + 1];
      if (m != m) bad = true;
      else if (l > 0.f) mx = fmaxf(mx, m);
    }
    float sum = 0.f;
    for (int s = 0; s < sp.splits; ++s) {
      const float m = sp.ml[2 * (s * rows + row)], l = sp.ml[2 * (s * rows + row) + 1];
      const float ws = (!bad && l > 0.f) ? expf(m - mx) : 0.f;
      w[s] = ws;
      sum += l * ws;
    }
    // The sink joins once, here (the splits' partials leave it out).
    const MlaFinish f = mla_finish(mx, sum, bad, mla_sink(p, row % p.h_q));
    p.lse[row] = f.lse;
    inv_s = f.scale;
  }
  __syncthreads();
  const float inv = inv_s;
  uint16_t* orow = static_cast<uint16_t*>(p.out) + row * p.d_v;
  for (int c = threadIdx.x; c < p.d_v; c += kMergeThreads) {
    float acc = 0.f;
    for (int s = 0; s < sp.splits; ++s) {
      const float ws = w[s];
      if (ws != 0.f) acc = fmaf(sp.o_part[(s * rows + row) * p.d_v + c], ws, acc);
    }
    orow[c] = float_to_bf16(acc * inv);
  }
}

// ------------------------------------------------------------------ fp32 FMA path

template <int D>
__global__ void __launch_bounds__(kFmaThreads) sparse_mla_fma_kernel(SparseMlaParams p, int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  MlaFmaSmem<D>& sm = *reinterpret_cast<MlaFmaSmem<D>*>(smem_raw);
  constexpr int kLdF = MlaFmaSmem<D>::kLdF;
  const int64_t groups = (p.h_q + kMlaHeads - 1) / kMlaHeads;
  const int64_t t = blockIdx.x / groups;
  const int64_t h0 = (blockIdx.x % groups) * kMlaHeads;
  const int nh = static_cast<int>(std::min<int64_t>(kMlaHeads, p.h_q - h0));
  int32_t* const row_err = h0 == 0 ? err : nullptr;
  const bool q32 = p.q_dtype == DType::kFloat32;
  for (int idx = threadIdx.x; idx < kMlaHeads * D; idx += kFmaThreads) {
    const int hh = idx / D, c = idx % D;
    float v = 0.f;
    if (hh < nh) {
      const int64_t at = (t * p.h_q + h0 + hh) * D + c;
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
  const int64_t entries = p.topk + p.n_extra;  // indices, then extra_indices
  for (int64_t c0 = 0; c0 < entries; c0 += kFmaThreads) {
    const int nv = compact_indices<kFmaThreads>(p, t, c0, entries, sm.list, sm.scan, row_err);  // barrier inside
    for (int k0 = 0; k0 < nv; k0 += kFmaKeys) {
      const int nk = nv - k0 < kFmaKeys ? nv - k0 : kFmaKeys;
      for (int idx = threadIdx.x; idx < kFmaKeys * D; idx += kFmaThreads) {
        const int jj = idx / D, c = idx % D;
        sm.kv[jj * kLdF + c] = jj < nk ? kv_elem<D>(p, sm.list[k0 + jj], c) : 0.f;
      }
      __syncthreads();
      const float* qr = sm.q + hh * kLdF;
      const float* kr = sm.kv + j * kLdF;
      float d = 0.f;
#pragma unroll 8
      for (int c = 0; c < D; ++c) d = fmaf(qr[c], kr[c], d);
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
  if (threadIdx.x < nh) {
    const int h = threadIdx.x;
    const MlaFinish f = mla_finish(sm.m[h], sm.l[h], sm.bad[h] != 0, mla_sink(p, h0 + h));
    p.lse[t * p.h_q + h0 + h] = f.lse;
    sm.alpha[h] = f.num;  // free after the last tile: out = acc * num / den
    sm.l[h] = f.den;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = threadIdx.x + i * kFmaThreads;
    if (c >= p.d_v) continue;
#pragma unroll
    for (int h = 0; h < kMlaHeads; ++h) {
      if (h >= nh) continue;
      // (acc * 1) / l without a sink, as before sinks existed; NaN for a bad head, 0 for none.
      const float v = acc[h][i] * sm.alpha[h] / sm.l[h];
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


// Splits of each row's index list: only when the (query row, head CTA) pairs leave at least
// half the SMs idle, at most one wave of CTAs, at least kMinSplitEntries entries per split,
// at most kMaxSplits. A function of the shape and the SM count only (deterministic results).
inline int mla_num_splits(int64_t base_ctas, int64_t topk, int sms) {
  if (base_ctas <= 0 || base_ctas * 2 > sms) return 1;
  const int64_t s = std::min<int64_t>({sms / base_ctas, topk / kMinSplitEntries, kMaxSplits});
  return static_cast<int>(std::max<int64_t>(s, 1));
}

template <int NG, bool Vec, int D>
void launch_mma(const SparseMlaParams& p, const MlaSplit& sp, int64_t ctas, const DeviceEnv& env) {
  const int smem = mla_smem(sparse_mla_mma_kernel<NG, Vec, D>, static_cast<int>(sizeof(MlaMmaSmem<NG, D>)), env);
  IC_LAUNCH((sparse_mla_mma_kernel<NG, Vec, D>), dim3(static_cast<unsigned>(ctas)), NG * kGroupThreads, smem,
            env.stream, p, sp, env.err);
}

template <int D>
int mma_smem_bytes(int ng) {
  return static_cast<int>(ng == 4 ? sizeof(MlaMmaSmem<4, D>)
                                  : (ng == 2 ? sizeof(MlaMmaSmem<2, D>) : sizeof(MlaMmaSmem<1, D>)));
}
// Shared memory per CTA on the H100 / H200 (227 KB opt-in): the 64-head CTAs must fit.
static_assert(sizeof(MlaMmaSmem<4, kMlaDim>) <= 232448 && sizeof(MlaMmaSmem<4, kMlaLatent>) <= 232448,
              "a 64-head sparse MLA CTA fits sm_90's 227 KB of shared memory");

template <bool Vec, int D>
void launch_mma_heads(int ng, const SparseMlaParams& p, const MlaSplit& sp, int64_t ctas, const DeviceEnv& env) {
  if (ng == 4) {
    launch_mma<4, Vec, D>(p, sp, ctas, env);
  } else if (ng == 2) {
    launch_mma<2, Vec, D>(p, sp, ctas, env);
  } else {
    launch_mma<1, Vec, D>(p, sp, ctas, env);
  }
}

template <int D>
void launch_mma_aligned(bool vec, int ng, const SparseMlaParams& p, const MlaSplit& sp, int64_t ctas,
                        const DeviceEnv& env) {
  if (vec) {
    launch_mma_heads<true, D>(ng, p, sp, ctas, env);
  } else {
    launch_mma_heads<false, D>(ng, p, sp, ctas, env);
  }
}

}  // namespace mla_detail

void sparse_mla_cuda(const SparseMlaParams& p, const DeviceEnv& env) {
  using namespace mla_detail;
  TORCH_CHECK(p.d_qk == kMlaDim || (p.d_qk == kMlaLatent && p.kv_dtype != DType::kFp8E4M3),
              "the CUDA sparse_mla takes d_qk 576 (any cache) or 512 (bf16/fp32 cache), got ", p.d_qk);
  if (p.s_q == 0 || p.h_q == 0) return;
  const bool wide = p.d_qk == kMlaDim;
  const int64_t entries = p.topk + p.n_extra;  // indices, then extra_indices: one list per row
  if (p.q_dtype == DType::kBFloat16 && p.kv_dtype != DType::kFloat32) {
    // Heads per CTA: 64, or h_q rounded up to 16 when smaller (16 or 32); fewer where the
    // device's shared memory per block cannot hold that CTA (A100: 163 KB takes 32 heads).
    int ng = p.h_q > 2 * kMlaHeads ? 4 : (p.h_q > kMlaHeads ? 2 : 1);
    while (ng > 1 && (wide ? mma_smem_bytes<kMlaDim>(ng) : mma_smem_bytes<kMlaLatent>(ng)) > env.smem_optin) ng /= 2;
    const int64_t heads = kMlaHeads * ng;
    const int64_t base = p.s_q * ((p.h_q + heads - 1) / heads);
    MlaSplit sp;
    sp.chunk = entries;
    const int want = mla_num_splits(base, entries, env.sms);
    if (want > 1) {
      // Whole tiles per split where possible; the last split may be shorter.
      sp.chunk = ((entries + want - 1) / want + kMmaKeys - 1) / kMmaKeys * kMmaKeys;
      sp.splits = static_cast<int>((entries + sp.chunk - 1) / sp.chunk);
    }
    const int64_t ctas = base * sp.splits;
    TORCH_CHECK(ctas <= INT_MAX && p.s_q * p.h_q <= INT_MAX,
                "too many (query, head group) pairs for the CUDA sparse MLA: ", ctas);
    if (sp.splits > 1) {
      const int64_t rows = sp.splits * p.s_q * p.h_q;
      sp.o_part = static_cast<float*>(env.alloc(rows * p.d_v * 4));
      sp.ml = static_cast<float*>(env.alloc(rows * 2 * 4));
    }
    const uintptr_t qa = reinterpret_cast<uintptr_t>(p.q), ka = reinterpret_cast<uintptr_t>(p.kv);
    // bf16 rows are 1152 B, fp8 rows 656 B: both keep 16-byte alignment from the base.
    const bool vec = (qa % 16 == 0) && (ka % 16 == 0);
    if (wide) {
      launch_mma_aligned<kMlaDim>(vec, ng, p, sp, ctas, env);
    } else {
      launch_mma_aligned<kMlaLatent>(vec, ng, p, sp, ctas, env);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (sp.splits > 1) {
      IC_LAUNCH(sparse_mla_merge_kernel, dim3(static_cast<unsigned>(p.s_q * p.h_q)), kMergeThreads, 0, env.stream,
                p, sp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
  const int64_t ctas = p.s_q * ((p.h_q + kMlaHeads - 1) / kMlaHeads);
  TORCH_CHECK(ctas <= INT_MAX, "too many (query, head group) pairs for the CUDA sparse MLA: ", ctas);
  if (wide) {
    const int smem = mla_smem(sparse_mla_fma_kernel<kMlaDim>, static_cast<int>(sizeof(MlaFmaSmem<kMlaDim>)), env);
    IC_LAUNCH(sparse_mla_fma_kernel<kMlaDim>, dim3(static_cast<unsigned>(ctas)), kFmaThreads, smem, env.stream, p,
              env.err);
  } else {
    const int smem =
        mla_smem(sparse_mla_fma_kernel<kMlaLatent>, static_cast<int>(sizeof(MlaFmaSmem<kMlaLatent>)), env);
    IC_LAUNCH(sparse_mla_fma_kernel<kMlaLatent>, dim3(static_cast<unsigned>(ctas)), kFmaThreads, smem, env.stream,
              p, env.err);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
