// A small CUDA emulator for testing csrc/cuda/*_impl.cuh on a machine with no GPU.
// Force-included (-include cuda_emu.h) before the kernel headers: every CUDA thread of a
// block becomes a fiber (its own stack; emu_switch_stack), and the fibers of a launch take turns on the
// calling thread, each running until it waits at a barrier (or exits); blocks run one after
// another. __syncthreads is a barrier over the block, warp shuffles / ballots exchange through
// per-warp slots (each lane writes its slot, one warp barrier, each lane reads; the slots
// alternate between two copies, so that a lane's next exchange cannot overwrite what a slower
// lane still reads: Warp::turn), and mma.sync m16n8k16 is computed from the fragments the 32
// lanes hold (exchanged the same way), following the PTX ISA fragment layout.
// Function-scope __shared__ variables become function statics (blocks never overlap).
// Only what the kernels here use.
//
// It checks index math, barrier placement, warp-uniformity of shuffles and results; it says
// nothing about speed. The threads a barrier releases run again in an order drawn from a
// pseudo-random sequence fixed per launch (so are the threads at launch), so a read of what
// another thread wrote without a barrier between sees stale data in some phase whichever of the
// two threads comes first: a missing barrier shows up as a wrong result, deterministically. A
// barrier that some threads never reach (divergent, or missing on one path) throws "deadlock"
// instead of hanging. (Until 2026-12-08 each thread was a std::thread and barriers were
// std::barrier: a deadlock hung the test, and 256 OS threads per block on two cores made these
// tests the largest share of the suite.)
#pragma once

#define IC_CUDA_EMULATION 1

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/mman.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
using cudaStream_t = void*;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class F>
inline int cudaFuncSetAttribute(F, cudaFuncAttribute, int) {
  return 0;
}

