// CUDA indexer: scoring (prefill and paged decode) and fused scoring + top-k. Torch-free
// kernels and launch code; the op glue is in indexer.cu.
//
// Both kernels share one tile routine. A CTA (4 warps) owns a block of up to 8 query rows
// whose q (all heads) and weights stay in shared memory, and walks tiles of 64 keys:
//   - fp8 / bf16 inputs: the tile is staged as 16-bit values in shared memory (bf16; fp8 as
//     f16 through the hardware e4m3x2 conversion on sm_89+, as bf16 in software before:
//     exact either way), each warp keeps the B fragments of 32 keys in registers (ldmatrix)
//     and runs every other 16-head tile with mma.sync m16n8k16 (fp32 accumulate); the
//     ReLU-weighted head sum is folded in registers, across the 8 lane groups, then the two
//     head-tile parities are added in shared memory.
//   - fp32 inputs: a plain fp32 FMA loop (exact-enough for the 1e-5 bar; bf16 would not be).
// Key tiles of the aligned instantiations (Vec: q, keys, scales 16-byte aligned) are copied by
// 16-byte cp.async into a ring of 2-4 shared-memory stages, up to three tiles ahead of the
// one being scored (fp8 rows land raw and are converted to f16 in shared memory; bf16 rows
// land in their mma tile directly; the per-key fp32 scales land beside them, four keys per
// copy). The misaligned instantiations (!Vec) stage synchronously with byte-safe loads.
// The plain op writes a row's scores (-inf outside its window). The fused op never writes
// scores: each row keeps a bounded candidate list in global scratch (2k + 64 entries),
// appends keys above its running k-th best, compacts with the exact radix select when
// full, and a merge kernel (topk.cu) selects the final k over the key-range splits.
// The fused and plain ops compute every score with the same code, so they select alike.
// Other head widths (d != 128) run indexer_any_impl.cuh's plain kernels.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <type_traits>

#include "common.cuh"
#include "indexer_any_impl.cuh"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace idx_detail {

constexpr int kThreads = 128;       // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kKeyTile = 64;        // 16 keys per warp
constexpr int kD = kIndexHeadDim;   // 128
constexpr int kLd = kD + 8;         // bf16 row stride in shared memory: conflict-free fragments
constexpr int kLdF = kD + 1;        // fp32 key row stride (FMA path)
constexpr int kLogitsTilesPerCta = 8;
constexpr int kMaxRowBlock = 8;
constexpr int kQBudget = 72 * 1024;  // shared bytes for the row block's q
constexpr int kFusedMaxK = 2048;
constexpr int kMaxSplits = 64;
constexpr int64_t kScratchBudget = 256ll << 20;
constexpr int kFusedSmemTarget = 100 * 1024;  // two CTAs per SM on sm_90 (228 KB)
constexpr int kSmemTarget = 113 * 1024;       // the most a CTA may take for two per sm_90 SM
constexpr int kMinStages = 2;                 // key-tile ring depth (cp.async pipeline)
constexpr int kMaxStages = 4;
constexpr int64_t kFewRowsMinKeys = 32768;    // fused op: few rows at least this long -> logits + top-k

struct IdxArgs {
  const void* q;            // [rows, h, 128]
  const float* weights;     // [rows, h]
  int64_t h;
  int hpad;                 // heads padded to 16 (mma) or h (fp32)
  // dense keys
  const void* k;            // [s_kv, 128]
  const float* k_scale;     // [s_kv] or nullptr
  const int32_t* ks;        // [rows]
  const int32_t* ke;
  // paged keys
  const uint8_t* cache;     // [num_blocks, block_size * 132]
  const int32_t* block_table;
  const int32_t* seq_lens;
  int64_t block_size;
  int64_t max_blocks;
  int64_t next_n;
  // launch shape
  int rb;                   // rows per CTA
  int64_t bpr;              // paged: row blocks per request
  int64_t unit_begin;       // dense: rows [unit_begin, unit_end); paged: requests
  int64_t unit_end;
  int64_t out_row0;         // logits: output row of global row r is r - out_row0
  int tiles;                // logits: 64-key tiles per CTA (one q staging serves them all)
  int stages;               // Vec: key tiles in the cp.async ring, kMinStages..kMaxStages
  bool vec;                 // q, keys and key scales 16-byte aligned: the Vec instantiation
  bool wg;                  // fp8, Vec, h % 64 == 0 on sm_90a: the wgmma instantiation
};

struct FusedArgs {
  uint32_t* keys;  // [chunk rows, S, cap]
  int32_t* pos;
  int32_t* cnt;    // [chunk rows, S]
  int S;
  int cap;
  int k;
};

// Shared memory carve-up (bytes, 16-aligned), the same on host and device.
struct Layout {
  int q, w, k, ksc, sc, tmp, lo, hi, cnt, thr, full, sel, st_keys, st_pos, ring, slot, total;
};

__host__ __device__ inline int align16(int x) { return (x + 15) & ~15; }

// How a CTA stages its key tiles: synchronously (fp32, misaligned), or through the cp.async
// ring of raw fp8 rows (converted into the 16-bit tile k) or bf16 rows (the ring slot is the
// mma tile; no separate tile).
// kRingWg (sm_90a, fp8, h % 64 == 0): raw fp8 rows in the 128-byte swizzled K-major layout
// that wgmma reads from shared memory (q too); no 16-bit tile.
enum class Staging { kSync, kRingFp8, kRingBf16, kRingWg };

// One ring slot: 64 key rows (fp8: 128 raw bytes each; bf16: the mma tile's kLd stride), then
// the 64 keys' fp32 scales; kRingWg slots are padded to whole 1024-byte swizzle atoms.
__host__ __device__ constexpr int ring_row_bytes(Staging st) { return st == Staging::kRingBf16 ? kLd * 2 : kD; }
__host__ __device__ constexpr int ring_slot_bytes(Staging st) {
  return st == Staging::kRingWg ? kKeyTile * kD + 1024 : kKeyTile * ring_row_bytes(st) + kKeyTile * 4;
}
constexpr int kWgAtom = 1024;           // 8 rows x 128 bytes: one 128-byte swizzle atom
constexpr int kWgTile = 64 * kD;        // 64 fp8 rows of 128 bytes (an M = 64 q tile, a key tile)

// The staging an instantiation uses (the same on host and device).
template <typename Elem, bool Vec, bool Wg = false>
constexpr Staging kStagingOf = !Vec || std::is_same_v<Elem, float> ? Staging::kSync
                               : Wg                                ? Staging::kRingWg
                               : std::is_same_v<Elem, uint8_t>     ? Staging::kRingFp8
                                                                   : Staging::kRingBf16;

__host__ __device__ inline Layout make_layout(bool mma, int rb, int hpad, int stage_k, bool fused,
                                              Staging st = Staging::kSync, int stages = 0) {
  Layout L{};
  int off = 0;
  auto take = [&off](int bytes) {
    const int at = off;
    off += align16(bytes);
    return at;
  };
  const bool wg = st == Staging::kRingWg;
  // kRingWg: q (rb x hpad / 64 tiles of 64 x 128 fp8) and the ring start on 1024-byte atoms of
  // the shared window; the kernel aligns the base at run time (up to 1008 bytes: the slack).
  auto take_atom = [&off](int bytes) {
    off = (off + kWgAtom - 1) / kWgAtom * kWgAtom;
    const int at = off;
    off += align16(bytes);
    return at;
  };
  L.q = wg ? take_atom(rb * hpad * kD) : take(mma ? rb * hpad * kLd * 2 : rb * hpad * kD * 4);
  L.w = take(rb * hpad * 4);
  L.k = take(st == Staging::kRingBf16 || wg ? 0 : (mma ? kKeyTile * kLd * 2 : kKeyTile * kLdF * 4));
  L.ksc = take(st == Staging::kSync ? kKeyTile * 4 : 0);
  L.sc = take(rb * kKeyTile * 4);
  L.tmp = take(wg ? kWarps * rb * kKeyTile * 4 : (mma ? rb * kKeyTile * 4 : 2 * rb * kKeyTile * 4));
  L.lo = take(rb * 4);
  L.hi = take(rb * 4);
  L.cnt = take(rb * 4);
  L.thr = take(rb * 4);
  L.full = take(rb * 4);
  L.sel = take(fused ? static_cast<int>(sizeof(SelectShared)) : 0);
  L.st_keys = take(fused ? stage_k * 4 : 0);
  L.st_pos = take(fused ? stage_k * 4 : 0);
  L.slot = st == Staging::kSync ? 0 : ring_slot_bytes(st);
  L.ring = wg ? take_atom(stages * L.slot) : take(st == Staging::kSync ? 0 : stages * L.slot);
  L.total = off + (wg ? kWgAtom - 16 : 0);
  return L;
}

