// CUDA top-k into the shared buffer (DESIGN.md §3): exact per-row radix select over the
// float bits, positions emitted in ascending order, deterministic. Torch-free kernels and
// launch code; the op glue is in topk.cu.
//
//   topk_rows_kernel     one CTA (1024 threads) per row: three histogram passes
//                        (11/11/10 bits) then a stable two-pass emit.
//   topk_partial_kernel  long rows with few rows: G CTAs per row each select the top-k of
//                        one contiguous piece into a candidate buffer ...
//   topk_merge_kernel    ... and one CTA per row selects the final top-k of the union of
//                        the pieces (also used by the fused scoring + top-k ops).
//   topk_persistent_kernel  few long rows, one cooperative launch instead of the two above:
//                        G co-resident CTAs per row build each radix level's histogram
//                        together (global atomics, then a grid-level handshake per row),
//                        every CTA derives the same threshold from it, and each emits its
//                        piece's selected positions at an offset from a per-row prefix.
// Rows whose window is <= k are written 0..window-1 without reading a single logit.
#pragma once

#include <algorithm>
#include <cmath>

#include "common.cuh"
#include "kernels.h"

// A launch whose blocks must all be resident at once (they wait for each other): CUDA's
// cooperative launch attribute (an error, not a hang, when the grid cannot be co-resident;
// capturable in a CUDA graph). The emulator runs every block of such a launch concurrently.
#ifdef IC_CUDA_EMULATION
#define IC_LAUNCH_COOP(kernel, grid, block, smem, stream, ...) \
  ::emu::launch_cooperative(kernel, grid, block, smem, __VA_ARGS__)
#else
#define IC_LAUNCH_COOP(kernel, grid, block, smem, stream, ...) \
  C10_CUDA_CHECK(::indexcache::cuda::topk_detail::launch_coop(kernel, grid, block, smem, stream, __VA_ARGS__))
#endif