namespace emu {
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}
}  // namespace emu
#define TORCH_CHECK(cond, ...)                                                   \
  do {                                                                           \
    if (!(cond)) throw std::runtime_error(::emu::cat("", ##__VA_ARGS__));        \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() \
  do {                                 \
  } while (0)
#define C10_CUDA_CHECK(x) (void)(x)

namespace emu {

struct Idx {
  unsigned x = 0, y = 0, z = 0;
};

// The scheduler's side, defined with it below: the running fiber parks itself (it runs again once
// something has made it ready), and a fiber is put on the ready list.
struct Fiber;
inline Fiber* g_cur = nullptr;  // the running fiber
void park();
void make_ready(Fiber* fiber);
void make_ready_shuffled(std::vector<Fiber*>& fibers);

// std::barrier's semantics over fibers: the last thread to arrive in a phase releases those that
// wait and goes on; an exited thread drops out of later phases (arrive_and_drop).
class Barrier {
 public:
  explicit Barrier(int n) : expected_(n) {}
  void arrive_and_wait() {
    if (++arrived_ == expected_) {
      release();
      return;
    }
    waiting_.push_back(g_cur);
    park();
  }
  void arrive_and_drop() {
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) release();
  }

 private:
  void release() {
    arrived_ = 0;
    make_ready_shuffled(waiting_);
    waiting_.clear();
  }
  int expected_, arrived_ = 0;
  std::vector<Fiber*> waiting_;
};

struct Warp {
  explicit Warp(int n) : bar(n) {}
  Barrier bar;
  // Two copies of each exchange buffer, used by turns (a lane's next collective op takes the other
  // copy): a lane that is through an op's barrier writes the other copy, which every lane finished
  // reading before it arrived at that barrier, so one barrier per op suffices.
  uint64_t slot[2][32] = {};
  uint32_t a[2][32][4] = {};
  uint32_t b[2][32][2] = {};
  uint8_t turn[32] = {};  // each lane's own entry: the copy its next collective op uses
};

struct Block {
  std::unique_ptr<Barrier> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> smem;
};

// The running thread's own state (its fiber's, swapped in while it runs: Fiber below).
inline Idx t_thread, t_block;
inline Idx g_grid, g_blockdim;
inline Block* t_blk = nullptr;

inline unsigned char* dynamic_smem() { return t_blk->smem.data(); }
inline int lane() { return static_cast<int>(t_thread.x & 31); }
inline Warp& warp() { return *t_blk->warps[t_thread.x >> 5]; }
// The buffer copy this lane's collective op uses (Warp::turn), flipped for its next one.
inline int take_turn(Warp& w, int l) {
  const int t = w.turn[l];
  w.turn[l] = static_cast<uint8_t>(t ^ 1);
  return t;
}

template <class T>
T exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of a wide type");
  Warp& w = warp();
  const int t = take_turn(w, lane());
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  w.slot[t][lane()] = u;
  w.bar.arrive_and_wait();
  const uint64_t r = w.slot[t][src];
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

inline float bf16_lo(uint32_t r) {
  const uint32_t u = r << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16_hi(uint32_t r) {
  const uint32_t u = r & 0xffff0000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 halves of a 32-bit register -> float (exact).
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float f16_lo(uint32_t r) { return f16_to_float(static_cast<uint16_t>(r)); }
inline float f16_hi(uint32_t r) { return f16_to_float(static_cast<uint16_t>(r >> 16)); }

// cvt.rn.f16x2.e4m3x2 (sm_89+): byte 0 -> low half, byte 1 -> high half. Exact: every e4m3
// value (sign, 4-bit exponent with bias 7, 3-bit mantissa; S.1111.111 is NaN, no inf) is an f16
// value; subnormals m * 2^-9 are f16 normals. NaN -> the f16 canonical NaN 0x7fff.
inline uint16_t e4m3_to_f16(uint8_t b) {
  const uint16_t sign = static_cast<uint16_t>((b & 0x80u) << 8);
  const uint32_t exp = (b >> 3) & 0xfu, mant = b & 7u;
  if (exp == 0xf && mant == 7) return 0x7fff;
  if (exp == 0) {
    if (mant == 0) return sign;
    int e = -9, m = static_cast<int>(mant);  // value m * 2^-9: normalise to 1.xxx * 2^e
    while (m < 8) {
      m <<= 1;
      --e;
    }
    e += 3;  // m in [8, 16): m * 2^(e-3)
    return static_cast<uint16_t>(sign | ((e + 15) << 10) | ((m & 7) << 7));
  }
  return static_cast<uint16_t>(sign | ((exp - 7 + 15) << 10) | (mant << 7));
}
inline uint32_t cvt_f16x2_e4m3x2(uint16_t v) {
  return static_cast<uint32_t>(e4m3_to_f16(static_cast<uint8_t>(v))) |
         (static_cast<uint32_t>(e4m3_to_f16(static_cast<uint8_t>(v >> 8))) << 16);
}

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16: lane i supplies the address of row
// i % 8 of matrix i / 8 (lanes 0-7 for x1, 0-15 for x2); lane t receives, in r[j], elements
// (t / 4, 2 (t % 4) .. +1) of matrix j (.trans: elements (2 (t % 4), t / 4) and (2 (t % 4) + 1,
// t / 4)), the lower column (row) in the low half. Rows must be 16-byte aligned.
template <int N>
inline void ldmatrix(uint32_t* r, const void* row, bool trans) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix .x1/.x2/.x4");
  Warp& w = warp();
  const int l = lane();
  if (l < 8 * N && (reinterpret_cast<uintptr_t>(row) & 15u) != 0) throw std::runtime_error("emu: ldmatrix row not 16-byte aligned");
  const int tn = take_turn(w, l);
  w.slot[tn][l] = reinterpret_cast<uintptr_t>(row);
  w.bar.arrive_and_wait();
  for (int j = 0; j < N; ++j) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int rr = trans ? 2 * (l & 3) + h : l >> 2, cc = trans ? l >> 2 : 2 * (l & 3) + h;
      std::memcpy(&e[h], reinterpret_cast<const unsigned char*>(w.slot[tn][8 * j + rr]) + 2 * cc, 2);
    }
    r[j] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
  }
  // Unlike the register exchanges, this reads shared memory during the op: no lane goes on (and
  // maybe writes those rows) before every lane has read, as the one warp-wide load on a GPU.
  w.bar.arrive_and_wait();
}

// D = A B + C for one warp; each lane computes its own four outputs from the others' fragments.
//   A (16x16): lane L = 4g + t holds a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8):  b0 (k 2t..2t+1, n g), b1 (k 2t+8..2t+9, n g)
//   C (16x8):  c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
// Lo / Hi decode the low / high 16-bit element of a register (bf16 or f16).
template <class Lo, class Hi>
inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Lo lo, Hi hi) {
  Warp& w = warp();
  const int l = lane();
  const int tn = take_turn(w, l);
  for (int i = 0; i < 4; ++i) w.a[tn][l][i] = a[i];
  w.b[tn][l][0] = b0;
  w.b[tn][l][1] = b1;
  w.bar.arrive_and_wait();
  auto A = [&w, tn, lo, hi](int row, int k) {
    const int g = row & 7, t = (k & 7) >> 1;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t r = w.a[tn][4 * g + t][reg];
    return (k & 1) ? hi(r) : lo(r);
  };
  auto B = [&w, tn, lo, hi](int k, int n) {
    const int t = (k & 7) >> 1;
    const uint32_t r = w.b[tn][4 * n + t][k >= 8 ? 1 : 0];
    return (k & 1) ? hi(r) : lo(r);
  };
  const int g = l >> 2, t = l & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    double s = 0.0;
    for (int k = 0; k < 16; ++k) s += static_cast<double>(A(row, k)) * static_cast<double>(B(k, col));
    c[i] = static_cast<float>(static_cast<double>(c[i]) + s);
  }
}
inline void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_16816(c, a, b0, b1, bf16_lo, bf16_hi);
}
inline void mma_f16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_16816(c, a, b0, b1, f16_lo, f16_hi);
}

