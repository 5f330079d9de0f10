// MiniMax-M3's block-sparse ops on CUDA (indexcache/block_sparse.h; reference_block_sparse.py
// defines them). Torch-free kernels and launch code; the op glue is in block_sparse.cu. Both
// kernels are plain fp32 FMA code over 128 threads (no tensor cores yet): they aim at exactly
// the reference's semantics, with the CPU kernels' summation structure, and are deterministic
// (fixed orders, no float atomics).
//
// block_topk / block_topk_paged (block_topk_kernel): one CTA per query row, all of its indexer
// heads. The row's q stays in shared memory; its keys stream through shared memory in tiles of
// 64 (converted to fp32 once), each (head, key) score is a fp32 dot product, and the tile's
// scores are max-pooled into the row's per-block maxima right away, kept as order keys
// (common.cuh order_key: NaN above +inf, -0 == +0, so the max is amax with NaN propagating).
// Only [h, num_blocks] maxima exist per row (in shared memory, or in a global scratch of
// [rows, h, num_blocks] when they do not fit), never [s_q, s_kv] scores. Then per head: the
// local blocks are forced (+inf), blocks scoring -inf (or with nothing visible) are out, and
// the exact radix select of common.cuh keeps the best topk under (score desc, id asc); it
// emits in increasing block id, so the row is written ascending, then -1.
//
// block_sparse_attention (block_attn_kernel): one CTA per (query row, KV head) with its
// g = h_q / h_kv query heads. The row's selected ids are sanitised (-1, ids past the row's
// position), deduplicated and sorted ascending in shared memory; each selected block's keys
// <= pos go through shared memory in tiles of 32 (K and V in fp32), scores for the g heads,
// an online softmax per head (one warp per head, running max / sum in shared memory) and
// P·V into an fp32 accumulator [g][d] in shared memory. A NaN or ±inf score makes the head's
// out and lse NaN (docs/ops.md); a row with no key writes 0 and lse -inf.
//
// Invalid index values (windows outside the keys, seq_lens past the block table, pages outside
// the cache, req / pos out of range, block ids < -1) never fault: they act as empty (a row with
// no key, a -1 id) and count in the device's error word (kernels.h DeviceEnv::err); with
// INDEXCACHE_CHECK=1 the op glue rejects them on the host first, with the CPU's messages.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common.cuh"
#include "indexcache/block_sparse.h"
#include "indexcache/fp8.h"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace bs_detail {

constexpr int kThreads = 128;   // 4 warps, both kernels
constexpr int kWarps = kThreads / 32;
constexpr int kTopkKeys = 64;   // keys per block_topk tile
constexpr int kAttnKeys = 32;   // keys per attention tile: one per lane in the softmax
constexpr uint32_t kNegInfKey = 0x007FFFFFu;  // order_key(-inf): never selected at or below
constexpr uint32_t kPosInfKey = 0xFF800000u;  // order_key(+inf): a forced local block
constexpr int64_t kMaxScratchBytes = int64_t{256} << 20;  // global block maxima per launch
constexpr int64_t kMinSplitKeys = 2048;  // keys per scoring CTA at least, when rows are split
constexpr int64_t kMinSplitKeysAttn = 256;  // attention: selected keys per split CTA at least
constexpr int64_t kMaxAttnSplits = 32;

__device__ __forceinline__ float load_f(const void* base, int64_t i, bool f32) {
  return f32 ? static_cast<const float*>(base)[i] : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fc00000); }

// Key rows in shared memory are ld_keys(d) floats apart: d + 4 when d % 4 == 0 (16-byte rows
// read as float4: the 8 lanes of a quarter-warp land 4 banks apart, no conflict), else d + 1
// (scalar reads, 1 bank apart).
__host__ __device__ __forceinline__ int ld_keys(int64_t d) { return static_cast<int>(d % 4 == 0 ? d + 4 : d + 1); }

// Σ a[c] b[c], c < d, as one fmaf chain in c order (the same bits on both paths); a and b are
// 16-byte aligned when d % 4 == 0.
__device__ __forceinline__ float dot_smem(const float* a, const float* b, int d) {
  float acc = 0.f;
  if (d % 4 == 0) {
    for (int c = 0; c < d; c += 4) {
      const float4 x = *reinterpret_cast<const float4*>(a + c);
      const float4 y = *reinterpret_cast<const float4*>(b + c);
      acc = fmaf(x.x, y.x, acc);
      acc = fmaf(x.y, y.y, acc);
      acc = fmaf(x.z, y.z, acc);
      acc = fmaf(x.w, y.w, acc);
    }
  } else {
    for (int c = 0; c < d; ++c) acc = fmaf(a[c], b[c], acc);
  }
  return acc;
}