struct RowBlock {
  int64_t r0, r1, req;
};

template <bool Paged>
__device__ __forceinline__ RowBlock row_block(const IdxArgs& a) {
  const int64_t by = blockIdx.x;
  RowBlock b;
  if constexpr (Paged) {
    b.req = a.unit_begin + by / a.bpr;
    b.r0 = b.req * a.next_n + (by % a.bpr) * a.rb;
    b.r1 = std::min<int64_t>(b.r0 + a.rb, (b.req + 1) * a.next_n);
  } else {
    b.req = 0;
    b.r0 = a.unit_begin + by * a.rb;
    b.r1 = std::min<int64_t>(b.r0 + a.rb, a.unit_end);
  }
  return b;
}

// Window [lo, hi) of global row r: dense [ks, ke) (checked on the host), paged
// [0, seq_len - next_n + j + 1) clamped at 0.
template <bool Paged>
__device__ __forceinline__ void row_window(const IdxArgs& a, const RowBlock& b, int64_t r, int& lo, int& hi) {
  if constexpr (Paged) {
    const int64_t len = static_cast<int64_t>(a.seq_lens[b.req]) - a.next_n + (r - b.req * a.next_n) + 1;
    lo = 0;
    hi = static_cast<int>(len > 0 ? len : 0);
  } else {
    lo = a.ks[r];
    hi = a.ke[r];
  }
}

// Where key s of this CTA's rows lives (copies of the few fields it needs, so that no
// pointer to the kernel's parameter block is taken).
template <typename Elem, bool Paged>
struct Keys {
  const void* k;
  const float* k_scale;
  const uint8_t* cache;
  const int32_t* table;  // this request's block-table row (paged)
  int64_t block_size;

  __device__ static Keys make(const IdxArgs& a, int64_t req) {
    Keys x;
    x.k = a.k;
    x.k_scale = a.k_scale;
    x.cache = a.cache;
    x.table = Paged ? a.block_table + req * a.max_blocks : nullptr;
    x.block_size = a.block_size;
    return x;
  }
  __device__ __forceinline__ const uint8_t* block_of(int s) const {
    return cache + static_cast<int64_t>(table[s / block_size]) * block_size * (kD + 4);
  }
  __device__ __forceinline__ const Elem* row(int s) const {
    if constexpr (Paged) {
      return reinterpret_cast<const Elem*>(block_of(s) + (s % block_size) * kD);
    } else {
      return static_cast<const Elem*>(k) + static_cast<int64_t>(s) * kD;
    }
  }
  __device__ __forceinline__ float scale(int s) const {
    if constexpr (Paged) {
      return load_f32_bytes(block_of(s) + block_size * kD + (s % block_size) * 4);
    } else {
      return k_scale != nullptr ? k_scale[s] : 1.0f;
    }
  }
  // Aligned caches (Vec) only: key s's scale, 4-byte aligned (16-byte aligned when s % 4 == 0,
  // and keys s .. s + 3 then share a block: block_size % 4 == 0).
  __device__ __forceinline__ bool has_scales() const { return Paged || k_scale != nullptr; }
  __device__ __forceinline__ const float* scale_ptr(int s) const {
    if constexpr (Paged) {
      return reinterpret_cast<const float*>(block_of(s) + block_size * kD) + s % block_size;
    } else {
      return k_scale + s;
    }
  }
};

// ------------------------------------------------------------------ staging

// fp8 inputs run the f16 mma on converted pairs (IC_FP8_F16: sm_89+, or the emulator's switch).
template <typename Elem>
constexpr bool kIsFp8 = std::is_same_v<Elem, uint8_t>;
template <typename Elem>
__device__ __forceinline__ bool fp8_f16() {
  return kIsFp8<Elem> && IC_FP8_F16;
}

__device__ __forceinline__ uint16_t to_bf16_bits(uint8_t e4m3) { return e4m3_to_bf16_bits(e4m3); }
__device__ __forceinline__ uint16_t to_bf16_bits(uint16_t bf16) { return bf16; }