// The fp8 indexer's mma path (common.cuh IC_FP8_F16): true runs what sm_89+ runs (hardware
// e4m3x2 -> f16x2 and the f16 mma), false the software e4m3 -> bf16 path of older archs.
inline bool g_fp8_f16 = true;

// The indexer's cp.async key-ring depth (indexer_impl.cuh choose_stages): 0 lets the launcher
// choose from the shared-memory budget; 2..4 forces it, so that the tests run every depth.
inline int g_idx_stages = 0;

// cp.async.cg.shared.global 16 / commit_group / wait_group N (sm_80+), deferred: a copy is
// only queued (in the issuing thread's open group) and performed when that thread's
// cp.async.wait_group covers its group, so reading the destination earlier, or from another
// thread without a barrier after the wait, sees stale shared memory. Both addresses must be
// 16-byte aligned and the destination must lie in the block's dynamic shared memory; a thread
// that exits with copies it never waited for is an error.
struct CpAsync {
  unsigned char* dst;
  const unsigned char* src;
};
inline std::vector<CpAsync> t_cp_open;  // the running thread's (Fiber)
inline std::vector<std::vector<CpAsync>> t_cp_groups;  // committed, oldest first
[[noreturn]] inline void cp_async_fail(const char* what) {
  std::fprintf(stderr, "emu: cp.async misuse: %s\n", what);
  std::abort();
}
inline void cp_async_16(void* dst, const void* src) {
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if ((d & 15u) != 0 || (s & 15u) != 0) cp_async_fail("address not 16-byte aligned");
  const auto lo = reinterpret_cast<uintptr_t>(t_blk->smem.data());
  if (d < lo || d + 16 > lo + t_blk->smem.size()) cp_async_fail("destination outside dynamic shared memory");
  t_cp_open.push_back(CpAsync{static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src)});
}
inline void cp_async_commit() {
  t_cp_groups.push_back(std::move(t_cp_open));
  t_cp_open.clear();
}
inline void cp_async_wait(int n) {
  // Only committed groups count; the open group stays in flight.
  const size_t keep = static_cast<size_t>(n);
  if (t_cp_groups.size() <= keep) return;
  const size_t done = t_cp_groups.size() - keep;
  for (size_t g = 0; g < done; ++g)
    for (const CpAsync& c : t_cp_groups[g]) std::memcpy(c.dst, c.src, 16);
  t_cp_groups.erase(t_cp_groups.begin(), t_cp_groups.begin() + static_cast<std::ptrdiff_t>(done));
}
inline void cp_async_check_exit() {
  bool pending = !t_cp_open.empty();
  for (const auto& g : t_cp_groups) pending = pending || !g.empty();
  if (pending) cp_async_fail("thread exited with copies it never waited for");
  t_cp_groups.clear();
}