namespace indexcache {
namespace cuda {
namespace topk_detail {

constexpr int kTopkThreads = 1024;
constexpr int kMergeThreads = 512;
constexpr int kMaxSegments = 64;

__device__ __forceinline__ int window_len(const WindowSrc& w, int64_t r) {
  if (w.seq_lens != nullptr) {
    const int64_t b = r / w.next_n, j = r % w.next_n;
    const int64_t len = static_cast<int64_t>(w.seq_lens[b]) - w.next_n + j + 1;
    return static_cast<int>(len > 0 ? len : 0);
  }
  return max(0, w.ke[r] - w.ks[r]);
}

template <int NT>
__device__ __forceinline__ void write_short_row(int32_t* out, int n, int64_t width) {
  for (int64_t j = threadIdx.x; j < width; j += NT) out[j] = j < n ? static_cast<int32_t>(j) : -1;
}

__global__ void __launch_bounds__(kTopkThreads) topk_rows_kernel(TopkParams p, TopkOut o) {
  __shared__ SelectShared sm;
  const int64_t r = blockIdx.x;
  const int lo = p.ks[r];
  const int n = max(0, p.ke[r] - lo);
  int32_t* out = o.out + r * o.stride;
  const int k = static_cast<int>(o.topk);
  if (n <= k) {
    write_short_row<kTopkThreads>(out, n, o.width);
    return;
  }
  const float* x = p.logits + r * p.logits_stride + lo;
  auto acc = [x](int i, uint32_t& key) {
    key = order_key(x[i]);
    return true;
  };
  const Threshold t = block_threshold<kTopkThreads>(n, static_cast<uint32_t>(k), acc, sm);
  block_emit<kTopkThreads>(n, t, acc, sm, [out](uint32_t rank, int i, uint32_t) { out[rank] = i; });
  for (int64_t j = k + threadIdx.x; j < o.width; j += kTopkThreads) out[j] = -1;
}

// Piece c of G of row r: its exact top-min(k, len) as (key, window position) pairs.
__global__ void __launch_bounds__(kTopkThreads)
    topk_partial_kernel(TopkParams p, int k, int G, uint32_t* keys, int32_t* pos, int32_t* cnt) {
  __shared__ SelectShared sm;
  const int64_t r = blockIdx.x;
  const int c = static_cast<int>(blockIdx.y);
  const int64_t seg = r * G + c;
  const int lo = p.ks[r];
  const int n = max(0, p.ke[r] - lo);
  if (n <= k) {  // the merge writes this row directly
    if (threadIdx.x == 0) cnt[seg] = 0;
    return;
  }
  const int len = (n + G - 1) / G;
  const int a = min(n, c * len);
  const int m = min(n, a + len) - a;
  const float* x = p.logits + r * p.logits_stride + lo + a;
  uint32_t* kd = keys + seg * k;
  int32_t* pd = pos + seg * k;
  auto acc = [x](int i, uint32_t& key) {
    key = order_key(x[i]);
    return true;
  };
  const Threshold t = m <= k ? select_all() : block_threshold<kTopkThreads>(m, static_cast<uint32_t>(k), acc, sm);
  const uint32_t got = block_emit<kTopkThreads>(m, t, acc, sm, [kd, pd, a](uint32_t rank, int i, uint32_t key) {
    kd[rank] = key;
    pd[rank] = a + i;
  });
  if (threadIdx.x == 0) cnt[seg] = static_cast<int32_t>(got);
}

__global__ void __launch_bounds__(kMergeThreads)
    topk_merge_kernel(CandidateSet c, WindowSrc w, int64_t row_begin, TopkOut o) {
  __shared__ SelectShared sm;
  __shared__ int seg_cnt[kMaxSegments];
  const int64_t lr = blockIdx.x;
  const int64_t r = row_begin + lr;
  const int n = window_len(w, r);
  int32_t* out = o.out + r * o.stride;
  const int k = static_cast<int>(o.topk);
  if (n <= k) {
    write_short_row<kMergeThreads>(out, n, o.width);
    return;
  }
  const int S = c.segments, cap = c.cap;
  for (int s = threadIdx.x; s < S; s += kMergeThreads) seg_cnt[s] = max(0, min(c.cnt[lr * S + s], cap));
  __syncthreads();
  uint32_t m = 0;
  for (int s = 0; s < S; ++s) m += static_cast<uint32_t>(seg_cnt[s]);
  const uint32_t* kk = c.keys + lr * S * cap;
  const int32_t* pp = c.pos + lr * S * cap;
  const int* sc = seg_cnt;
  auto acc = [kk, sc, cap](int i, uint32_t& key) {
    const int s = i / cap;
    if (i - s * cap >= sc[s]) return false;
    key = kk[i];
    return true;
  };
  const int total = S * cap;
  const Threshold t = m <= static_cast<uint32_t>(k) ? select_all()
                                                     : block_threshold<kMergeThreads>(total, static_cast<uint32_t>(k), acc, sm);
  const uint32_t got =
      block_emit<kMergeThreads>(total, t, acc, sm, [out, pp](uint32_t rank, int i, uint32_t) { out[rank] = pp[i]; });
  for (int64_t j = got + threadIdx.x; j < o.width; j += kMergeThreads) out[j] = -1;
}

// ------------------------------------------------------------------ persistent top-k (few long rows)

constexpr int kPersistThreads = 512;
constexpr int kPersistMaxG = 32;
// Per-row scratch (uint32): hist[3][2048] (one per radix level), arrive[4] (one handshake
// per level and one for the piece counts), cnt_gt[32], cnt_eq[32]. hist and arrive start at 0.
constexpr int kPersistArrive = 3 * 2048;
constexpr int kPersistGt = kPersistArrive + 4;
constexpr int kPersistEq = kPersistGt + kPersistMaxG;
constexpr int kPersistStride = kPersistEq + kPersistMaxG + 28;  // 6272: 256-byte rows
constexpr int kPersistZeroed = kPersistGt;                       // words of each row to zero

#ifndef IC_CUDA_EMULATION
template <typename... KArgs, typename... Args>
cudaError_t launch_coop(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}
#endif

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
#ifdef IC_CUDA_EMULATION
  return ::emu::ld_acquire(p);
#else
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Grid-level handshake of the G CTAs of one row (all co-resident: cooperative launch): the
// block's earlier global writes and atomics are visible to every CTA of the row after it.
__device__ __forceinline__ void row_barrier(uint32_t* arrive, uint32_t G) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrive, 1u);
    while (ld_acquire_gpu(arrive) < G) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

__global__ void __launch_bounds__(256) topk_zero_kernel(uint32_t* scratch, int64_t rows) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < rows * kPersistZeroed;
       i += static_cast<int64_t>(gridDim.x) * 256)
    scratch[(i / kPersistZeroed) * kPersistStride + i % kPersistZeroed] = 0;
}