// Rows of 128 fp8 or bf16 values -> 16-bit rows (stride kLd) in shared memory; row(j) ==
// nullptr gives zeros. 16-byte chunks, one per thread and step. bf16 stays bf16; fp8 becomes
// f16 through the hardware pair conversion where IC_FP8_F16 (sm_89+), else bf16 in software
// (both exact; score_tile_mma picks the matching mma).
template <typename Elem, typename RowFn>
__device__ __forceinline__ void stage_rows_bf16(int nrows, RowFn row, uint16_t* dst, bool vec) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(Elem));  // elements per 16-byte chunk
  constexpr int kChunks = kD / kPer;
  for (int c = threadIdx.x; c < nrows * kChunks; c += kThreads) {
    const int j = c / kChunks, part = c % kChunks;
    const Elem* src = row(j);
    uint16_t v[kPer];  // bf16 bits, or the raw e4m3 bytes on the f16 path
    if (src == nullptr) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[i] = 0;
    } else if (vec) {
      const uint4 u = *reinterpret_cast<const uint4*>(src + part * kPer);
      const Elem* e = reinterpret_cast<const Elem*>(&u);
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[i] = fp8_f16<Elem>() ? e[i] : to_bf16_bits(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[i] = fp8_f16<Elem>() ? src[part * kPer + i] : to_bf16_bits(src[part * kPer + i]);
    }
    uint4* d = reinterpret_cast<uint4*>(dst + j * kLd + part * kPer);
#pragma unroll
    for (int q4 = 0; q4 < kPer / 8; ++q4) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = fp8_f16<Elem>() ? e4m3x2_to_f16x2(static_cast<uint16_t>(v[q4 * 8 + 2 * i] | (v[q4 * 8 + 2 * i + 1] << 8)))
                             : static_cast<uint32_t>(v[q4 * 8 + 2 * i]) | (static_cast<uint32_t>(v[q4 * 8 + 2 * i + 1]) << 16);
      d[q4] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <typename RowFn>
__device__ __forceinline__ void stage_rows_f32(int nrows, RowFn row, float* dst, int ld) {
  for (int idx = threadIdx.x; idx < nrows * kD; idx += kThreads) {
    const int j = idx / kD, c = idx % kD;
    const float* src = row(j);
    dst[j * ld + c] = src != nullptr ? src[c] : 0.f;
  }
}

// ------------------------------------------------------------------ the cp.async key ring (Vec)

// Starts the copies of keys [s0, s0 + 64) ∩ [s_lo, s_hi) into a ring slot (s0 % 4 == 0):
// 16-byte cp.async pieces of each row (fp8: 8 raw pieces at stride 128; bf16: 16 pieces at the
// mma tile's stride kLd), and of each 4-key group of scales that lies wholly in the range;
// keys outside get zero rows and scale 0 (plain shared stores), a group cut by the range
// edge is loaded key by key (4-byte loads). The caller commits the group.
// kRingWg: piece p of row j goes to chunk p ^ (j % 8) of the row (the 128-byte swizzle).
template <typename Elem, bool Paged, Staging st>
__device__ __forceinline__ void issue_key_tile(const Keys<Elem, Paged>& kk, int s0, int s_lo, int s_hi,
                                               unsigned char* slot) {
  constexpr int kRowLd = ring_row_bytes(st);
  constexpr int kPieces = kD * static_cast<int>(sizeof(Elem)) / 16;
  for (int c = threadIdx.x; c < kKeyTile * kPieces; c += kThreads) {
    const int j = c / kPieces, piece = c % kPieces;
    const int s = s0 + j;
    unsigned char* d = slot + j * kRowLd + (st == Staging::kRingWg ? piece ^ (j & 7) : piece) * 16;
    if (s >= s_lo && s < s_hi) {
      cp_async_16(d, reinterpret_cast<const unsigned char*>(kk.row(s)) + piece * 16);
    } else {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
  }
  // Scales: the last warp's first 16 lanes, one 4-key group each (the row pieces above
  // spread evenly over all 128 threads).
  const int g = static_cast<int>(threadIdx.x) - (kThreads - 32);
  if (g >= 0 && g < kKeyTile / 4) {
    float* sc = reinterpret_cast<float*>(slot + kKeyTile * kRowLd) + 4 * g;
    const int s = s0 + 4 * g;
    if (kk.has_scales() && s >= s_lo && s + 4 <= s_hi) {
      cp_async_16(sc, kk.scale_ptr(s));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int si = s + i;
        sc[i] = (si >= s_lo && si < s_hi) ? (kk.has_scales() ? *kk.scale_ptr(si) : 1.0f) : 0.f;
      }
    }
  }
}

// Raw e4m3 rows of a ring slot -> the 16-bit key tile (stride kLd): f16 through the hardware
// pair conversion where IC_FP8_F16 (sm_89+), else bf16 in software; the same values
// stage_rows_bf16 produces.
__device__ __forceinline__ void convert_fp8_tile(const unsigned char* slot, uint16_t* kt) {
  constexpr int kPieces = kD / 16;
  for (int c = threadIdx.x; c < kKeyTile * kPieces; c += kThreads) {
    const int j = c / kPieces, piece = c % kPieces;
    const uint4 u = *reinterpret_cast<const uint4*>(slot + j * kD + piece * 16);
    const uint32_t in[4] = {u.x, u.y, u.z, u.w};
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint16_t pair = static_cast<uint16_t>(in[i >> 1] >> (16 * (i & 1)));
      w[i] = IC_FP8_F16 ? e4m3x2_to_f16x2(pair)
                        : static_cast<uint32_t>(e4m3_to_bf16_bits(static_cast<uint8_t>(pair))) |
                              (static_cast<uint32_t>(e4m3_to_bf16_bits(static_cast<uint8_t>(pair >> 8))) << 16);
    }
    uint4* d = reinterpret_cast<uint4*>(kt + j * kLd + piece * 16);
    d[0] = make_uint4(w[0], w[1], w[2], w[3]);
    d[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// cp.async.wait_group stages - 1: all but the stages - 1 most recently committed groups (the
// tiles still in flight ahead of the current one) have landed; the immediate is a constant.
__device__ __forceinline__ void ring_wait(int stages) {
  if (stages <= 2) {
    cp_async_wait<1>();
  } else if (stages == 3) {
    cp_async_wait<2>();
  } else {
    cp_async_wait<3>();
  }
}

// ------------------------------------------------------------------ fp8 warpgroup MMA (sm_90a)
//
// wgmma.mma_async m64n64k32, e4m3 x e4m3 -> fp32, both operands in shared memory (K-major,
// 128-byte swizzle: row r of a 64 x 128-byte tile at r * 128, its 16-byte chunk c at chunk
// c ^ (r % 8); 8-row atoms 1024 bytes apart and 1024-byte aligned in the shared window). The
// emulator runs the same descriptors (cuda_emu.h); elsewhere (sm_80 PTX) the kernels that
// would use it are compiled but never launched (wgmma_available).
#if defined(IC_CUDA_EMULATION) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define IC_WGMMA 1
#else
#define IC_WGMMA 0
#endif

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
#ifdef IC_CUDA_EMULATION
  return ::emu::smem_addr(p);
#else
  return smem_u32(p);
#endif
}

// Descriptor of a 128-byte swizzled K-major tile at p (1024-byte aligned): stride byte offset
// 1024 (between 8-row atoms), leading byte offset unused (1), swizzle mode 1 (128 B). One
// k-step (32 e4m3) further is the descriptor + 2 (start address in 16-byte units).
__device__ __forceinline__ uint64_t wg_desc(const void* p) {
  const uint32_t a = shared_addr(p);
  return static_cast<uint64_t>((a & 0x3ffffu) >> 4) | (1ull << 16) | (static_cast<uint64_t>(kWgAtom >> 4) << 32) |
         (1ull << 62);
}

// Keeps the compiler from moving accumulator accesses across the asynchronous MMA.
__device__ __forceinline__ void wg_fence_operands(float (&d)[32]) {
#if !defined(IC_CUDA_EMULATION) && IC_WGMMA
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

__device__ __forceinline__ void wg_fence() {
#ifdef IC_CUDA_EMULATION
  ::emu::wgmma_fence();
#elif IC_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#ifdef IC_CUDA_EMULATION
  ::emu::wgmma_commit();
#elif IC_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#ifdef IC_CUDA_EMULATION
  ::emu::wgmma_wait(N);
#elif IC_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Generic-proxy writes to shared memory (stores, cp.async) made visible to the async proxy
// that wgmma reads through; before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
#if !defined(IC_CUDA_EMULATION) && IC_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d (64 x 64 fp32, mma.m16n8 layout per warp) = A (64 x 32 e4m3) * B^T (64 x 32) (+ d if acc).
__device__ __forceinline__ void wgmma_64x64x32_e4m3(float (&d)[32], uint64_t da, uint64_t db, bool acc) {
#ifdef IC_CUDA_EMULATION
  ::emu::wgmma_e4m3(d, 64, da, db, acc);
#elif IC_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)));
#else
  __trap();  // never launched: the host checks wgmma_available first
#endif
}

// Scores of the rows in need_mask against a swizzled fp8 key tile (kslot) -> sc[rr][64] (times
// the key scales). q: rb x hpad / 64 swizzled 64-head tiles. Every thread of the CTA (one
// warpgroup) must call it. Warp w's accumulators hold heads 16 w + g, + 8 of each 64-head tile;
// the ReLU-weighted sum runs over the tiles and the two heads in registers, across the 8 lane
// groups by a fixed butterfly, then across the 4 warps in shared memory, (w0 + w1) + (w2 + w3).
__device__ __forceinline__ void score_tile_wgmma(const unsigned char* qs, const float* ws, const unsigned char* kslot,
                                                 const float* ksc, float* sc, float* tmp, int rb, int hpad,
                                                 uint32_t need_mask) {
  const int warp = warp_id(), lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int mtiles = hpad / 64;
  const uint64_t db = wg_desc(kslot);
  for (int rr = 0; rr < rb; ++rr) {
    if (!((need_mask >> rr) & 1u)) continue;  // uniform
    float part[8][2] = {};
    for (int mt = 0; mt < mtiles; ++mt) {
      float acc[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = 0.f;
      const uint64_t da = wg_desc(qs + (rr * mtiles + mt) * kWgTile);
      wg_fence_operands(acc);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < kD / 32; ++ks) wgmma_64x64x32_e4m3(acc, da + 2 * ks, db + 2 * ks, ks > 0);
      wg_commit();
      wg_wait<0>();
      wg_fence_operands(acc);
      const float* wr = ws + rr * hpad + mt * 64 + warp * 16;
      const float wl = wr[g], wh = wr[g + 8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          part[j][e] = fmaf(wl, relu_nan(acc[4 * j + e]), part[j][e]);      // head 16 w + g
          part[j][e] = fmaf(wh, relu_nan(acc[4 * j + 2 + e]), part[j][e]);  // head 16 w + g + 8
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) part[j][e] += __shfl_xor_sync(kFullMask, part[j][e], o);
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) tmp[(warp * rb + rr) * kKeyTile + 8 * j + 2 * t + e] = part[j][e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rb * kKeyTile; idx += kThreads) {
    if (!((need_mask >> (idx / kKeyTile)) & 1u)) continue;
    const int q4 = rb * kKeyTile;
    sc[idx] = ((tmp[idx] + tmp[q4 + idx]) + (tmp[2 * q4 + idx] + tmp[3 * q4 + idx])) * ksc[idx % kKeyTile];
  }
}

// ------------------------------------------------------------------ scoring

// Scores of the rows in need_mask against the staged 64-key tile -> sc[rr][64] (times the
// key scales). Every thread of the CTA must call it. f16: the staged q and keys are f16 (fp8
// inputs on sm_89+), else bf16; same fragments, same accumulation order, same bits.
//
// Warp w holds the B fragments of keys [32 (w % 2), +32) (four n-tiles, all of d) in registers
// and runs the head tiles mt = w / 2, w / 2 + 2, ...: each A fragment (q, one ldmatrix.x4)
// feeds four mma, so the CTA reads its q block twice per key tile (it was four times, two mma
// per A fragment). The two head-tile parities' ReLU-weighted sums meet in shared memory (tmp)
// and are added in a fixed order (even + odd), then scaled.
template <bool kPadHeads>
__device__ __forceinline__ void score_tile_mma(bool f16, const uint16_t* qs, const float* ws, const uint16_t* kt,
                                               const float* ksc, float* sc, float* tmp, int rb, int hpad,
                                               uint32_t need_mask) {
  const int warp = warp_id(), lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int kw = warp & 1, par = warp >> 1;
  // bf[ks][h]: b0, b1 of n-tile 2h and b0, b1 of n-tile 2h + 1 (keys 32 kw + 16 h + ...).
  uint32_t bf[kD / 16][2][4];
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h) ldsm_b_frag_nk_x2n(bf[ks][h], kt, kLd, kw * 32 + h * 16, ks * 16);
  float* dst = par == 0 ? sc : tmp;
  const int mtiles = hpad / 16;
  for (int rr = 0; rr < rb; ++rr) {
    if (!((need_mask >> rr) & 1u)) continue;
    const uint16_t* qr = qs + rr * hpad * kLd;
    const float* wr = ws + rr * hpad;
    float part[4][2] = {{0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}};
    for (int mt = par; mt < mtiles; mt += 2) {
      float acc[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        uint32_t af[4];
        ldsm_a_frag(af, qr, kLd, mt * 16, ks * 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const uint32_t b0 = bf[ks][nt >> 1][(nt & 1) * 2], b1 = bf[ks][nt >> 1][(nt & 1) * 2 + 1];
          if (f16) {
            mma_f16_16816(acc[nt], af, b0, b1);
          } else {
            mma_bf16_16816(acc[nt], af, b0, b1);
          }
        }
      }
      const float wl = wr[mt * 16 + g], wh = wr[mt * 16 + g + 8];
      // With h not a multiple of 16, padding heads are skipped, not weighted by 0: their zero q rows
      // give 0 * inf = NaN against a key holding inf, which a zero weight would keep. They are the
      // heads staged with weight +0 (a real zero weight is staged as -0: same sums, same NaNs). A
      // separate instantiation, so that the production head counts (32, 64) keep their registers.
      const bool lo = !kPadHeads || __float_as_uint(wl) != 0u, hi = !kPadHeads || __float_as_uint(wh) != 0u;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (lo) part[nt][e] = fmaf(wl, relu_nan(acc[nt][e]), part[nt][e]);      // head mt*16 + g
          if (hi) part[nt][e] = fmaf(wh, relu_nan(acc[nt][e + 2]), part[nt][e]);  // head mt*16 + g + 8
        }
      }
    }
    // Sum over the 8 lane groups (heads g): a fixed butterfly, the same for every key.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) part[nt][e] += __shfl_xor_sync(kFullMask, part[nt][e], o);
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) dst[rr * kKeyTile + kw * 32 + nt * 8 + 2 * t + e] = part[nt][e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rb * kKeyTile; idx += kThreads)
    if ((need_mask >> (idx / kKeyTile)) & 1u) sc[idx] = (sc[idx] + tmp[idx]) * ksc[idx % kKeyTile];
}

// fp32: thread (key j, head parity) runs its heads, then the two parities are added.
__device__ __forceinline__ void score_tile_fma(const float* qs, const float* ws, const float* kt, const float* ksc,
                                               float* sc, float* tmp, int rb, int h, uint32_t need_mask) {
  const int j = threadIdx.x & (kKeyTile - 1), par = threadIdx.x >> 6;
  const float* kr = kt + j * kLdF;
  for (int rr = 0; rr < rb; ++rr) {
    if (!((need_mask >> rr) & 1u)) continue;
    float acc = 0.f;
    for (int hh = par; hh < h; hh += 2) {
      const float* qh = qs + (rr * h + hh) * kD;
      float d = 0.f;
#pragma unroll 8
      for (int c = 0; c < kD; ++c) d = fmaf(qh[c], kr[c], d);
      acc = fmaf(ws[rr * h + hh], relu_nan(d), acc);
    }
    tmp[(rr * 2 + par) * kKeyTile + j] = acc;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rb * kKeyTile; idx += kThreads) {
    const int rr = idx / kKeyTile, jj = idx % kKeyTile;
    if ((need_mask >> rr) & 1u)
      sc[idx] = (tmp[(rr * 2) * kKeyTile + jj] + tmp[(rr * 2 + 1) * kKeyTile + jj]) * ksc[jj];
  }
}

// Shared state of one CTA: q block, weights and row windows staged, pointers carved.
template <typename Elem, bool Paged, bool kPadHeads, bool Vec, bool Wg>
struct Cta {
  static_assert(!Wg || (std::is_same_v<Elem, uint8_t> && Vec && !kPadHeads), "wgmma: aligned fp8, h % 64 == 0");
  static constexpr bool kMma = !std::is_same_v<Elem, float>;
  static constexpr Staging kStaging = kStagingOf<Elem, Vec, Wg>;
  static constexpr bool kRing = kStaging != Staging::kSync;
  Layout L;
  unsigned char* smem;
  RowBlock b;
  int nrows;
  Keys<Elem, Paged> keys;

  __device__ int* lo() const { return reinterpret_cast<int*>(smem + L.lo); }
  __device__ int* hi() const { return reinterpret_cast<int*>(smem + L.hi); }
  __device__ float* sc() const { return reinterpret_cast<float*>(smem + L.sc); }
  __device__ float* ksc() const { return reinterpret_cast<float*>(smem + L.ksc); }
  __device__ unsigned char* slot(int t, int stages) const { return smem + L.ring + (t % stages) * L.slot; }

  // Row block and windows (lo(), hi()); ends with a barrier.
  // The base the layout's offsets count from: kRingWg needs it 1024-byte aligned in the shared
  // window (the layout's total has the slack).
  __device__ static unsigned char* base(unsigned char* sm) {
    if constexpr (Wg) {
      return sm + ((kWgAtom - (shared_addr(sm) & (kWgAtom - 1))) & (kWgAtom - 1));
    } else {
      return sm;
    }
  }

  // sm: base(dynamic shared memory).
  __device__ void init(const IdxArgs& a, unsigned char* sm, const Layout& layout) {
    L = layout;
    smem = sm;
    b = row_block<Paged>(a);
    nrows = static_cast<int>(b.r1 - b.r0);
    keys = Keys<Elem, Paged>::make(a, b.req);
    for (int rr = threadIdx.x; rr < a.rb; rr += kThreads) {
      int l = 0, h = 0;
      if (rr < nrows) row_window<Paged>(a, b, b.r0 + rr, l, h);
      lo()[rr] = l;
      hi()[rr] = h;
    }
    __syncthreads();
  }

  // q of the row block (bf16 or fp32, zero-padded heads) and the weights; ends with a
  // barrier. Only CTAs that score anything pay for it.
  __device__ void stage_q(const IdxArgs& a) {
    const int hpad = a.hpad;
    const int64_t h = a.h;
    const int64_t r0 = b.r0;
    const int nr = nrows;
    const Elem* q = static_cast<const Elem*>(a.q);
    auto qrow = [q, hpad, h, r0, nr](int j) -> const Elem* {
      const int rr = j / hpad, hh = j % hpad;
      if (rr >= nr || hh >= h) return nullptr;
      return q + ((r0 + rr) * h + hh) * kD;
    };
    if constexpr (Wg) {
      // Raw e4m3 rows in the swizzled layout: 64-head tile (rr, hh / 64), row hh % 64, chunk
      // piece ^ (hh % 8); zeros past the block's rows. 16-byte loads (Vec).
      unsigned char* qs = smem + L.q;
      for (int c = threadIdx.x; c < a.rb * hpad * (kD / 16); c += kThreads) {
        const int j = c / (kD / 16), piece = c % (kD / 16);
        const Elem* src = qrow(j);
        const uint4 v = src != nullptr ? *reinterpret_cast<const uint4*>(src + piece * 16) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(qs + j * kD + (piece ^ (j & 7)) * 16) = v;
      }
      fence_proxy_async();
    } else if constexpr (kMma) {
      stage_rows_bf16<Elem>(a.rb * hpad, qrow, reinterpret_cast<uint16_t*>(smem + L.q), Vec);
    } else {
      stage_rows_f32(a.rb * hpad, qrow, reinterpret_cast<float*>(smem + L.q), kD);
    }
    float* ws = reinterpret_cast<float*>(smem + L.w);
    for (int idx = threadIdx.x; idx < a.rb * hpad; idx += kThreads) {
      const int rr = idx / hpad, hh = idx % hpad;
      // +0 marks a padding head (score_tile_mma skips those); a real zero weight becomes -0
      const float w = (rr < nr && hh < h) ? a.weights[(r0 + rr) * h + hh] : 0.f;
      ws[idx] = (rr < nr && hh < h && w == 0.f) ? -0.f : w;
    }
    __syncthreads();
  }

  // Rows whose window [lo, hi) meets [s0, s0 + 64), among those in `rows`.
  __device__ uint32_t need(uint32_t rows, int s0) const {
    uint32_t m = 0;
    for (int rr = 0; rr < nrows; ++rr)
      if (((rows >> rr) & 1u) && lo()[rr] < s0 + kKeyTile && hi()[rr] > s0) m |= 1u << rr;
    return m;
  }

  // Scores the rows in mask against the staged tile kt (16-bit, or fp32 for the FMA path)
  // with key scales ksc, into sc(). Every thread calls it; ends with a barrier.
  __device__ void compute(const IdxArgs& a, const void* kt, const float* ksc, uint32_t mask) {
    if constexpr (kMma) {
      score_tile_mma<kPadHeads>(fp8_f16<Elem>(), reinterpret_cast<const uint16_t*>(smem + L.q),
                                reinterpret_cast<const float*>(smem + L.w), static_cast<const uint16_t*>(kt), ksc, sc(),
                                reinterpret_cast<float*>(smem + L.tmp), a.rb, a.hpad, mask);
    } else {
      score_tile_fma(reinterpret_cast<const float*>(smem + L.q), reinterpret_cast<const float*>(smem + L.w),
                     static_cast<const float*>(kt), ksc, sc(), reinterpret_cast<float*>(smem + L.tmp), a.rb, a.hpad,
                     mask);
    }
    __syncthreads();
  }

  // Synchronous staging (fp32, misaligned): keys [s0, s0+64) ∩ [s_lo, s_hi) (zeros
  // elsewhere), then scores the rows in mask into sc(). Ends with a barrier.
  __device__ void score(const IdxArgs& a, int s0, int s_lo, int s_hi, uint32_t mask) {
    const Keys<Elem, Paged> kk = keys;
    auto krow = [kk, s0, s_lo, s_hi](int j) -> const Elem* {
      const int s = s0 + j;
      return (s >= s_lo && s < s_hi) ? kk.row(s) : nullptr;
    };
    if constexpr (kMma) {
      stage_rows_bf16<Elem>(kKeyTile, krow, reinterpret_cast<uint16_t*>(smem + L.k), Vec);
    } else {
      stage_rows_f32(kKeyTile, krow, reinterpret_cast<float*>(smem + L.k), kLdF);
    }
    for (int j = threadIdx.x; j < kKeyTile; j += kThreads) {
      const int s = s0 + j;
      ksc()[j] = (s >= s_lo && s < s_hi) ? kk.scale(s) : 0.f;
    }
    __syncthreads();
    compute(a, smem + L.k, ksc(), mask);
  }

  // Walks ntiles 64-key tiles from key t0 (t0 % 4 == 0 where kRing) over keys [s_lo, s_hi):
  // per tile, the rows of `rows` whose window meets it (mask) are scored into sc() when
  // mask != 0, then body(s0, mask) runs (every thread; it may hold barriers), then a barrier.
  // kRing: the copies of the next stages - 1 needed tiles are in flight while a tile is
  // scored; one commit group per tile (empty for a tile no row needs), so the wait count is
  // the same every iteration.
  template <typename Body>
  __device__ void walk(const IdxArgs& a, int t0, int ntiles, int s_lo, int s_hi, uint32_t rows, Body body) {
    if constexpr (kRing) {
      const int stages = a.stages;
      auto issue = [&](int t) {
        if (t < ntiles && need(rows, t0 + t * kKeyTile) != 0)
          issue_key_tile<Elem, Paged, kStaging>(keys, t0 + t * kKeyTile, s_lo, s_hi, slot(t, stages));
        cp_async_commit();
      };
      for (int t = 0; t < stages - 1; ++t) issue(t);
      for (int t = 0; t < ntiles; ++t) {
        const int s0 = t0 + t * kKeyTile;
        const uint32_t mask = need(rows, s0);
        // Into the slot of tile t - 1, whose readers all passed the previous barrier.
        issue(t + stages - 1);
        ring_wait(stages);  // this thread's copies of tile t have landed
        if (mask != 0) {    // uniform
          if constexpr (Wg) fence_proxy_async();  // ... visible to wgmma's operand reads
          __syncthreads();  // ... and everyone's (and the zero rows stored at issue)
          const unsigned char* sl = slot(t, stages);
          const float* ksc = reinterpret_cast<const float*>(sl + kKeyTile * ring_row_bytes(kStaging));
          if constexpr (Wg) {
            score_tile_wgmma(smem + L.q, reinterpret_cast<const float*>(smem + L.w), sl, ksc, sc(),
                             reinterpret_cast<float*>(smem + L.tmp), a.rb, a.hpad, mask);
            __syncthreads();
          } else if constexpr (kStaging == Staging::kRingFp8) {
            convert_fp8_tile(sl, reinterpret_cast<uint16_t*>(smem + L.k));
            __syncthreads();
            compute(a, smem + L.k, ksc, mask);
          } else {
            compute(a, sl, ksc, mask);
          }
        }
        body(s0, mask);
        __syncthreads();
      }
      cp_async_wait<0>();  // only empty groups remain (tiles past the end)
    } else {
      for (int t = 0; t < ntiles; ++t) {
        const int s0 = t0 + t * kKeyTile;
        const uint32_t mask = need(rows, s0);
        if (mask != 0) score(a, s0, s_lo, s_hi, mask);  // uniform
        body(s0, mask);
        __syncthreads();
      }
    }
  }
};

// ------------------------------------------------------------------ plain scoring

template <typename Elem, bool Paged, bool kPadHeads, bool Vec, bool Wg>
__global__ void __launch_bounds__(kThreads, 2) indexer_logits_kernel(IdxArgs a, LogitsOut o) {
  IC_DYNAMIC_SMEM(smem);
  using C = Cta<Elem, Paged, kPadHeads, Vec, Wg>;
  C cta;
  cta.init(a, C::base(smem), make_layout(C::kMma, a.rb, a.hpad, 0, false, C::kStaging, a.stages));
  const int nrows = cta.nrows;
  int lo_all = INT_MAX, hi_all = 0;
  uint32_t nonempty = 0;
  for (int rr = 0; rr < nrows; ++rr) {
    if (cta.hi()[rr] > cta.lo()[rr]) {
      nonempty |= 1u << rr;
      lo_all = min(lo_all, cta.lo()[rr]);
      hi_all = max(hi_all, cta.hi()[rr]);
    }
  }
  const int64_t c_begin = static_cast<int64_t>(blockIdx.y) * a.tiles * kKeyTile;
  const int64_t c_end = std::min<int64_t>(o.cols, c_begin + static_cast<int64_t>(a.tiles) * kKeyTile);
  const float ninf = -__int_as_float(0x7f800000);
  if (nonempty != 0 && lo_all < c_end && hi_all > c_begin) cta.stage_q(a);  // uniform
  const int ntiles = c_begin < c_end ? static_cast<int>((c_end - c_begin + kKeyTile - 1) / kKeyTile) : 0;
  cta.walk(a, static_cast<int>(c_begin), ntiles, lo_all, hi_all, nonempty, [&](int s0, uint32_t mask) {
    for (int idx = threadIdx.x; idx < nrows * kKeyTile; idx += kThreads) {
      const int rr = idx / kKeyTile, j = idx % kKeyTile;
      const int64_t col = static_cast<int64_t>(s0) + j;
      if (col >= c_end) continue;
      const bool in = ((mask >> rr) & 1u) && col >= cta.lo()[rr] && col < cta.hi()[rr];
      o.logits[(cta.b.r0 + rr - a.out_row0) * o.stride + col] = in ? cta.sc()[idx] : ninf;
    }
  });  // (walk's barrier: sc and the key tile are reused by the next tile)
}

// ------------------------------------------------------------------ fused scoring + top-k

template <typename Elem, bool Paged, bool kPadHeads, bool Vec, bool Wg>
__global__ void __launch_bounds__(kThreads, 2) indexer_fused_kernel(IdxArgs a, FusedArgs f) {
  IC_DYNAMIC_SMEM(smem_raw);
  using C = Cta<Elem, Paged, kPadHeads, Vec, Wg>;
  unsigned char* const smem = C::base(smem_raw);
  C cta;
  const Layout L = make_layout(C::kMma, a.rb, a.hpad, f.k, true, C::kStaging, a.stages);
  int* cnt = reinterpret_cast<int*>(smem + L.cnt);
  uint32_t* thr = reinterpret_cast<uint32_t*>(smem + L.thr);
  int* full = reinterpret_cast<int*>(smem + L.full);
  SelectShared& sel = *reinterpret_cast<SelectShared*>(smem + L.sel);
  uint32_t* st_keys = reinterpret_cast<uint32_t*>(smem + L.st_keys);
  int32_t* st_pos = reinterpret_cast<int32_t*>(smem + L.st_pos);
  for (int rr = threadIdx.x; rr < a.rb; rr += kThreads) {
    cnt[rr] = 0;
    thr[rr] = 0;
    full[rr] = 0;
  }
  cta.init(a, smem, L);  // windows; ends with a barrier
  const int nrows = cta.nrows;
  const int sp = static_cast<int>(blockIdx.y);
  const int64_t local0 = Paged ? a.unit_begin * a.next_n : a.unit_begin;
  // Rows whose window is <= k need no scoring (the merge writes 0..window-1).
  uint32_t active = 0;
  int lo_all = INT_MAX, hi_all = 0;
  for (int rr = 0; rr < nrows; ++rr) {
    if (cta.hi()[rr] - cta.lo()[rr] > f.k) {
      active |= 1u << rr;
      lo_all = min(lo_all, cta.lo()[rr]);
      hi_all = max(hi_all, cta.hi()[rr]);
    }
  }
  int c0 = 0, c1 = 0;
  if (active != 0) {
    const int64_t span = static_cast<int64_t>(hi_all) - lo_all;
    const int64_t per = ((span + f.S - 1) / f.S + kKeyTile - 1) / kKeyTile * kKeyTile;
    c0 = static_cast<int>(std::min<int64_t>(hi_all, lo_all + sp * per));
    c1 = static_cast<int>(std::min<int64_t>(hi_all, static_cast<int64_t>(c0) + per));
  }
  const int warp = warp_id(), lane = lane_id();
  const uint32_t lt = lanemask_lt();
  if (c0 < c1) cta.stage_q(a);  // uniform
  // Tiles from c0 rounded down to a multiple of 64 (whole 4-key scale groups for the ring);
  // keys below c0 belong to the previous split: staged as zeros, never taken.
  const int t0 = c0 & ~(kKeyTile - 1);
  const int ntiles = c0 < c1 ? (c1 - t0 + kKeyTile - 1) / kKeyTile : 0;
  cta.walk(a, t0, ntiles, c0, c1, active, [&](int s0, uint32_t mask) {
    if (mask == 0) return;  // uniform
    // Append keys above each row's running threshold, in position order (one warp per row).
    for (int rr = warp; rr < nrows; rr += kWarps) {
      if (!((mask >> rr) & 1u)) continue;
      const int lo = cta.lo()[rr], hi = cta.hi()[rr];
      const bool is_full = full[rr] != 0;
      const uint32_t t_key = thr[rr];
      int n = cnt[rr];
      const int64_t seg = ((cta.b.r0 + rr - local0) * f.S + sp) * static_cast<int64_t>(f.cap);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = half * 32 + lane;
        const int s = s0 + j;
        const uint32_t key = order_key(cta.sc()[rr * kKeyTile + j]);
        const bool take = s >= lo && s < hi && s >= c0 && s < c1 && (!is_full || key > t_key);
        const uint32_t bal = __ballot_sync(kFullMask, take);
        if (take) {
          const int at = n + __popc(bal & lt);
          f.keys[seg + at] = key;
          f.pos[seg + at] = s - lo;
        }
        n += __popc(bal);
      }
      __syncwarp();  // every lane has read cnt[rr] before lane 0 rewrites it
      if (lane == 0) cnt[rr] = n;
    }
    __syncthreads();
    // Compact rows that could not take another tile: keep exactly their top k.
    for (int rr = 0; rr < nrows; ++rr) {
      const int n = cnt[rr];
      if (n <= f.cap - kKeyTile) continue;  // uniform
      const int64_t seg = ((cta.b.r0 + rr - local0) * f.S + sp) * static_cast<int64_t>(f.cap);
      const uint32_t* kd = f.keys + seg;
      const int32_t* pd = f.pos + seg;
      auto acc = [kd](int i, uint32_t& key) {
        key = kd[i];
        return true;
      };
      const Threshold t = block_threshold<kThreads>(n, static_cast<uint32_t>(f.k), acc, sel);
      block_emit<kThreads>(n, t, acc, sel, [st_keys, st_pos, pd](uint32_t rank, int i, uint32_t key) {
        st_keys[rank] = key;
        st_pos[rank] = pd[i];
      });
      for (int i = threadIdx.x; i < f.k; i += kThreads) {
        f.keys[seg + i] = st_keys[i];
        f.pos[seg + i] = st_pos[i];
      }
      if (threadIdx.x == 0) {
        cnt[rr] = f.k;
        thr[rr] = t.key;
        full[rr] = 1;
      }
      __syncthreads();
    }
  });
  for (int rr = threadIdx.x; rr < nrows; rr += kThreads) f.cnt[(cta.b.r0 + rr - local0) * f.S + sp] = cnt[rr];
}

// Paged windows as int32 [batch * next_n] bounds for the top-k kernel (fallback path).
__global__ void __launch_bounds__(kThreads) paged_windows_kernel(const int32_t* seq_lens, int64_t batch, int64_t next_n,
                                                                 int32_t* lo, int32_t* hi) {
  const int64_t rows = batch * next_n;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t len = static_cast<int64_t>(seq_lens[r / next_n]) - next_n + (r % next_n) + 1;
    lo[r] = 0;
    hi[r] = static_cast<int32_t>(len > 0 ? len : 0);
  }
}