// ------------------------------------------------------------------ wgmma (sm_90a), as the fp8 indexer uses it
//
// Shared-memory addresses are offsets into the block's dynamic shared memory (the CUDA
// shared window, where the dynamic region starts at 0 here).
inline uint32_t smem_addr(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p), lo = reinterpret_cast<uintptr_t>(t_blk->smem.data());
  if (a < lo || a >= lo + t_blk->smem.size()) throw std::runtime_error("emu: not a dynamic shared memory address");
  return static_cast<uint32_t>(a - lo);
}

// wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3 with both operands in shared memory,
// K-major, 128-byte swizzle (the only mode the kernels use; any other descriptor aborts).
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4,
// 16-29 leading byte offset >> 4 (unused for swizzled K-major), 32-45 stride byte offset >> 4
// (between 8-row groups), 49-51 base offset (0 here), 62-63 swizzle (1: 128 B).
// Row r, byte b (< 32: one k-step of 32 e4m3 values) of an operand is at
//   a = start + (r / 8) * SBO + (r % 8) * 128 + b,  stored at a ^ (((a >> 7) & 7) << 4),
// the 16-byte chunk index XOR the row within a 1024-byte atom; the start must lie in the first
// 128-byte row of a 1024-byte aligned atom (a k-step advances it by 32 bytes).
// D (64 x N, fp32) is spread as mma.m16n8: warp w of the warpgroup holds rows 16 w + g and
// 16 w + g + 8 (g = lane / 4), register 4 j + i the column 8 j + 2 (lane % 4) + (i & 1), rows
// + 8 for i >= 2. The operation is deferred to the wgmma.wait_group that covers it, so reading
// the accumulators earlier sees their old values; a wgmma issued without a wgmma.fence since
// the thread last touched them aborts.
struct WgmmaOp {
  float* d;
  int n;
  uint64_t da, db;
  bool acc;
};
inline std::vector<WgmmaOp> t_wg_open;  // the running thread's (Fiber)
inline std::vector<std::vector<WgmmaOp>> t_wg_groups;
inline bool t_wg_fenced = false;
[[noreturn]] inline void wgmma_fail(const char* what) {
  std::fprintf(stderr, "emu: wgmma misuse: %s\n", what);
  std::abort();
}
inline void wgmma_fence() { t_wg_fenced = true; }
inline const unsigned char* wgmma_operand(uint64_t desc, int row, int byte) {
  if ((desc >> 62) != 1u) wgmma_fail("only 128-byte swizzled K-major descriptors are emulated");
  if (((desc >> 49) & 7u) != 0) wgmma_fail("base offset");
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fffu) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3fffu) << 4;
  if (((start >> 7) & 7u) != 0) wgmma_fail("start address not in the first row of a 1024-byte atom");
  const uint32_t a = start + static_cast<uint32_t>(row / 8) * sbo + static_cast<uint32_t>(row % 8) * 128 + byte;
  const uint32_t phys = a ^ (((a >> 7) & 7u) << 4);
  if (phys + 1 > t_blk->smem.size()) wgmma_fail("operand outside shared memory");
  return t_blk->smem.data() + phys;
}
inline float e4m3_value(uint8_t b) { return f16_to_float(e4m3_to_f16(b)); }
inline void wgmma_run(const WgmmaOp& op) {
  const int w = static_cast<int>((t_thread.x >> 5) & 3), l = static_cast<int>(t_thread.x & 31);
  const int g = l >> 2, t = l & 3;
  for (int j = 0; j < op.n / 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int m = 16 * w + g + (i >= 2 ? 8 : 0), col = 8 * j + 2 * t + (i & 1);
      double s = 0.0;
      for (int k = 0; k < 32; ++k)
        s += static_cast<double>(e4m3_value(*wgmma_operand(op.da, m, k))) *
             static_cast<double>(e4m3_value(*wgmma_operand(op.db, col, k)));
      float& d = op.d[4 * j + i];
      d = static_cast<float>((op.acc ? static_cast<double>(d) : 0.0) + s);
    }
}
inline void wgmma_e4m3(float* d, int n, uint64_t da, uint64_t db, bool acc) {
  if (!t_wg_fenced) wgmma_fail("wgmma.mma_async without a wgmma.fence before it");
  if (g_blockdim.x % 128 != 0) wgmma_fail("the block is not whole warpgroups");
  t_wg_open.push_back(WgmmaOp{d, n, da, db, acc});
}
inline void wgmma_commit() {
  t_wg_groups.push_back(std::move(t_wg_open));
  t_wg_open.clear();
}
inline void wgmma_wait(int n) {
  const size_t keep = static_cast<size_t>(n);
  if (t_wg_groups.size() <= keep) return;
  const size_t done = t_wg_groups.size() - keep;
  for (size_t g = 0; g < done; ++g)
    for (const WgmmaOp& op : t_wg_groups[g]) wgmma_run(op);
  t_wg_groups.erase(t_wg_groups.begin(), t_wg_groups.begin() + static_cast<std::ptrdiff_t>(done));
  t_wg_fenced = false;  // the accumulators were written: the next wgmma needs a new fence
}
inline void wgmma_check_exit() {
  bool pending = !t_wg_open.empty();
  for (const auto& g : t_wg_groups) pending = pending || !g.empty();
  if (pending) wgmma_fail("thread exited with wgmma it never waited for");
  t_wg_groups.clear();
  t_wg_fenced = false;
}
// Whether the launcher may pick the wgmma kernels: on a GPU, INDEXCACHE_WGMMA=1 and the sm_90a
// cubin running; here the tests' switch (emu_set_wgmma), off by default as on a GPU.
inline bool g_wgmma = false;