// 1 if any thread of the block passes a nonzero v (flag: shared int; barriers inside, every
// thread must call it).
__device__ __forceinline__ bool block_any(bool v, int* flag) {
  if (threadIdx.x == 0) *flag = 0;
  __syncthreads();
  if (v) atomicAdd(flag, 1);
  __syncthreads();
  const bool r = *flag != 0;
  __syncthreads();  // flag may be reused right after
  return r;
}

// Whether pages [0, ceil(used / page_size)) of table row bt all lie in [0, num_pages). Every
// thread must call it (barriers inside).
__device__ __forceinline__ bool pages_valid(const int32_t* bt, int64_t used, int64_t page_size, int64_t num_pages,
                                            int* flag) {
  const int ps = static_cast<int>(page_size);  // 32-bit division: positions fit int (launchers)
  const int64_t np = used > 0 ? (static_cast<int>(used) - 1) / ps + 1 : 0;
  bool bad = false;
  for (int64_t i = threadIdx.x; i < np; i += kThreads) {
    const int32_t pg = bt[i];
    bad = bad || pg < 0 || pg >= num_pages;
  }
  return !block_any(bad, flag);
}

// ------------------------------------------------------------------ block_topk

// kFused: a CTA scores its row's keys and selects. Few rows over long windows instead split
// each row's blocks over CTAs: kScore (blockIdx.y: split_blocks blocks, their maxima into the
// global scratch), then kSelect (one CTA per row, from the scratch).
enum TopkMode : int { kFused = 0, kScore = 1, kSelect = 2 };

struct TopkLaunch {
  int64_t row_begin;     // this launch's first row
  int64_t nb_cap;        // block maxima per (row, head) the storage holds
  uint32_t* gbs;         // [rows of this launch, h, nb_cap] global maxima, nullptr: in shared memory
  int mode;              // TopkMode
  int64_t split_blocks;  // kScore: blocks per CTA
};

// Keys row t sees and where (prefill: k[lo + i]; paged: page table bt). Invalid values give
// n = 0, counted once (prefill: per row; paged: per request, by its row 0).
__device__ __forceinline__ int64_t topk_window(const BlockTopkParams& p, int64_t t, int64_t& lo, const int32_t*& bt,
                                               int* flag, int32_t* err) {
  lo = 0;
  bt = nullptr;
  if (p.ks != nullptr) {
    const int64_t a = p.ks[t], b = p.ke[t];
    const bool ok = a >= 0 && a <= b && b <= p.s_kv;
    if (!ok && threadIdx.x == 0) count_error(err);
    lo = ok ? a : 0;
    return ok ? b - a : 0;
  }
  const int tt = static_cast<int>(t), nn = static_cast<int>(p.next_n);
  const int64_t b = tt / nn, j = tt % nn, sl = p.seq_lens[b];
  bt = p.block_table + b * p.max_pages;
  bool ok = sl >= 0 && sl <= p.max_pages * p.page_size;
  ok = pages_valid(bt, ok ? sl : 0, p.page_size, p.num_pages, flag) && ok;
  if (!ok && j == 0 && threadIdx.x == 0) count_error(err);
  const int64_t n = sl - p.next_n + j + 1;
  return ok && n > 0 ? n : 0;
}