// A request's seq_len as the kernels read it: itself when 0 <= len <= max_len and every
// block it reads is in [0, num_blocks), else 0 (no keys), counted once in err. One warp
// per request; max_len <= max_blocks * block_size (the caller's bound).
__global__ void __launch_bounds__(kThreads) sanitize_seq_lens_kernel(const int32_t* seq_lens, const int32_t* table,
                                                                     int64_t batch, int64_t max_blocks,
                                                                     int64_t block_size, int64_t num_blocks,
                                                                     int64_t max_len, int32_t* out, int32_t* err) {
  const int lane = lane_id();
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarps + warp_id(); b < batch;
       b += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int32_t len = seq_lens[b];
    bool ok = len >= 0 && len <= max_len;
    if (ok) {
      const int64_t need = (static_cast<int64_t>(len) + block_size - 1) / block_size;
      bool bad = false;
      for (int64_t j = lane; j < need; j += 32) {
        const int32_t id = table[b * max_blocks + j];
        bad = bad || id < 0 || id >= num_blocks;
      }
      ok = __ballot_sync(kFullMask, bad) == 0u;
    }
    if (lane == 0) {
      out[b] = ok ? len : 0;
      if (!ok) count_error(err);
    }
  }
}

// ------------------------------------------------------------------ host side