// ------------------------------------------------------------------ fibers
//
// A stack switch: saves the callee-saved registers and the SSE / x87 control words on the running
// stack, stores its pointer to *from, and resumes the stack `to` where it was saved (x86-64 SysV).
// ucontext's swapcontext does the same plus a signal-mask system call per switch, which took a
// third of these tests' time.
extern "C" void emu_switch_stack(void** from, void* to);
asm(R"(
  .text
  .globl emu_switch_stack
  .hidden emu_switch_stack
  .type emu_switch_stack, @function
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, .-emu_switch_stack
)");

// One emulated CUDA thread: its stack, its saved stack pointer and the per-thread state above,
// which is swapped into the globals while it runs (one thread runs at a time).
struct Fiber {
  void* sp = nullptr;
  std::function<void()> body;
  void* stack = nullptr;
  Idx thread, block;
  Block* blk = nullptr;
  std::vector<CpAsync> cp_open;
  std::vector<std::vector<CpAsync>> cp_groups;
  std::vector<WgmmaOp> wg_open;
  std::vector<std::vector<WgmmaOp>> wg_groups;
  bool wg_fenced = false;

  void swap_state() {  // in before it runs, out after: the globals hold the running thread's state
    std::swap(t_thread, thread);
    std::swap(t_block, block);
    std::swap(t_blk, blk);
    std::swap(t_cp_open, cp_open);
    std::swap(t_cp_groups, cp_groups);
    std::swap(t_wg_open, wg_open);
    std::swap(t_wg_groups, wg_groups);
    std::swap(t_wg_fenced, wg_fenced);
  }
};