// Scores of tile [i0, i0 + nk) of the row folded into its block maxima bs [h][nb].
__device__ __forceinline__ void topk_tile(const BlockTopkParams& p, int64_t lo, const int32_t* bt, int64_t i0, int nk,
                                          const float* qs, float* ks, float* ss, uint32_t* bs, int64_t nb) {
  const int d = static_cast<int>(p.d), ldk = ld_keys(d), h = static_cast<int>(p.h);
  const bool f32 = p.qk_dtype == DType::kFloat32;
  for (int idx = threadIdx.x; idx < nk * d; idx += kThreads) {
    const int j = idx / d, c = idx - j * d;
    const int i = static_cast<int>(i0) + j, ps = static_cast<int>(p.page_size);
    const int64_t row = bt == nullptr ? lo + i : static_cast<int64_t>(bt[i / ps]) * ps + i % ps;
    ks[j * ldk + c] = load_f(p.k, row * d + c, f32);
  }
  __syncthreads();
  // Thread (head hh, key j): consecutive lanes read consecutive key rows, q is broadcast.
  for (int idx = threadIdx.x; idx < h * kTopkKeys; idx += kThreads) {
    const int hh = idx / kTopkKeys, j = idx % kTopkKeys;
    if (j < nk) ss[hh * kTopkKeys + j] = dot_smem(qs + hh * d, ks + j * ldk, d);
  }
  __syncthreads();
  // One thread per (head, index block touched by the tile); the block's keys inside the tile.
  const int bszi = static_cast<int>(p.block_size), b_lo = static_cast<int>(i0) / bszi;
  const int64_t bsz = bszi;
  const int nbt = (static_cast<int>(i0) + nk - 1) / bszi - b_lo + 1;
  for (int idx = threadIdx.x; idx < h * nbt; idx += kThreads) {
    const int hh = idx / nbt;
    const int64_t b = b_lo + idx % nbt;
    const int64_t a = b * bsz > i0 ? b * bsz - i0 : 0;
    const int64_t e = (b + 1) * bsz < i0 + nk ? (b + 1) * bsz - i0 : nk;
    uint32_t m = bs[hh * nb + b];
    for (int64_t j = a; j < e; ++j) {
      const uint32_t key = order_key(ss[hh * kTopkKeys + j]);
      m = key > m ? key : m;
    }
    bs[hh * nb + b] = m;
  }
  __syncthreads();
}

// Per head: forced local blocks, then the top topk_blocks by (max desc, id asc), ascending.
__device__ __forceinline__ void topk_select(const BlockTopkParams& p, const uint32_t* bs, int64_t nb, int32_t* out,
                                            SelectShared& sel) {
  const int64_t qb = nb - 1;  // the query's own block
  const int64_t f_lo = p.local_blocks > 0 ? (qb - p.local_blocks + 1 > 0 ? qb - p.local_blocks + 1 : 0) : qb + 1;
  const int n = static_cast<int>(nb);
  const uint32_t k = static_cast<uint32_t>(p.topk_blocks);
  for (int hh = 0; hh < p.h; ++hh) {
    const uint32_t* row = bs + hh * nb;
    // Captures by value: a by-reference capture would put the captured locals on the stack.
    auto acc = [=](int i, uint32_t& key) -> bool {
      key = i >= f_lo ? kPosInfKey : row[i];
      return key > kNegInfKey;
    };
    uint32_t mine = 0;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      uint32_t key;
      mine += acc(i, key) ? 1u : 0u;
    }
    uint32_t valid;
    block_incl_scan<kThreads>(mine, sel.scan, valid);
    int32_t* o = out + hh * p.topk_blocks;
    uint32_t emitted = 0;
    if (valid > 0) {
      const Threshold thr = valid <= k ? select_all() : block_threshold<kThreads>(n, k, acc, sel);
      emitted = block_emit<kThreads>(n, thr, acc, sel, [=](uint32_t rank, int i, uint32_t) { o[rank] = i; });
    }
    for (int64_t r = emitted + threadIdx.x; r < p.topk_blocks; r += kThreads) o[r] = -1;
    __syncthreads();
  }
}

