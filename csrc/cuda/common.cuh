// Device helpers shared by the CUDA kernels: order-preserving float keys, a block-wide
// scan, the exact radix select used by every top-k kernel, and bf16 mma.sync fragments.
// Torch-free (included by .cu files only).
//
// The same code also builds for the CPU with csrc/tests/cuda_emu/cuda_emu.h force-included
// (IC_CUDA_EMULATION): threads become fibers that take turns between barriers, so the kernels
// and their launch logic can be tested on a machine with no GPU.
#pragma once

#ifndef IC_CUDA_EMULATION
#include <cuda_runtime.h>
#endif

#include <cstdint>

#include "indexcache/fp8.h"

#ifdef IC_CUDA_EMULATION
#define IC_LAUNCH(kernel, grid, block, smem, stream, ...) ::emu::launch(kernel, grid, block, smem, __VA_ARGS__)
#define IC_DYNAMIC_SMEM(name) unsigned char* name = ::emu::dynamic_smem()
#else
#define IC_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define IC_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace indexcache {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x >> 5); }
__device__ __forceinline__ uint32_t lanemask_lt() { return (1u << lane_id()) - 1u; }

// One more invalid input entry met (DeviceEnv::err); err == nullptr: not counted.
__device__ __forceinline__ void count_error(int32_t* err, int n = 1) {
  if (err != nullptr && n != 0) atomicAdd(err, n);
}

// Larger float -> larger key; every NaN sorts above +inf (all NaNs equal) and -0 == +0, as
// in torch.sort and on the CPU (select.h).
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ReLU that keeps NaN (fmaxf(x, 0) would turn it into 0; docs/ops.md, non-finite inputs).
__device__ __forceinline__ float relu_nan(float x) { return x < 0.f ? 0.f : x; }