// Fiber stacks (1 MiB reserved, touched pages only committed, a guard page below), kept for reuse.
constexpr size_t kFiberStack = size_t{1} << 20, kGuard = 4096;
inline std::vector<void*> g_stacks;
inline void* take_stack() {
  if (!g_stacks.empty()) {
    void* s = g_stacks.back();
    g_stacks.pop_back();
    return s;
  }
  void* m = mmap(nullptr, kFiberStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::runtime_error("emu: mmap of a fiber stack failed");
  mprotect(m, kGuard, PROT_NONE);
  return m;
}
inline void give_stack(void* s) {
  if (g_stacks.size() < 4096)
    g_stacks.push_back(s);
  else
    munmap(s, kFiberStack + kGuard);
}

struct Scheduler {
  void* main_sp = nullptr;
  std::deque<Fiber*> ready;
  std::exception_ptr error;
  int live = 0;
  uint64_t rng = 0x9E3779B97F4A7C15ull;  // the shuffle's xorshift state, fixed per launch
};
inline Scheduler* g_sched = nullptr;

inline void make_ready(Fiber* f) { g_sched->ready.push_back(f); }
inline void make_ready_shuffled(std::vector<Fiber*>& fibers) {
  uint64_t& x = g_sched->rng;
  for (size_t i = fibers.size(); i > 1; --i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::swap(fibers[i - 1], fibers[x % i]);
  }
  for (Fiber* f : fibers) make_ready(f);
}
inline void park() { emu_switch_stack(&g_cur->sp, g_sched->main_sp); }
// A thread that spins on memory other threads write (__nanosleep) lets the others run.
inline void yield() {
  make_ready(g_cur);
  park();
}

inline void fiber_entry() {
  try {
    g_cur->body();
    cp_async_check_exit();
    wgmma_check_exit();
  } catch (...) {
    if (!g_sched->error) g_sched->error = std::current_exception();
  }
  --g_sched->live;
  // An exited thread no longer takes part in barriers.
  warp().bar.arrive_and_drop();
  t_blk->bar->arrive_and_drop();
}

// The bottom frame of every fiber: runs it, then hands the stack back to the scheduler for good.
[[noreturn]] inline void fiber_start() {
  fiber_entry();
  void* dead = nullptr;
  emu_switch_stack(&dead, g_sched->main_sp);
  std::abort();  // never resumed
}

inline void add_fiber(std::vector<std::unique_ptr<Fiber>>& fibers, std::function<void()> body, Idx thread, Idx block,
                      Block* blk) {
  auto f = std::make_unique<Fiber>();
  f->body = std::move(body);
  f->thread = thread;
  f->block = block;
  f->blk = blk;
  f->stack = take_stack();
  // The frame emu_switch_stack resumes: control words, six registers, then fiber_start as the
  // return address, entered with the stack as a call leaves it (8 mod 16).
  auto* top = reinterpret_cast<uint64_t*>(static_cast<char*>(f->stack) + kGuard + kFiberStack);
  uint64_t* sp = top - 1;
  *sp = 0;  // fiber_start's own return address: never used
  *--sp = reinterpret_cast<uint64_t>(&fiber_start);
  for (int r = 0; r < 6; ++r) *--sp = 0;
  uint32_t ctl[2] = {0, 0};
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(ctl[0]), "=m"(ctl[1]));
  std::memcpy(--sp, ctl, 8);
  f->sp = sp;
  fibers.push_back(std::move(f));
}

// Runs the fibers until all have exited; rethrows the first exception one threw, and throws if
// threads are left waiting at barriers that no running thread can release.
inline void run_fibers(std::vector<std::unique_ptr<Fiber>>& fibers) {
  if (g_sched != nullptr) throw std::runtime_error("emu: a launch from inside a kernel");
  Scheduler s;
  g_sched = &s;
  s.live = static_cast<int>(fibers.size());
  std::vector<Fiber*> all;
  for (auto& f : fibers) all.push_back(f.get());
  make_ready_shuffled(all);
  while (!s.ready.empty() && !s.error) {
    Fiber* f = s.ready.front();
    s.ready.pop_front();
    f->swap_state();
    g_cur = f;
    emu_switch_stack(&s.main_sp, f->sp);
    g_cur = nullptr;
    f->swap_state();
  }
  g_sched = nullptr;
  for (auto& f : fibers) give_stack(f->stack);
  if (s.error) std::rethrow_exception(s.error);
  if (s.live > 0)
    throw std::runtime_error(cat("emu: deadlock: ", s.live,
                                 " threads wait at a barrier that the others of their block or warp never reach"));
}