struct Problem {
  IdxArgs a;
  DType dt;
  bool paged;
  int64_t units;      // dense rows or paged requests
  int64_t rows;       // query rows
  int64_t max_keys;   // s_kv or the longest sequence
};

// Rows per CTA so that the q block fits the budget.
void choose_rows(Problem& pr) {
  const bool mma = pr.dt != DType::kFloat32;
  const int64_t hpad = mma ? (pr.a.h + 15) / 16 * 16 : pr.a.h;
  TORCH_CHECK(hpad <= 4096, "the CUDA indexer supports at most 4096 heads, got ", pr.a.h);
  pr.a.hpad = static_cast<int>(hpad);
  const int64_t per_row = mma ? hpad * kLd * 2 : hpad * kD * 4;
  int64_t rb = std::clamp<int64_t>(kQBudget / std::max<int64_t>(per_row, 1), 1, kMaxRowBlock);
  if (pr.paged) rb = std::min<int64_t>(rb, pr.a.next_n);
  pr.a.rb = static_cast<int>(std::max<int64_t>(1, rb));
  pr.a.bpr = pr.paged ? (pr.a.next_n + pr.a.rb - 1) / pr.a.rb : 1;
}

int64_t row_blocks(const Problem& pr, int64_t units) {
  return pr.paged ? units * pr.a.bpr : (units + pr.a.rb - 1) / pr.a.rb;
}