// Grid (rows, G), kPersistThreads threads, dynamic shared memory sizeof(SelectShared) (the
// emulator runs the blocks concurrently, so no static __shared__). Piece c of row r is
// [c * len, (c + 1) * len) of its window, len = ceil(n / G). The same exact selection as
// topk_rows_kernel: the three levels' counts are the row's (sums of the pieces' shared
// histograms), every CTA finds the same bin from them, and the output is written in
// position order whatever the scheduling.
__global__ void __launch_bounds__(kPersistThreads) topk_persistent_kernel(TopkParams p, TopkOut o, int G,
                                                                         uint32_t* scratch) {
  constexpr int NT = kPersistThreads;
  constexpr int BPT = 2048 / NT;
  IC_DYNAMIC_SMEM(smem_raw);
  SelectShared& sm = *reinterpret_cast<SelectShared*>(smem_raw);
  const int64_t r = blockIdx.x;
  const int c = static_cast<int>(blockIdx.y);
  const int lo = p.ks[r];
  const int n = max(0, p.ke[r] - lo);
  int32_t* out = o.out + r * o.stride;
  const int k = static_cast<int>(o.topk);
  if (n <= k) {  // uniform over the row's CTAs: none of them waits
    if (c == 0) write_short_row<NT>(out, n, o.width);
    return;
  }
  uint32_t* row = scratch + r * kPersistStride;
  const int len = (n + G - 1) / G;
  const int a = min(n, c * len);
  const int m = min(n, a + len) - a;
  const float* x = p.logits + r * p.logits_stride + lo + a;
  auto acc = [x](int i, uint32_t& key) {
    key = order_key(x[i]);
    return true;
  };
  uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(k);
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
    const uint32_t bmask = level == 2 ? 1023u : 2047u;
    radix_histogram<NT>(m, acc, prefix, mask, shift, bmask, sm.hist);
    uint32_t* gh = row + level * 2048;
    for (int b = threadIdx.x; b < 2048; b += NT) {
      const uint32_t h = sm.hist[b];
      if (h != 0) atomicAdd(&gh[b], h);
    }
    row_barrier(row + kPersistArrive + level, static_cast<uint32_t>(G));
    // The row's histogram: the same in every CTA, so every CTA finds the same bin.
    const int b0 = static_cast<int>(threadIdx.x) * BPT;
    uint32_t hv[BPT];
    uint32_t local = 0;
#pragma unroll
    for (int j = 0; j < BPT; ++j) {
      hv[j] = __ldcg(gh + b0 + j);
      local += hv[j];
    }
    uint32_t total;
    const uint32_t incl = block_incl_scan<NT>(local, sm.scan, total);
    uint32_t above = total - incl;
#pragma unroll
    for (int j = BPT - 1; j >= 0; --j) {
      if (above < need && need <= above + hv[j]) {  // exactly one (thread, bin)
        sm.bin = static_cast<uint32_t>(b0 + j);
        sm.need = need - above;
      }
      above += hv[j];
    }
    __syncthreads();
    prefix |= sm.bin << shift;
    mask |= bmask << shift;
    need = sm.need;
    __syncthreads();  // sm.bin / sm.need rewritten at the next level
  }
  const Threshold t{prefix, need};
  // This piece's counts above and at the threshold, then every piece's, for the offsets.
  uint32_t gt = 0, eq = 0;
  for (int i = threadIdx.x; i < m; i += NT) {
    uint32_t key;
    acc(i, key);
    gt += key > t.key ? 1u : 0u;
    eq += key == t.key ? 1u : 0u;
  }
  uint32_t gt_all, eq_all;
  block_incl_scan<NT>(gt, sm.scan, gt_all);
  block_incl_scan<NT>(eq, sm.scan, eq_all);
  if (threadIdx.x == 0) {
    row[kPersistGt + c] = gt_all;
    row[kPersistEq + c] = eq_all;
  }
  row_barrier(row + kPersistArrive + 3, static_cast<uint32_t>(G));
  uint32_t gt_before = 0, eq_before = 0;
  for (int cc = 0; cc < c; ++cc) {
    gt_before += __ldcg(row + kPersistGt + cc);
    eq_before += __ldcg(row + kPersistEq + cc);
  }
  const uint32_t base = gt_before + min(eq_before, t.take_eq);
  const Threshold mine{t.key, t.take_eq > eq_before ? t.take_eq - eq_before : 0u};
  block_emit<NT>(m, mine, acc, sm, [out, base, a](uint32_t rank, int i, uint32_t) { out[base + rank] = a + i; });
  if (c == 0)
    for (int64_t j = k + threadIdx.x; j < o.width; j += NT) out[j] = -1;
}

// Row r's window if 0 <= ks <= ke <= s_kv, else [0, 0) counted in err (the CPU op's error).
__global__ void __launch_bounds__(256) sanitize_windows_kernel(const int32_t* ks, const int32_t* ke, int64_t rows,
                                                               int64_t s_kv, int32_t* lo, int32_t* hi, int32_t* err) {
  int bad = 0;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * 256) {
    const int32_t a = ks[r], b = ke[r];
    const bool ok = a >= 0 && a <= b && b <= s_kv;
    lo[r] = ok ? a : 0;
    hi[r] = ok ? b : 0;
    bad += ok ? 0 : 1;
  }
  count_error(err, bad);
}

}  // namespace topk_detail