// A block of nt threads: its barrier, its warps (the last one partial), smem bytes of garbage as
// uninitialised shared memory is.
inline void init_block(Block& B, int nt, size_t smem) {
  B.bar = std::make_unique<Barrier>(nt);
  for (int w = 0; w * 32 < nt; ++w) B.warps.push_back(std::make_unique<Warp>(std::min(32, nt - 32 * w)));
  B.smem.assign(smem, 0xA5);
}

template <class K, class... Args>
void launch(K kernel, dim3 grid, dim3 block, size_t smem, Args... args) {
  const int nt = static_cast<int>(block.x * block.y * block.z);
  if (block.y != 1 || block.z != 1) throw std::runtime_error("emu: 1-D blocks only");
  g_grid = Idx{grid.x, grid.y, grid.z};
  g_blockdim = Idx{block.x, block.y, block.z};
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block B;
        init_block(B, nt, smem);
        std::vector<std::unique_ptr<Fiber>> fibers;
        fibers.reserve(nt);
        for (int i = 0; i < nt; ++i)
          add_fiber(fibers, [&] { kernel(args...); }, Idx{static_cast<unsigned>(i), 0, 0}, Idx{bx, by, bz}, &B);
        run_fibers(fibers);
      }
}

// A cooperative launch (IC_LAUNCH_COOP): every block of the grid runs at once, so blocks may
// wait for each other (grid-level handshakes through global atomics, spinning with __nanosleep,
// which lets the other threads run), as the CUDA runtime guarantees for
// cudaLaunchAttributeCooperative. Shared memory must be dynamic (function-scope __shared__
// variables are statics here, one copy for all the blocks).
template <class K, class... Args>
void launch_cooperative(K kernel, dim3 grid, dim3 block, size_t smem, Args... args) {
  const int nt = static_cast<int>(block.x * block.y * block.z);
  if (block.y != 1 || block.z != 1) throw std::runtime_error("emu: 1-D blocks only");
  const size_t nb = static_cast<size_t>(grid.x) * grid.y * grid.z;
  if (nb * static_cast<size_t>(nt) > 16384) throw std::runtime_error("emu: cooperative grid too large to emulate");
  g_grid = Idx{grid.x, grid.y, grid.z};
  g_blockdim = Idx{block.x, block.y, block.z};
  std::vector<std::unique_ptr<Block>> blocks;
  std::vector<std::unique_ptr<Fiber>> fibers;
  fibers.reserve(nb * nt);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blocks.push_back(std::make_unique<Block>());
        Block* B = blocks.back().get();
        init_block(*B, nt, smem);
        for (int i = 0; i < nt; ++i)
          add_fiber(fibers, [&] { kernel(args...); }, Idx{static_cast<unsigned>(i), 0, 0}, Idx{bx, by, bz}, B);
      }
  run_fibers(fibers);
}

// ld.acquire.gpu of a word other blocks update atomically.
inline unsigned ld_acquire(const unsigned* p) {
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_acquire);
}

}  // namespace emu

#define threadIdx (::emu::t_thread)
#define blockIdx (::emu::t_block)
#define gridDim (::emu::g_grid)
#define blockDim (::emu::g_blockdim)

inline void __syncthreads() { ::emu::t_blk->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::warp().bar.arrive_and_wait(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
  return ::emu::exchange(v, ::emu::lane() ^ m);
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  const int l = ::emu::lane(), src = l - static_cast<int>(d);
  return ::emu::exchange(v, src < 0 ? l : src);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  return ::emu::exchange(v, src & 31);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  ::emu::Warp& w = ::emu::warp();
  const int t = ::emu::take_turn(w, ::emu::lane());
  w.slot[t][::emu::lane()] = pred ? 1 : 0;
  w.bar.arrive_and_wait();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i)
    if (w.slot[t][i]) r |= 1u << i;
  return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { ::emu::yield(); }
template <class T>
inline T __ldcg(const T* p) {
  return *p;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}