// Unaligned-safe 4-byte float load (cache scales live at byte offsets).
__device__ __forceinline__ float load_f32_bytes(const uint8_t* p) {
  const uint32_t u = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                     (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  return __uint_as_float(u);
}
__device__ __forceinline__ void store_f32_bytes(uint8_t* p, float f) {
  const uint32_t u = __float_as_uint(f);
  p[0] = static_cast<uint8_t>(u);
  p[1] = static_cast<uint8_t>(u >> 8);
  p[2] = static_cast<uint8_t>(u >> 16);
  p[3] = static_cast<uint8_t>(u >> 24);
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// e4m3 byte -> bf16 bits. Exact: every e4m3 value is a bf16 value (low 16 float bits are 0).
__device__ __forceinline__ uint16_t e4m3_to_bf16_bits(uint8_t b) {
  return static_cast<uint16_t>(__float_as_uint(e4m3_to_float(b)) >> 16);
}

// ------------------------------------------------------------------ block scan

// Inclusive prefix sum over the NT threads of the block; `total` gets the block sum.
// Every thread must call it (it contains barriers). warp_tot: shared [32].
template <int NT>
__device__ __forceinline__ uint32_t block_incl_scan(uint32_t v, uint32_t* warp_tot, uint32_t& total) {
  static_assert(NT % 32 == 0 && NT <= 1024, "block size");
  constexpr int NW = NT / 32;
  const int lane = lane_id(), warp = warp_id();
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_tot[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = lane < NW ? warp_tot[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += y;
    }
    if (lane < NW) warp_tot[lane] = w;  // each lane rewrites only the entry it read
  }
  __syncthreads();
  const uint32_t res = x + (warp > 0 ? warp_tot[warp - 1] : 0u);
  total = warp_tot[NW - 1];
  __syncthreads();  // warp_tot may be reused right after
  return res;
}

// ------------------------------------------------------------------ exact radix select
//
// Order: key descending, index ascending on equal keys (reference.topk_indices). The
// selection is described by a threshold key T and take_eq: every element with key > T
// plus the take_eq lowest-index elements with key == T. Histogram counts use shared
// atomics, whose result does not depend on their order; positions are emitted through
// per-warp counts and one prefix, so the output is deterministic.

struct Threshold {
  uint32_t key;
  uint32_t take_eq;
};

// Selects everything that is valid (used when there are at most k valid elements).
__device__ __forceinline__ Threshold select_all() { return Threshold{0u, 0xffffffffu}; }

struct SelectShared {
  uint32_t hist[2048];
  uint32_t scan[32];
  uint32_t cnt_gt[32];
  uint32_t cnt_eq[32];
  uint32_t bin;
  uint32_t need;
};

// One radix level's histogram of elements [0, n) into hist[2048] (shared): every element
// whose key matches `prefix` under `mask` counts in bin (key >> shift) & bmask. Zeroes hist
// first; every thread must call it (barriers inside; the counts are visible after it).
template <int NT, typename Acc>
__device__ __forceinline__ void radix_histogram(int n, const Acc& acc, uint32_t prefix, uint32_t mask, int shift,
                                                uint32_t bmask, uint32_t* hist) {
  for (int b = threadIdx.x; b < 2048; b += NT) hist[b] = 0;
  __syncthreads();
  for (int base = threadIdx.x; base < n; base += 4 * NT) {
    uint32_t key[4] = {0, 0, 0, 0};
    bool ok[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * NT;
      ok[u] = i < n && acc(i, key[u]);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (ok[u] && (key[u] & mask) == prefix) atomicAdd(&hist[(key[u] >> shift) & bmask], 1u);
  }
  __syncthreads();
}

// acc(i, key) -> bool: element i's key, false when element i is absent (not counted).
// Requires 1 <= k <= (number of valid elements among [0, n)).
template <int NT, typename Acc>
__device__ Threshold block_threshold(int n, uint32_t k, const Acc& acc, SelectShared& sm) {
  static_assert(2048 % NT == 0, "block size must divide 2048");
  constexpr int BPT = 2048 / NT;  // histogram bins scanned by each thread
  uint32_t prefix = 0, mask = 0, need = k;
  for (int level = 0; level < 3; ++level) {
    // 11 + 11 + 10 bits, most significant first.
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
    const uint32_t bmask = level == 2 ? 1023u : 2047u;
    radix_histogram<NT>(n, acc, prefix, mask, shift, bmask, sm.hist);
    // Find the bin holding the need-th largest: above(b) < need <= above(b) + hist[b].
    const int b0 = static_cast<int>(threadIdx.x) * BPT;
    uint32_t local = 0;
#pragma unroll
    for (int j = 0; j < BPT; ++j) local += sm.hist[b0 + j];
    uint32_t total;
    const uint32_t incl = block_incl_scan<NT>(local, sm.scan, total);
    uint32_t above = total - incl;  // elements in bins above this thread's range
#pragma unroll
    for (int j = BPT - 1; j >= 0; --j) {
      const uint32_t h = sm.hist[b0 + j];
      if (above < need && need <= above + h) {  // true for exactly one (thread, bin)
        sm.bin = static_cast<uint32_t>(b0 + j);
        sm.need = need - above;
      }
      above += h;
    }
    __syncthreads();
    prefix |= sm.bin << shift;
    mask |= bmask << shift;
    need = sm.need;
    // sm.bin / sm.need are next written after two more barriers; hist reads are done.
  }
  return Threshold{prefix, need};
}

// Calls emit(rank, i, key) for each selected element, ranks 0, 1, ... in increasing i.
// Each warp owns one contiguous segment of [0, n): pass 1 counts, one prefix over the
// warps, pass 2 writes. Ends with a barrier (emitted data visible to the block).
template <int NT, typename Acc, typename Emit>
__device__ uint32_t block_emit(int n, Threshold t, const Acc& acc, SelectShared& sm, Emit emit) {
  constexpr int NW = NT / 32;
  const int lane = lane_id(), warp = warp_id();
  const int seg = ((n + NW - 1) / NW + 31) & ~31;
  const int beg = min(n, warp * seg);
  const int end = min(n, beg + seg);
  uint32_t gt = 0, eq = 0;
  for (int base = beg; base < end; base += 32) {
    const int i = base + lane;
    uint32_t key = 0;
    const bool v = i < end && acc(i, key);
    gt += __popc(__ballot_sync(kFullMask, v && key > t.key));
    eq += __popc(__ballot_sync(kFullMask, v && key == t.key));
  }
  if (lane == 0) {
    sm.cnt_gt[warp] = gt;
    sm.cnt_eq[warp] = eq;
  }
  __syncthreads();
  uint32_t gt_before = 0, eq_before = 0, gt_all = 0, eq_all = 0;
  for (int w = 0; w < NW; ++w) {
    if (w < warp) {
      gt_before += sm.cnt_gt[w];
      eq_before += sm.cnt_eq[w];
    }
    gt_all += sm.cnt_gt[w];
    eq_all += sm.cnt_eq[w];
  }
  uint32_t out = gt_before + min(eq_before, t.take_eq);
  uint32_t eqc = eq_before;
  const uint32_t lt = lanemask_lt();
  for (int base = beg; base < end; base += 32) {
    const int i = base + lane;
    uint32_t key = 0;
    const bool v = i < end && acc(i, key);
    const bool g = v && key > t.key;
    const bool e = v && key == t.key;
    const uint32_t eb = __ballot_sync(kFullMask, e);
    const bool sel = g || (e && eqc + __popc(eb & lt) < t.take_eq);
    const uint32_t sb = __ballot_sync(kFullMask, sel);
    if (sel) emit(out + __popc(sb & lt), i, key);
    out += __popc(sb);
    eqc += __popc(eb);
  }
  __syncthreads();
  return gt_all + min(eq_all, t.take_eq);  // number emitted
}

// ------------------------------------------------------------------ bf16 tensor cores
//
// mma.sync m16n8k16, bf16 in, fp32 accumulate (sm_80+). Fragment layouts (PTX ISA,
// "Matrix fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4:
//   A (16x16, row-major): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B (16x8):             b0 (k 2t..2t+1, n g)   b1 (k 2t+8..2t+9, n g)
//   C (16x8):             c0,c1 (g, 2t..2t+1)    c2,c3 (g+8, 2t..2t+1)
// Two bf16 in one 32-bit register: the lower index in the low half.

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef IC_CUDA_EMULATION
  ::emu::mma_bf16_16816(c, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ------------------------------------------------------------------ fp8 -> f16 tensor cores (sm_89+)
//
// The fp8 indexer (e4m3 q x e4m3 keys) converts e4m3 pairs with cvt.rn.f16x2.e4m3x2 and runs
// the f16 mma on sm_89+; older archs (the 8.0+PTX build) keep the software e4m3 -> bf16 path.
// Both are exact: every e4m3 value is an f16 and a bf16 value, and the products are exact in
// fp32, so both paths give the same bits. IC_FP8_F16 says which one the code runs; the
// emulator reads a switch (::emu::g_fp8_f16) so that its tests run both.
#if defined(IC_CUDA_EMULATION)
#define IC_FP8_F16 (::emu::g_fp8_f16)
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define IC_FP8_F16 true
#else
#define IC_FP8_F16 false
#endif

// Two e4m3 bytes (byte 0 in the low half) -> two f16 (lower in the low half). Exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t v) {
#if defined(IC_CUDA_EMULATION)
  return ::emu::cvt_f16x2_e4m3x2(v);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
#else
  // Not used below sm_89 (IC_FP8_F16 is false there); kept so that every target compiles.
  auto one = [](uint32_t b) -> uint32_t {
    const uint32_t sign = (b & 0x80u) << 8, exp = (b >> 3) & 0xfu, mant = b & 7u;
    if (exp == 0xf && mant == 7) return 0x7fffu;
    if (exp != 0) return sign | ((exp + 8) << 10) | (mant << 7);
    if (mant == 0) return sign;
    const int lz = mant >= 4 ? 0 : (mant >= 2 ? 1 : 2);  // m * 2^-9 = 1.f * 2^(-7 - lz)
    return sign | (static_cast<uint32_t>(8 - lz) << 10) | (((mant << (lz + 1)) & 7u) << 7);
  };
  return one(v & 0xffu) | (one(v >> 8) << 16);
#endif
}

// mma.sync m16n8k16 with f16 inputs, fp32 accumulate; fragments as mma_bf16_16816.
__device__ __forceinline__ void mma_f16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef IC_CUDA_EMULATION
  ::emu::mma_f16_16816(c, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ------------------------------------------------------------------ ldmatrix (sm_75+)
//
// ldmatrix.sync.aligned.m8n8.x{1,2,4}.shared.b16: lane i passes the (16-byte aligned) address
// of row i % 8 of matrix i / 8; r[j] receives elements (lane / 4, 2 (lane % 4) .. +1) of matrix
// j, i.e. one 8x8 block of an mma fragment. _trans: the transposed block (k-major B).
#ifndef IC_CUDA_EMULATION
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
#endif

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#ifdef IC_CUDA_EMULATION
  ::emu::ldmatrix<4>(r, row, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) {
#ifdef IC_CUDA_EMULATION
  ::emu::ldmatrix<2>(r, row, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#ifdef IC_CUDA_EMULATION
  ::emu::ldmatrix<4>(r, row, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
#endif
}

// A fragment (rows [row0, row0+16), columns [k0, k0+16)) of a row-major 16-bit matrix in
// shared memory (ld elements per row, rows 16-byte aligned): one ldmatrix.x4.
__device__ __forceinline__ void ldsm_a_frag(uint32_t (&a)[4], const uint16_t* m, int ld, int row0, int k0) {
  const int l = lane_id();
  ldmatrix_x4(a, m + (row0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + k0 + (l >> 4) * 8);
}

// B fragments of two n-tiles (n in [n0, n0+16), k in [k0, k0+16)) of a matrix stored n-major
// (m[n][k], rows 16-byte aligned): b[0], b[1] for n-tile n0, b[2], b[3] for n0 + 8. One x4.
__device__ __forceinline__ void ldsm_b_frag_nk_x2n(uint32_t (&b)[4], const uint16_t* m, int ld, int n0, int k0) {
  const int l = lane_id();
  ldmatrix_x4(b, m + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8);
}

__device__ __forceinline__ uint32_t ld_u32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A fragment of rows [row0, row0+16), columns [k0, k0+16) of a row-major bf16 matrix
// (ld elements per row, even).
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const uint16_t* m, int ld, int row0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const uint16_t* p = m + (row0 + g) * ld + k0 + 2 * t;
  a[0] = ld_u32(p);
  a[1] = ld_u32(p + 8 * ld);
  a[2] = ld_u32(p + 8);
  a[3] = ld_u32(p + 8 * ld + 8);
}

// B fragment (k in [k0, k0+16), n in [n0, n0+8)) of a matrix stored n-major: m[n][k].
__device__ __forceinline__ void load_b_frag_nk(uint32_t& b0, uint32_t& b1, const uint16_t* m, int ld, int n0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const uint16_t* p = m + (n0 + g) * ld + k0 + 2 * t;
  b0 = ld_u32(p);
  b1 = ld_u32(p + 8);
}

// B fragment of a matrix stored k-major: m[k][n] (two 16-bit loads per register).
__device__ __forceinline__ void load_b_frag_kn(uint32_t& b0, uint32_t& b1, const uint16_t* m, int ld, int n0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const uint16_t* p = m + (k0 + 2 * t) * ld + n0 + g;
  b0 = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[ld]) << 16);
  b1 = static_cast<uint32_t>(p[8 * ld]) | (static_cast<uint32_t>(p[9 * ld]) << 16);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
}

// ------------------------------------------------------------------ cp.async (sm_80+)
//
// 16-byte global -> shared copies that complete asynchronously: cp_async_16 queues one
// (both addresses 16-byte aligned), cp_async_commit closes the thread's open group, and
// cp_async_wait<N> waits until at most N of the thread's committed groups are still in
// flight. The data is only visible to the issuing thread after the wait, and to the others
// after a barrier that follows it. The emulator defers each copy to the wait that covers it.

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
#ifdef IC_CUDA_EMULATION
  ::emu::cp_async_16(smem_dst, gmem_src);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem_src) : "memory");
#else
  *reinterpret_cast<uint4*>(smem_dst) = *reinterpret_cast<const uint4*>(gmem_src);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef IC_CUDA_EMULATION
  ::emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef IC_CUDA_EMULATION
  ::emu::cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ------------------------------------------------------------------ e4m3 -> bf16, scaled
//
// Eight e4m3 bytes (u.x's low byte first) times `scale`, each rounded to bf16 as
// float_to_bf16(e4m3_to_float(b) * scale), packed two per word (lower index low). Where
// IC_FP8_F16 (sm_89+) the bytes are converted in pairs by cvt.rn.f16x2.e4m3x2 and then to
// fp32: both steps are exact, so the result is bit-identical to the software decode used on
// older archs (the emulator runs both, through ::emu::g_fp8_f16).

// f16 bits -> fp32 (exact).
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
#ifdef IC_CUDA_EMULATION
  return ::emu::f16_to_float(h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ uint4 e4m3x8_scaled_to_bf16(uint2 u, float scale) {
  uint32_t w[4];
  if (IC_FP8_F16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t src = i < 2 ? u.x : u.y;
      const uint32_t h2 = e4m3x2_to_f16x2(static_cast<uint16_t>(src >> (16 * (i & 1))));
      w[i] = pack_bf16(f16_bits_to_f32(static_cast<uint16_t>(h2)) * scale,
                       f16_bits_to_f32(static_cast<uint16_t>(h2 >> 16)) * scale);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t src = i < 2 ? u.x : u.y;
      const int sh = 16 * (i & 1);
      w[i] = pack_bf16(e4m3_to_float(static_cast<uint8_t>(src >> sh)) * scale,
                       e4m3_to_float(static_cast<uint8_t>(src >> (sh + 8))) * scale);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace cuda
}  // namespace indexcache