// Raises the kernel's dynamic shared memory limit when needed; h that cannot fit is an error.
template <typename Kernel>
int prepare_smem(Kernel kernel, const Layout& L, int64_t h, const DeviceEnv& env) {
  TORCH_CHECK(L.total <= env.smem_optin, "the CUDA indexer needs ", L.total, " bytes of shared memory for h=", h,
              " heads; the device allows ", env.smem_optin);
  if (L.total > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total));
  return L.total;
}

// The mma kernels come in three instantiations: aligned inputs (Vec: the cp.async ring) with
// h a multiple of 16 (every production model) or padded heads (small models, a check in the
// hot loop: score_tile_mma), and misaligned inputs (synchronous byte-safe staging; the padded
// heads' check, which is exact for any h). fp32 has one (synchronous FMA path).
// fp8 with aligned inputs and h % 64 == 0 has a fourth, the sm_90a warpgroup MMA (Wg).
template <typename Elem, bool Paged>
auto logits_kernel_for(const IdxArgs& a) {
  using K = void (*)(IdxArgs, LogitsOut);
  if constexpr (std::is_same_v<Elem, float>) {
    return K(indexer_logits_kernel<float, Paged, false, false, false>);
  } else {
    if constexpr (std::is_same_v<Elem, uint8_t>) {
      if (a.wg) return K(indexer_logits_kernel<Elem, Paged, false, true, true>);
    }
    if (!a.vec) return K(indexer_logits_kernel<Elem, Paged, true, false, false>);
    return a.hpad != a.h ? K(indexer_logits_kernel<Elem, Paged, true, true, false>)
                         : K(indexer_logits_kernel<Elem, Paged, false, true, false>);
  }
}