// At least 4 CTAs per SM (what its shared memory allows at d = 128): without the bound ptxas
// picked 72 registers and spilled two (test_sass); with it, 86 and none.
__global__ void __launch_bounds__(kThreads, 4) block_topk_kernel(BlockTopkParams p, TopkLaunch L, int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  __shared__ SelectShared sel;
  __shared__ int flag;
  const int64_t t = L.row_begin + blockIdx.x;
  const int d = static_cast<int>(p.d), h = static_cast<int>(p.h);
  float* qs = reinterpret_cast<float*>(smem_raw);      // [h][d]
  float* ks = qs + h * d;                               // [kTopkKeys][ld_keys(d)]
  float* ss = ks + kTopkKeys * ld_keys(d);              // [h][kTopkKeys]
  uint32_t* bs = L.gbs != nullptr ? L.gbs + static_cast<int64_t>(blockIdx.x) * h * L.nb_cap
                                  : reinterpret_cast<uint32_t*>(ss + h * kTopkKeys);  // [h][nb]
  int64_t lo;
  const int32_t* bt;
  // An invalid window counts once: in the fused launch, or by the row's first scoring CTA.
  const bool counts = L.mode == kFused || (L.mode == kScore && blockIdx.y == 0);
  const int64_t n = topk_window(p, t, lo, bt, &flag, counts ? err : nullptr);
  int32_t* out = p.out + t * p.h * p.topk_blocks;
  if (n == 0 || p.topk_blocks == 0) {
    if (L.mode != kScore)
      for (int64_t i = threadIdx.x; i < p.h * p.topk_blocks; i += kThreads) out[i] = -1;
    return;
  }
  const int bszi = static_cast<int>(p.block_size);
  const int64_t nb = (static_cast<int>(n) - 1) / bszi + 1;  // n >= 1, no overflow
  if (L.mode != kSelect) {
    int64_t b0 = 0, b1 = nb;  // this CTA's blocks
    if (L.mode == kScore) {
      b0 = static_cast<int64_t>(blockIdx.y) * L.split_blocks;
      b1 = b0 + L.split_blocks < nb ? b0 + L.split_blocks : nb;
      if (b0 >= b1) return;  // past the row's last block
    }
    const bool f32 = p.qk_dtype == DType::kFloat32;
    for (int idx = threadIdx.x; idx < h * d; idx += kThreads) qs[idx] = load_f(p.q, t * h * d + idx, f32);
    for (int hh = 0; hh < h; ++hh)
      for (int64_t b = b0 + threadIdx.x; b < b1; b += kThreads) bs[hh * nb + b] = 0u;  // below every score
    __syncthreads();
    const int64_t end = b1 * bszi < n ? b1 * bszi : n;
    for (int64_t i0 = b0 * bszi; i0 < end; i0 += kTopkKeys)
      topk_tile(p, lo, bt, i0, static_cast<int>(end - i0 < kTopkKeys ? end - i0 : kTopkKeys), qs, ks, ss, bs, nb);
  }
  if (L.mode != kScore) topk_select(p, bs, nb, out, sel);
}

inline int64_t topk_smem_base(const BlockTopkParams& p) {
  return 4 * (p.h * p.d + kTopkKeys * ld_keys(p.d) + p.h * kTopkKeys);
}

// Dynamic shared memory a kernel may take (the device's opt-in limit less its static part).
inline int64_t dynamic_budget(const DeviceEnv& env, int64_t static_bytes) {
  return static_cast<int64_t>(env.smem_optin) - static_bytes - 64;
}