void sanitize_windows_cuda(const int32_t* ks, const int32_t* ke, int64_t rows, int64_t s_kv, int32_t* lo, int32_t* hi,
                           const DeviceEnv& env) {
  using namespace topk_detail;
  if (rows <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((rows + 255) / 256, 1024));
  IC_LAUNCH(sanitize_windows_kernel, dim3(blocks), 256, 0, env.stream, ks, ke, rows, s_kv, lo, hi, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_merge(const CandidateSet& c, const WindowSrc& w, int64_t row_begin, int64_t rows, const TopkOut& o,
                  const DeviceEnv& env) {
  using namespace topk_detail;
  if (rows <= 0) return;
  TORCH_CHECK(c.segments >= 1 && c.segments <= kMaxSegments, "internal: bad segment count ", c.segments);
  IC_LAUNCH(topk_merge_kernel, dim3(static_cast<unsigned>(rows)), kMergeThreads, 0, env.stream, c, w, row_begin, o);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void topk_cuda(const TopkParams& p, const TopkOut& o, int64_t max_window, const DeviceEnv& env) {
  if (p.rows == 0) return;
  // Windows outside [0, max_window] are made empty on the device (no host copy).
  TopkParams q = p;
  int32_t* lo = static_cast<int32_t*>(env.alloc(p.rows * 4));
  int32_t* hi = static_cast<int32_t*>(env.alloc(p.rows * 4));
  sanitize_windows_cuda(p.ks, p.ke, p.rows, max_window, lo, hi, env);
  q.ks = lo;
  q.ke = hi;
  topk_launch(q, o, max_window, env);
}

void topk_launch(const TopkParams& p, const TopkOut& o, int64_t max_window, const DeviceEnv& env) {
  using namespace topk_detail;
  if (p.rows == 0) return;
  TORCH_CHECK(p.rows <= 0x7fffffff, "too many rows for the CUDA top-k: ", p.rows);
  const int64_t sms = env.sms;
  const int64_t k = o.topk;
  // Few long rows: one CTA per row would leave most of the GPU idle, so each row is cut
  // into G pieces. When G >= 2 CTAs per row can all be resident (one per SM, at most 32, at
  // least 4096 keys each), one cooperative launch selects over the pieces together
  // (topk_persistent_kernel); otherwise G ~ sqrt(n / k) pieces select their own top k and a
  // second kernel merges them.
  const bool few_long = p.rows < sms && max_window >= 32768 && max_window >= 8 * k;
  const int64_t Gp = std::min<int64_t>({kPersistMaxG, sms / p.rows, max_window / 4096});
  if (few_long && Gp >= 2) {
    uint32_t* scratch = static_cast<uint32_t*>(env.alloc(p.rows * kPersistStride * 4));
    const unsigned zb = static_cast<unsigned>(std::min<int64_t>((p.rows * kPersistZeroed + 255) / 256, 1024));
    IC_LAUNCH(topk_zero_kernel, dim3(zb), 256, 0, env.stream, scratch, p.rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(Gp));
    IC_LAUNCH_COOP(topk_persistent_kernel, grid, kPersistThreads, sizeof(SelectShared), env.stream, p, o,
                   static_cast<int>(Gp), scratch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (few_long) {
    int64_t G = std::llround(std::sqrt(static_cast<double>(max_window) / static_cast<double>(k)));
    G = std::min<int64_t>({G, 32, std::max<int64_t>(2, 2 * sms / p.rows)});
    G = std::max<int64_t>(G, 2);
    uint32_t* keys = static_cast<uint32_t*>(env.alloc(p.rows * G * k * 4));
    int32_t* pos = static_cast<int32_t*>(env.alloc(p.rows * G * k * 4));
    int32_t* cnt = static_cast<int32_t*>(env.alloc(p.rows * G * 4));
    const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(G));
    IC_LAUNCH(topk_partial_kernel, grid, kTopkThreads, 0, env.stream, p, static_cast<int>(k), static_cast<int>(G),
              keys, pos, cnt);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const CandidateSet c{keys, pos, cnt, static_cast<int>(G), static_cast<int>(k)};
    WindowSrc w;
    w.ks = p.ks;
    w.ke = p.ke;
    launch_merge(c, w, 0, p.rows, o, env);
    return;
  }
  IC_LAUNCH(topk_rows_kernel, dim3(static_cast<unsigned>(p.rows)), kTopkThreads, 0, env.stream, p, o);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