template <typename Elem, bool Paged>
auto fused_kernel_for(const IdxArgs& a) {
  using K = void (*)(IdxArgs, FusedArgs);
  if constexpr (std::is_same_v<Elem, float>) {
    return K(indexer_fused_kernel<float, Paged, false, false, false>);
  } else {
    if constexpr (std::is_same_v<Elem, uint8_t>) {
      if (a.wg) return K(indexer_fused_kernel<Elem, Paged, false, true, true>);
    }
    if (!a.vec) return K(indexer_fused_kernel<Elem, Paged, true, false, false>);
    return a.hpad != a.h ? K(indexer_fused_kernel<Elem, Paged, true, true, false>)
                         : K(indexer_fused_kernel<Elem, Paged, false, true, false>);
  }
}

// Whether the wgmma kernels are enabled (INDEXCACHE_WGMMA=1, read at each launch: opt-in until
// a GPU run has checked their accuracy and speed, docs/cuda_kernels.md) and the device runs the
// kernel's sm_90a code (the wgmma path is compiled only there; the sm_80 PTX, JIT-compiled on
// other GPUs, reports its own version).
template <typename K>
bool wgmma_available(K kernel) {
#ifdef IC_CUDA_EMULATION
  (void)kernel;
  return ::emu::g_wgmma;
#else
  const char* on = std::getenv("INDEXCACHE_WGMMA");
  if (on == nullptr || on[0] != '1') return false;
  cudaFuncAttributes at{};
  if (cudaFuncGetAttributes(&at, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return at.ptxVersion == 90 && at.binaryVersion == 90;
#endif
}

// Sets a.wg where the wgmma instantiation applies and runs here.
template <typename Elem, bool Paged>
void choose_wgmma(IdxArgs& a) {
  a.wg = false;
  if constexpr (std::is_same_v<Elem, uint8_t>) {
    if (a.vec && a.h % 64 == 0 && a.hpad == a.h)
      a.wg = wgmma_available(indexer_logits_kernel<uint8_t, Paged, false, true, true>);
  }
}

template <typename Elem>
Staging staging_of(const IdxArgs& a) {
  if constexpr (std::is_same_v<Elem, uint8_t>) {
    if (a.wg) return Staging::kRingWg;
  }
  return a.vec ? kStagingOf<Elem, true> : kStagingOf<Elem, false>;
}

// The deepest key ring (kMinStages..kMaxStages) whose layout fits `target` bytes; kMinStages
// when none does (the row block was sized without it). 0 for synchronous staging.
template <typename LayoutOf>
int choose_stages(Staging st, int target, LayoutOf layout_of) {
  if (st == Staging::kSync) return 0;
#ifdef IC_CUDA_EMULATION
  if (::emu::g_idx_stages != 0) return ::emu::g_idx_stages;  // the tests run every depth
#endif
  for (int s = kMaxStages; s > kMinStages; --s)
    if (layout_of(s).total <= target) return s;
  return kMinStages;
}

template <typename Elem, bool Paged>
void launch_logits_t(const IdxArgs& a0, const LogitsOut& o, int64_t blocks, const DeviceEnv& env) {
  constexpr bool mma = !std::is_same_v<Elem, float>;
  IdxArgs a = a0;
  choose_wgmma<Elem, Paged>(a);
  const Staging st = staging_of<Elem>(a);
  a.stages = choose_stages(st, std::min(kSmemTarget, env.smem_optin),
                           [&](int s) { return make_layout(mma, a.rb, a.hpad, 0, false, st, s); });
  const Layout L = make_layout(mma, a.rb, a.hpad, 0, false, st, a.stages);
  auto kernel = logits_kernel_for<Elem, Paged>(a);
  const int smem = prepare_smem(kernel, L, a.h, env);
  // Each CTA stages its rows' q once and walks `tiles` key tiles: as many as keep about four
  // CTAs per SM busy, at least kLogitsTilesPerCta (q was re-staged every 512 keys before).
  const int64_t all_tiles = (o.cols + kKeyTile - 1) / kKeyTile;
  const int64_t want_ctas = std::max<int64_t>(1, (4 * static_cast<int64_t>(env.sms) + blocks - 1) / blocks);
  int64_t tiles = std::max<int64_t>(kLogitsTilesPerCta, (all_tiles + want_ctas - 1) / want_ctas);
  tiles = std::max<int64_t>(tiles, (all_tiles + 65534) / 65535);
  const int64_t col_ctas = (all_tiles + tiles - 1) / tiles;
  TORCH_CHECK(col_ctas <= 65535 && tiles <= INT_MAX, "logits rows too long for the CUDA indexer: ", o.cols);
  IdxArgs b = a;
  b.tiles = static_cast<int>(tiles);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(col_ctas));
  IC_LAUNCH(kernel, grid, kThreads, smem, env.stream, b, o);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_logits(const Problem& pr, const LogitsOut& o, const DeviceEnv& env) {
  const int64_t blocks = row_blocks(pr, pr.a.unit_end - pr.a.unit_begin);
  if (blocks == 0 || o.cols == 0) return;
  TORCH_CHECK(blocks <= INT_MAX, "too many query rows for the CUDA indexer");
  if (pr.paged) {
    launch_logits_t<uint8_t, true>(pr.a, o, blocks, env);
  } else if (pr.dt == DType::kFp8E4M3) {
    launch_logits_t<uint8_t, false>(pr.a, o, blocks, env);
  } else if (pr.dt == DType::kBFloat16) {
    launch_logits_t<uint16_t, false>(pr.a, o, blocks, env);
  } else {
    launch_logits_t<float, false>(pr.a, o, blocks, env);
  }
}

template <typename Elem, bool Paged>
void launch_fused_t(const IdxArgs& a0, const FusedArgs& f, int64_t blocks, const DeviceEnv& env) {
  constexpr bool mma = !std::is_same_v<Elem, float>;
  IdxArgs a = a0;
  choose_wgmma<Elem, Paged>(a);
  const Staging st = staging_of<Elem>(a);
  a.stages = choose_stages(st, std::min(kFusedSmemTarget, env.smem_optin),
                           [&](int s) { return make_layout(mma, a.rb, a.hpad, f.k, true, st, s); });
  const Layout L = make_layout(mma, a.rb, a.hpad, f.k, true, st, a.stages);
  auto kernel = fused_kernel_for<Elem, Paged>(a);
  const int smem = prepare_smem(kernel, L, a.h, env);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(f.S));
  IC_LAUNCH(kernel, grid, kThreads, smem, env.stream, a, f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// k > kFusedMaxK, or few long rows: score a bounded chunk of rows into a temporary, then the
// top-k kernels.
// Memory is bounded by kScratchBudget, never by s_q * s_kv.
void fused_fallback(const Problem& pr, const TopkOut& o, const DeviceEnv& env) {
  const int64_t unit_rows = pr.paged ? pr.a.next_n : 1;
  const int64_t cols = std::max<int64_t>(pr.max_keys, 1);
  const int64_t units_per_chunk = std::max<int64_t>(1, kScratchBudget / (unit_rows * cols * 4));
  const int32_t* ks = pr.a.ks;
  const int32_t* ke = pr.a.ke;
  if (pr.paged) {
    int32_t* lo = static_cast<int32_t*>(env.alloc(pr.rows * 4));
    int32_t* hi = static_cast<int32_t*>(env.alloc(pr.rows * 4));
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((pr.rows + kThreads - 1) / kThreads, 4096));
    IC_LAUNCH(paged_windows_kernel, dim3(blocks), kThreads, 0, env.stream, pr.a.seq_lens, pr.units, pr.a.next_n, lo,
              hi);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ks = lo;
    ke = hi;
  }
  float* tmp = static_cast<float*>(env.alloc(std::min(pr.units, units_per_chunk) * unit_rows * cols * 4));
  for (int64_t u0 = 0; u0 < pr.units; u0 += units_per_chunk) {
    const int64_t u1 = std::min(pr.units, u0 + units_per_chunk);
    Problem c = pr;
    c.a.unit_begin = u0;
    c.a.unit_end = u1;
    c.a.out_row0 = u0 * unit_rows;
    const int64_t rows = (u1 - u0) * unit_rows;
    launch_logits(c, LogitsOut{tmp, cols, cols}, env);
    const TopkParams tp{tmp, ks + u0 * unit_rows, ke + u0 * unit_rows, rows, cols};
    const TopkOut to{o.out + u0 * unit_rows * o.stride, o.stride, o.width, o.topk};
    topk_launch(tp, to, pr.max_keys, env);  // windows already sanitized
  }
}

void run_fused(const Problem& problem, const TopkOut& o, const DeviceEnv& env) {
  if (problem.rows == 0) return;
  if (o.topk > kFusedMaxK) {
    fused_fallback(problem, o, env);
    return;
  }
  const int k = static_cast<int>(o.topk);
  // Fewer rows per CTA when the candidate staging (and the shallowest key ring) makes the CTA
  // too large for two per SM.
  Problem pr = problem;
  const bool mma = pr.dt != DType::kFloat32;
  const Staging st = !mma || !pr.a.vec                      ? Staging::kSync
                     : pr.paged || pr.dt == DType::kFp8E4M3 ? Staging::kRingFp8
                                                            : Staging::kRingBf16;
  while (pr.a.rb > 1 && make_layout(mma, pr.a.rb, pr.a.hpad, k, true, st, kMinStages).total > kFusedSmemTarget)
    --pr.a.rb;
  pr.a.bpr = pr.paged ? (pr.a.next_n + pr.a.rb - 1) / pr.a.rb : 1;
  const int64_t all_blocks = row_blocks(pr, pr.units);
  // Split each row block's key range so that there are about two CTAs per SM, keeping
  // >= 4096 keys per split (the merge reads S * cap candidates per row).
  int64_t S = (2 * static_cast<int64_t>(env.sms) + all_blocks - 1) / std::max<int64_t>(all_blocks, 1);
  S = std::clamp<int64_t>(std::min<int64_t>(S, pr.max_keys / 4096), 1, kMaxSplits);
  // Few long rows (decode): the fused grid (row blocks x splits) cannot fill the SMs, and the
  // merge then selects each row's S x cap candidates in one CTA. The plain logits kernel
  // spreads the keys over the whole GPU, and the top-k of few long rows runs on up to 32 CTAs
  // per row (topk_launch): score into a temporary (a few MB) and select from it. Same scores,
  // exact selections, so the same indices as the fused route.
  if (all_blocks * S < env.sms && pr.max_keys >= kFewRowsMinKeys && pr.rows * pr.max_keys * 4 <= kScratchBudget) {
    fused_fallback(problem, o, env);
    return;
  }
  const int cap = 2 * k + kKeyTile;
  const int64_t per_row = S * cap * 8 + S * 4;
  const int64_t unit_rows = pr.paged ? pr.a.next_n : 1;
  int64_t units_per_chunk = std::max<int64_t>(1, kScratchBudget / (per_row * unit_rows));
  if (!pr.paged) units_per_chunk = std::max<int64_t>(pr.a.rb, units_per_chunk / pr.a.rb * pr.a.rb);
  units_per_chunk = std::min(units_per_chunk, pr.units);
  const int64_t chunk_rows = units_per_chunk * unit_rows;
  FusedArgs f;
  f.keys = static_cast<uint32_t*>(env.alloc(chunk_rows * S * cap * 4));
  f.pos = static_cast<int32_t*>(env.alloc(chunk_rows * S * cap * 4));
  f.cnt = static_cast<int32_t*>(env.alloc(chunk_rows * S * 4));
  f.S = static_cast<int>(S);
  f.cap = cap;
  f.k = k;
  WindowSrc w;
  if (pr.paged) {
    w.seq_lens = pr.a.seq_lens;
    w.next_n = pr.a.next_n;
  } else {
    w.ks = pr.a.ks;
    w.ke = pr.a.ke;
  }
  const CandidateSet cs{f.keys, f.pos, f.cnt, f.S, f.cap};
  for (int64_t u0 = 0; u0 < pr.units; u0 += units_per_chunk) {
    const int64_t u1 = std::min(pr.units, u0 + units_per_chunk);
    IdxArgs a = pr.a;
    a.unit_begin = u0;
    a.unit_end = u1;
    const int64_t blocks = row_blocks(pr, u1 - u0);
    TORCH_CHECK(blocks <= INT_MAX, "too many query rows for the CUDA indexer");
    if (pr.paged) {
      launch_fused_t<uint8_t, true>(a, f, blocks, env);
    } else if (pr.dt == DType::kFp8E4M3) {
      launch_fused_t<uint8_t, false>(a, f, blocks, env);
    } else if (pr.dt == DType::kBFloat16) {
      launch_fused_t<uint16_t, false>(a, f, blocks, env);
    } else {
      launch_fused_t<float, false>(a, f, blocks, env);
    }
    launch_merge(cs, w, u0 * unit_rows, (u1 - u0) * unit_rows, o, env);
  }
}

inline bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

Problem dense_problem(const IndexerParams& p) {
  Problem pr{};
  pr.a.q = p.q;
  pr.a.weights = p.weights;
  pr.a.h = p.h;
  pr.a.k = p.k;
  pr.a.k_scale = p.k_scale;
  pr.a.ks = p.ks;
  pr.a.ke = p.ke;
  pr.a.next_n = 1;
  pr.a.unit_begin = 0;
  pr.a.unit_end = p.s_q;
  pr.a.out_row0 = 0;
  pr.a.vec = al16(p.q) && al16(p.k) && (p.k_scale == nullptr || al16(p.k_scale));
  pr.dt = p.qk_dtype;
  pr.paged = false;
  pr.units = p.s_q;
  pr.rows = p.s_q;
  pr.max_keys = p.s_kv;
  choose_rows(pr);
  return pr;
}

Problem paged_problem(const PagedIndexerParams& p, int64_t max_len) {
  Problem pr{};
  pr.a.q = p.q;
  pr.a.weights = p.weights;
  pr.a.h = p.h;
  pr.a.cache = p.cache;
  pr.a.block_table = p.block_table;
  pr.a.seq_lens = p.seq_lens;
  pr.a.block_size = p.block_size;
  pr.a.max_blocks = p.max_blocks;
  pr.a.next_n = p.next_n;
  pr.a.unit_begin = 0;
  pr.a.unit_end = p.batch;
  pr.a.out_row0 = 0;
  pr.a.vec = al16(p.q) && al16(p.cache) && (p.block_size * (p.d + 4)) % 16 == 0;
  pr.dt = DType::kFp8E4M3;
  pr.paged = true;
  pr.units = p.batch;
  pr.rows = p.batch * p.next_n;
  pr.max_keys = max_len;
  choose_rows(pr);
  return pr;
}

// The kernels read windows from device scratch checked on the device (no host copy).
Problem sanitized(Problem pr, const DeviceEnv& env) {
  if (pr.rows == 0) return pr;
  int32_t* lo = static_cast<int32_t*>(env.alloc(pr.rows * 4));
  int32_t* hi = static_cast<int32_t*>(env.alloc(pr.rows * 4));
  sanitize_windows_cuda(pr.a.ks, pr.a.ke, pr.rows, pr.max_keys, lo, hi, env);
  pr.a.ks = lo;
  pr.a.ke = hi;
  return pr;
}

Problem sanitized(Problem pr, const PagedIndexerParams& p, const DeviceEnv& env) {
  if (pr.units == 0) return pr;
  const int64_t bound = std::min<int64_t>(pr.max_keys, p.max_blocks * p.block_size);
  int32_t* lens = static_cast<int32_t*>(env.alloc(pr.units * 4));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((pr.units + kWarps - 1) / kWarps, 1024));
  IC_LAUNCH(sanitize_seq_lens_kernel, dim3(blocks), kThreads, 0, env.stream, p.seq_lens, p.block_table, p.batch,
            p.max_blocks, p.block_size, p.num_blocks, bound, lens, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  pr.a.seq_lens = lens;
  return pr;
}

}  // namespace idx_detail

void indexer_logits_cuda(const IndexerParams& p, const LogitsOut& o, const DeviceEnv& env) {
  using namespace idx_detail;
  if (p.d != kD) return indexer_logits_any_cuda(p, o, env);  // indexer_any_impl.cuh
  launch_logits(sanitized(dense_problem(p), env), o, env);
}

void indexer_logits_paged_cuda(const PagedIndexerParams& p, int64_t max_len, const LogitsOut& o, const DeviceEnv& env) {
  using namespace idx_detail;
  launch_logits(sanitized(paged_problem(p, max_len), p, env), o, env);
}

void indexer_topk_cuda(const IndexerParams& p, const TopkOut& o, const DeviceEnv& env) {
  using namespace idx_detail;
  if (p.d != kD) return indexer_topk_any_cuda(p, o, env);
  run_fused(sanitized(dense_problem(p), env), o, env);
}

void indexer_topk_paged_cuda(const PagedIndexerParams& p, int64_t max_len, const TopkOut& o, const DeviceEnv& env) {
  using namespace idx_detail;
  run_fused(sanitized(paged_problem(p, max_len), p, env), o, env);
}

}  // namespace cuda
}  // namespace indexcache