template <typename Kernel>
void set_smem(Kernel kernel, int64_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// ------------------------------------------------------------------ block_sparse_attention

// splits > 1 (few (row, KV head) pairs): CTA (pair, split) folds list entries [split * per,
// (split + 1) * per) of the row's sorted selection into a partial result, and
// block_attn_merge_kernel combines the splits by log-sum-exp.
struct AttnLayout {
  int g;           // query heads per KV head
  int splits;      // CTAs per (row, KV head)
  int per;         // selected blocks per split
  float* o_part;   // [splits, s_q * h_q, d] unnormalised accumulators (splits > 1)
  float* ml;       // [splits, s_q * h_q, 2] running max (NaN: a non-finite score) and sum
};

__host__ __device__ __forceinline__ int64_t attn_smem_floats(int64_t g, int64_t d, int64_t topk) {
  // q, K tile, V tile, P, acc, m / l / alpha / bad per head, ids / keep / list per entry
  return g * d + kAttnKeys * ld_keys(d) + kAttnKeys * d + g * kAttnKeys + g * d + 4 * g + 3 * topk;
}

struct AttnSmem {
  float* q;      // [g][d]
  float* k;      // [kAttnKeys][ld_keys(d)]
  float* v;      // [kAttnKeys][d]
  float* s;      // [g][kAttnKeys] scores, then softmax numerators
  float* acc;    // [g][d]
  float* m;      // [g] running max
  float* l;      // [g] running sum
  float* alpha;  // [g] this tile's rescale
  int* bad;      // [g] a score was NaN / ±inf
  int* ids;      // [topk] usable ids (-1: none)
  int* keep;     // [topk] first occurrence of a usable id
  int* list;     // [topk] selected ids ascending
};

__device__ __forceinline__ AttnSmem attn_smem(unsigned char* raw, int g, int d, int64_t topk) {
  AttnSmem s;
  float* f = reinterpret_cast<float*>(raw);
  s.q = f;
  s.k = s.q + g * d;
  s.v = s.k + kAttnKeys * ld_keys(d);
  s.s = s.v + kAttnKeys * d;
  s.acc = s.s + g * kAttnKeys;
  s.m = s.acc + g * d;
  s.l = s.m + g;
  s.alpha = s.l + g;
  s.bad = reinterpret_cast<int*>(s.alpha + g);
  s.ids = s.bad + g;
  s.keep = s.ids + topk;
  s.list = s.keep + topk;
  return s;
}

// The row's usable block ids for this KV head, deduplicated, ascending in sm.list; returns how
// many. Ids < -1 count in err (each entry belongs to exactly one CTA); ids past the row's
// position, or any id of an invalid row (ok false), are dropped silently.
__device__ __forceinline__ int attn_block_list(const BlockSparseAttnParams& p, int64_t t, int64_t kh, bool ok,
                                               int64_t pos, const AttnSmem& sm, uint32_t* scan, int32_t* err) {
  const int32_t* row = p.blocks + (t * p.h_kv + kh) * p.topk;
  const int64_t last = static_cast<int>(pos) / static_cast<int>(p.block_size);
  for (int64_t i = threadIdx.x; i < p.topk; i += kThreads) {
    const int32_t id = row[i];
    if (id < -1) count_error(err);
    sm.ids[i] = ok && id >= 0 && id <= last ? id : -1;
  }
  __syncthreads();
  uint32_t mine = 0;
  for (int64_t i = threadIdx.x; i < p.topk; i += kThreads) {
    const int id = sm.ids[i];
    bool first = id >= 0;
    for (int64_t j = 0; first && j < i; ++j) first = sm.ids[j] != id;
    sm.keep[i] = first ? 1 : 0;
    mine += first ? 1u : 0u;
  }
  uint32_t total;
  block_incl_scan<kThreads>(mine, scan, total);  // barriers inside: keep is visible after it
  for (int64_t i = threadIdx.x; i < p.topk; i += kThreads) {
    if (!sm.keep[i]) continue;
    const int id = sm.ids[i];
    int rank = 0;
    for (int64_t j = 0; j < p.topk; ++j) rank += (sm.keep[j] && sm.ids[j] < id) ? 1 : 0;
    sm.list[rank] = id;
  }
  __syncthreads();
  return static_cast<int>(total);
}

// One tile of nk keys from position k0: scores, online softmax per head, P·V.
__device__ __forceinline__ void attn_tile(const BlockSparseAttnParams& p, int64_t kh, const int32_t* bt, int64_t k0,
                                          int nk, int g, const AttnSmem& sm) {
  const int d = static_cast<int>(p.d), ldk = ld_keys(d);
  const bool f32 = p.dtype == DType::kFloat32;
  for (int idx = threadIdx.x; idx < nk * d; idx += kThreads) {
    const int j = idx / d, c = idx - j * d;
    const int i = static_cast<int>(k0) + j, ps = static_cast<int>(p.page_size);
    const int64_t slot = static_cast<int64_t>(bt[i / ps]) * ps + i % ps;
    const int64_t at = (slot * p.h_kv + kh) * d + c;
    sm.k[j * ldk + c] = load_f(p.k_cache, at, f32);
    sm.v[j * d + c] = load_f(p.v_cache, at, f32);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < g * kAttnKeys; idx += kThreads) {
    const int hh = idx / kAttnKeys, j = idx % kAttnKeys;
    if (j < nk) sm.s[hh * kAttnKeys + j] = dot_smem(sm.q + hh * d, sm.k + j * ldk, d) * p.scale;
  }
  __syncthreads();
  const int lane = lane_id();
  for (int hh = warp_id(); hh < g; hh += kWarps) {  // one warp per head, one key per lane
    const bool valid = lane < nk;
    const float s = valid ? sm.s[hh * kAttnKeys + lane] : neg_inf();
    int bad = valid && !is_finite_f(s) ? 1 : 0;
    float mx = s;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      bad |= __shfl_xor_sync(kFullMask, bad, o);
    }
    const float m_old = sm.m[hh];
    const float m_new = fmaxf(m_old, mx);
    // m_new == -inf only when every score so far is -inf (then the head is bad anyway).
    const float alpha = m_new == neg_inf() ? 1.f : expf(m_old - m_new);
    const float e = valid ? expf(s - m_new) : 0.f;
    float sum = e;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
    if (valid) sm.s[hh * kAttnKeys + lane] = e;
    if (lane == 0) {
      sm.l[hh] = sm.l[hh] * alpha + sum;
      sm.m[hh] = m_new;
      sm.alpha[hh] = alpha;
      sm.bad[hh] |= bad;
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < g * d; idx += kThreads) {
    const int hh = idx / d, c = idx - hh * d;
    const float* pr = sm.s + hh * kAttnKeys;
    float a = sm.acc[idx] * sm.alpha[hh];
    for (int j = 0; j < nk; ++j) a = fmaf(pr[j], sm.v[j * d + c], a);
    sm.acc[idx] = a;
  }
  __syncthreads();  // the next tile overwrites K, V and P
}

__global__ void __launch_bounds__(kThreads) block_attn_kernel(BlockSparseAttnParams p, AttnLayout L, int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  __shared__ uint32_t scan[32];
  __shared__ int flag;
  const int hkv = static_cast<int>(p.h_kv);
  const int64_t t = static_cast<int>(blockIdx.x) / hkv, kh = static_cast<int>(blockIdx.x) % hkv;
  const int g = L.g, d = static_cast<int>(p.d), split = static_cast<int>(blockIdx.y);
  if (split != 0) err = nullptr;  // invalid values count once per (row, KV head)
  const AttnSmem sm = attn_smem(smem_raw, g, d, p.topk);
  // The row: req and pos in range and every page up to pos in the cache, else no key (counted
  // once, by KV head 0).
  const int64_t r = p.req[t], pos = p.pos[t];
  bool ok = r >= 0 && r < p.batch && pos >= 0 && pos < p.max_pages * p.page_size;
  const int32_t* bt = p.block_table + (ok ? r : 0) * p.max_pages;
  ok = pages_valid(bt, ok ? pos + 1 : 0, p.page_size, p.num_pages, &flag) && ok;
  if (!ok && kh == 0 && threadIdx.x == 0) count_error(err);
  const int nsel = attn_block_list(p, t, kh, ok, pos, sm, scan, err);
  const bool f32 = p.dtype == DType::kFloat32;
  const int64_t q0 = (t * p.h_q + kh * g) * d;  // this group's first query head
  for (int idx = threadIdx.x; idx < g * d; idx += kThreads) {
    sm.q[idx] = load_f(p.q, q0 + idx, f32);
    sm.acc[idx] = 0.f;
  }
  for (int hh = threadIdx.x; hh < g; hh += kThreads) {
    sm.m[hh] = neg_inf();
    sm.l[hh] = 0.f;
    sm.bad[hh] = 0;
  }
  __syncthreads();
  const int b_end = L.splits == 1 ? nsel : min(nsel, (split + 1) * L.per);
  for (int bi = L.splits == 1 ? 0 : split * L.per; bi < b_end; ++bi) {
    const int64_t i0 = static_cast<int64_t>(sm.list[bi]) * p.block_size;
    const int64_t end = i0 + p.block_size < pos + 1 ? i0 + p.block_size : pos + 1;
    for (int64_t k0 = i0; k0 < end; k0 += kAttnKeys)
      attn_tile(p, kh, bt, k0, static_cast<int>(end - k0 < kAttnKeys ? end - k0 : kAttnKeys), g, sm);
  }
  if (L.splits > 1) {  // partial results; the merge kernel normalises
    const int64_t rows = p.s_q * p.h_q, r0 = split * rows + t * p.h_q + kh * g;
    for (int idx = threadIdx.x; idx < g * d; idx += kThreads) L.o_part[r0 * d + idx] = sm.acc[idx];
    for (int hh = threadIdx.x; hh < g; hh += kThreads) {
      L.ml[(r0 + hh) * 2] = sm.bad[hh] ? qnan() : sm.m[hh];
      L.ml[(r0 + hh) * 2 + 1] = sm.l[hh];
    }
    return;
  }
  // out = acc / l (as acc * (1 / l), like the CPU); NaN for a bad head; 0 and -inf with no key.
  for (int idx = threadIdx.x; idx < g * d; idx += kThreads) {
    const int hh = idx / d;
    const float l = sm.l[hh];
    const float inv = sm.bad[hh] ? qnan() : (l == 0.f ? 0.f : 1.f / l);
    const float v = sm.acc[idx] * inv;
    if (f32) {
      static_cast<float*>(p.out)[q0 + idx] = v;
    } else {
      static_cast<uint16_t*>(p.out)[q0 + idx] = float_to_bf16(v);
    }
  }
  for (int hh = threadIdx.x; hh < g; hh += kThreads) {
    const float l = sm.l[hh];
    p.lse[t * p.h_q + kh * g + hh] = sm.bad[hh] ? qnan() : (l == 0.f ? neg_inf() : sm.m[hh] + logf(l));
  }
}

// One CTA per (row, query head): out = Σ_s acc_s e^(m_s - M) / Σ_s l_s e^(m_s - M), M the
// largest m_s of the splits that saw a key, splits in ascending order (deterministic); a NaN
// m_s (a non-finite score) makes out and lse NaN; no key in any split: 0 and -inf.
__global__ void __launch_bounds__(kThreads) block_attn_merge_kernel(BlockSparseAttnParams p, AttnLayout L) {
  const int64_t row = blockIdx.x, rows = p.s_q * p.h_q;
  float mx = neg_inf(), den = 0.f;
  bool bad = false;
  for (int s = 0; s < L.splits; ++s) {
    const float m = L.ml[(s * rows + row) * 2], l = L.ml[(s * rows + row) * 2 + 1];
    bad = bad || m != m;
    if (l > 0.f) mx = fmaxf(mx, m);
  }
  for (int s = 0; s < L.splits; ++s) {
    const float m = L.ml[(s * rows + row) * 2], l = L.ml[(s * rows + row) * 2 + 1];
    if (l > 0.f) den += l * expf(m - mx);
  }
  const float inv = bad ? qnan() : (den == 0.f ? 0.f : 1.f / den);
  const bool f32 = p.dtype == DType::kFloat32;
  for (int c = threadIdx.x; c < p.d; c += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < L.splits; ++s) {
      const float m = L.ml[(s * rows + row) * 2], l = L.ml[(s * rows + row) * 2 + 1];
      if (l > 0.f) acc = fmaf(L.o_part[(s * rows + row) * p.d + c], expf(m - mx), acc);
    }
    const float v = acc * inv;
    if (f32) {
      static_cast<float*>(p.out)[row * p.d + c] = v;
    } else {
      static_cast<uint16_t*>(p.out)[row * p.d + c] = float_to_bf16(v);
    }
  }
  if (threadIdx.x == 0) p.lse[row] = bad ? qnan() : (den == 0.f ? neg_inf() : mx + logf(den));
}

}  // namespace bs_detail

inline void block_topk_cuda(const BlockTopkParams& p, const DeviceEnv& env) {
  using namespace bs_detail;
  if (p.s_q == 0) return;
  const int64_t cap = p.ks != nullptr ? p.s_kv : p.max_pages * p.page_size;  // the longest window
  const int64_t nb_cap = (cap + p.block_size - 1) / p.block_size;
  // The kernels divide positions in 32 bits (64-bit division is a slow subroutine on the GPU).
  TORCH_CHECK(cap <= INT_MAX - 2 * kTopkKeys && p.block_size <= INT_MAX && p.page_size <= INT_MAX,
              "block_topk: ", cap, " keys per row is too many for the CUDA kernel");
  const int64_t budget = dynamic_budget(env, static_cast<int64_t>(sizeof(SelectShared)) + 16);
  const int64_t base = topk_smem_base(p);
  TORCH_CHECK(base <= budget, "block_topk on CUDA needs ", base, " bytes of shared memory for h = ", p.h,
              ", d = ", p.d, "; the device allows ", budget);
  const int64_t bs_bytes = 4 * p.h * (nb_cap > 0 ? nb_cap : 1);
  // Fewer rows than SMs over long windows (decode): each row's blocks split over CTAs of at
  // least kMinSplitKeys keys, up to about two CTAs per SM in all.
  const int64_t min_blocks = std::max<int64_t>(1, (kMinSplitKeys + p.block_size - 1) / p.block_size);
  int64_t splits = 1;
  if (p.s_q < env.sms && nb_cap >= 2 * min_blocks)
    splits = std::min<int64_t>({(nb_cap + min_blocks - 1) / min_blocks, (2 * env.sms + p.s_q - 1) / p.s_q, 65535});
  const int64_t split_blocks = (nb_cap + splits - 1) / splits;
  const bool in_smem = splits == 1 && base + bs_bytes <= budget;
  const int64_t bytes = in_smem ? base + bs_bytes : base;
  set_smem(block_topk_kernel, bytes);
  // Rows per launch: all of them with the maxima in shared memory; else as many as a bounded
  // global scratch holds (a grid-sized scratch could be huge for tiny block sizes).
  const int64_t per = in_smem ? p.s_q : std::max<int64_t>(1, kMaxScratchBytes / bs_bytes);
  uint32_t* gbs = in_smem ? nullptr : static_cast<uint32_t*>(env.alloc(std::min(per, p.s_q) * bs_bytes));
  for (int64_t r0 = 0; r0 < p.s_q; r0 += per) {
    const int64_t rows = std::min(per, p.s_q - r0);
    TORCH_CHECK(rows <= INT_MAX, "block_topk: too many rows for one CUDA launch: ", rows);
    const dim3 grid(static_cast<unsigned>(rows));
    if (splits == 1) {
      const TopkLaunch L{r0, nb_cap, gbs, kFused, nb_cap};
      IC_LAUNCH(block_topk_kernel, grid, kThreads, bytes, env.stream, p, L, env.err);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      continue;
    }
    const TopkLaunch score{r0, nb_cap, gbs, kScore, split_blocks};
    IC_LAUNCH(block_topk_kernel, dim3(static_cast<unsigned>(rows), static_cast<unsigned>(splits)), kThreads, bytes,
              env.stream, p, score, env.err);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const TopkLaunch select{r0, nb_cap, gbs, kSelect, split_blocks};
    IC_LAUNCH(block_topk_kernel, grid, kThreads, 16, env.stream, p, select, env.err);  // no dynamic smem used
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

inline void block_sparse_attention_cuda(const BlockSparseAttnParams& p, const DeviceEnv& env) {
  using namespace bs_detail;
  if (p.s_q == 0 || p.h_q == 0) return;
  const int64_t ctas = p.s_q * p.h_kv;
  TORCH_CHECK(ctas <= INT_MAX, "block_sparse_attention: too many (row, KV head) pairs for the CUDA kernel: ", ctas);
  TORCH_CHECK(p.max_pages * p.page_size <= INT_MAX - kAttnKeys && p.block_size <= INT_MAX,
              "block_sparse_attention: ", p.max_pages * p.page_size, " positions per request is too many for the CUDA kernel");
  const int64_t g = p.h_q / p.h_kv;
  const int64_t bytes = 4 * attn_smem_floats(g, p.d, p.topk);
  const int64_t budget = dynamic_budget(env, 32 * 4 + 16);
  TORCH_CHECK(bytes <= budget, "block_sparse_attention on CUDA needs ", bytes, " bytes of shared memory for ", g,
              " query heads per KV head, d = ", p.d, ", topk = ", p.topk, "; the device allows ", budget);
  set_smem(block_attn_kernel, bytes);
  // Fewer (row, KV head) pairs than SMs (decode): split each pair's selected blocks over CTAs
  // of at least kMinSplitKeysAttn keys' worth of blocks, up to about two CTAs per SM, then merge.
  const int64_t min_blocks = std::max<int64_t>(1, (kMinSplitKeysAttn + p.block_size - 1) / p.block_size);
  int64_t splits = 1;
  if (ctas < env.sms && p.topk >= 2 * min_blocks)
    splits = std::min<int64_t>({(p.topk + min_blocks - 1) / min_blocks, (2 * env.sms + ctas - 1) / ctas, kMaxAttnSplits});
  AttnLayout L{static_cast<int>(g), 1, static_cast<int>(p.topk), nullptr, nullptr};
  if (splits > 1) {
    L.per = static_cast<int>((p.topk + splits - 1) / splits);
    L.splits = static_cast<int>((p.topk + L.per - 1) / L.per);
    const int64_t rows = p.s_q * p.h_q;
    L.o_part = static_cast<float*>(env.alloc(L.splits * rows * p.d * 4));
    L.ml = static_cast<float*>(env.alloc(L.splits * rows * 2 * 4));
  }
  IC_LAUNCH(block_attn_kernel, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(L.splits)), kThreads, bytes,
            env.stream, p, L, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (L.splits > 1) {
    IC_LAUNCH(block_attn_merge_kernel, dim3(static_cast<unsigned>(p.s_q * p.h_q)), kThreads, 0, env.stream, p, L);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace indexcache
