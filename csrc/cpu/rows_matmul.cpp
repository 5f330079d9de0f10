// A few rows times a weight matrix on CPU (indexcache/rows_matmul.h): a decode step's
// projections. torch's bf16 matmul at one row spends 2-7x the weight's read time on set-up
// (docs/profiling.md); these loops stream each weight row once.
//
// Work is split into tasks of (g, a block of output columns); a task computes every row m of its
// columns, so every output element is one task's fixed-order sum and the result does not depend
// on the thread count. A call whose work is under kParallelWork multiply-adds runs on the
// calling thread (no OpenMP region: at one row every projection but the LM head is that small).
//
// ISA paths: portable (scalar loops, any CPU), AVX-512 (the avx512bf16 path: vdpbf16ps for
// bf16 x bf16, bf16 -> fp32 widening + FMA otherwise) and AVX2 (the avx2 path: 8-lane widening +
// FMA); isa.h's cpu_op_path(CpuOp::kRowsMatmul, weight dtype) picks one at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd.h"
#endif

#include "../checks.h"
#include "elem_io.h"
#include "indexcache/rows_matmul.h"
#include "isa.h"
#include "registry.h"
#include "serial_work.h"

namespace indexcache {
namespace {

// Multiply-adds below which one thread runs it. A decode row's projections stream weights from
// memory, and one core reads ~13 GB/s where two read 17-21 (an AMX Xeon, docs/profiling.md, 2026-12-06),
// so every projection of 256 KB or more (a 576 x 512 kv_a, the 64 x 512 heads of an absorbed MLA
// einsum, an expert's gate and up) is split: at 2^17 bf16 multiply-adds a call reads for ~20 us, and an
// OpenMP region costs a few on a quiet machine. When the cores are shared a region waits for a
// scheduler slice instead (docs/profiling.md, 2 threads, load 6); `generate`'s --decode-threads auto
// then takes one thread, which opens no region at all.
constexpr int64_t kParallelWork = int64_t{1} << 17;
constexpr int64_t kChunkWork = int64_t{1} << 16;     // at least this much work per parallel chunk
constexpr int64_t kBlock = 64;                        // output columns per task, w [N, K]
constexpr int64_t kKnBlock = 512;                     // and w [K, N]: one fp32 sum per column in an L1 buffer
constexpr int64_t kPrefetchBytes = 4096;              // how far ahead along a weight row's bytes a load prefetches

using cpu::elem_ptr;
using cpu::esize;
using cpu::load_f;
using cpu::store_f;

// ---------------------------------------------------------------------------------- portable

void portable_task(const RowsMatmulParams& p, int64_t g, int64_t n0, int64_t n1) {
  const void* x = elem_ptr(p.x, g * p.x_sg, p.x_dtype);
  const void* w = elem_ptr(p.w, g * p.w_sg, p.w_dtype);
  void* out = const_cast<char*>(elem_ptr(p.out, g * p.o_sg, p.out_dtype));
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) {
        const int64_t wi = p.w_nk ? n * p.w_sr + k : k * p.w_sr + n;
        acc += load_f(x, m * p.x_sm + k, p.x_dtype) * load_f(w, wi, p.w_dtype);
      }
      store_f(out, m * p.o_sm + n, acc, p.out_dtype);
    }
}

// ---------------------------------------------------------------------------------- AVX-512
#if defined(__x86_64__)
#define IC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

using cpu::load16;
using cpu::store16;
using cpu::tail16;

inline __mmask32 tail32(int64_t left) { return left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1); }

constexpr int kRowsAtOnce = 8;  // x rows served by one pass over the weight (MR sums a step)

// w [K, N]: out[n0:n1) += x[k] w[k, n0:n1) for k ascending, one fp32 sum per column held in acc (an
// L1 buffer of the block's columns, loaded, FMA'd and stored back per k). The weight is read row after
// row along each row's bytes, a kKnBlock-column stretch at a time: the 64-column strips this loop
// read before, each 128 B of every 1 KB row, ran at 6 GB/s from DRAM (docs/profiling.md). Each weight
// vector serves up to kRowsAtOnce x rows while it is in a register (each row's own buffer); a
// column's sum order does not depend on the rows beside it.
IC_AVX512 void kn_task_avx512(const RowsMatmulParams& p, const char* x, const char* w, char* out, int64_t n0,
                              int64_t n1) {
  const int64_t xe = esize(p.x_dtype), we = esize(p.w_dtype), oe = esize(p.out_dtype);
  const int64_t w_row_bytes = p.w_sr * we, cols = n1 - n0, nv = (cols + 15) / 16, wv = 16 * we;
  const __mmask16 last = tail16(cols - 16 * (nv - 1));
  alignas(64) float acc[kRowsAtOnce][kKnBlock];
  for (int64_t m0 = 0; m0 < p.M; m0 += kRowsAtOnce) {
    const int mr = static_cast<int>(std::min<int64_t>(kRowsAtOnce, p.M - m0));
    for (int m = 0; m < mr; ++m) std::fill(acc[m], acc[m] + 16 * nv, 0.0f);
    for (int64_t k = 0; k < p.K; ++k) {
      __m512 xs[kRowsAtOnce];
      for (int m = 0; m < mr; ++m) xs[m] = _mm512_set1_ps(load_f(x + (m0 + m) * p.x_sm * xe, k, p.x_dtype));
      const char* wr = w + k * w_row_bytes + n0 * we;
      for (int64_t b = 0; b < cols * we; b += 64) _mm_prefetch(wr + b + kPrefetchBytes, _MM_HINT_T0);
      for (int64_t j = 0; j < nv; ++j) {
        const __m512 wvec = load16(wr + j * wv, p.w_dtype, j + 1 < nv ? __mmask16(0xFFFF) : last);
        for (int m = 0; m < mr; ++m)
          _mm512_store_ps(acc[m] + 16 * j, _mm512_fmadd_ps(xs[m], wvec, _mm512_load_ps(acc[m] + 16 * j)));
      }
    }
    for (int m = 0; m < mr; ++m) {
      char* orow = out + ((m0 + m) * p.o_sm + n0) * oe;
      for (int64_t j = 0; j < nv; ++j)
        store16(orow + 16 * j * oe, _mm512_load_ps(acc[m] + 16 * j), p.out_dtype,
                j + 1 < nv ? __mmask16(0xFFFF) : last);
    }
  }
}

// One weight row (w_nk) dotted with MR x rows: out[m] for m < MR. The weight rows are read one after
// another, each along its bytes: rows read as interleaved streams 1 KB apart ran at 5-9 GB/s from DRAM
// on the Zen 4 machine against 16-22 GB/s for the same rows read in order (docs/profiling.md). Each
// sum lives in a register (an array kept on the stack, a store and a reload per step, ran at 9 GB/s
// from DRAM against 25-30), and every load prefetches kPrefetchBytes further along the weight (rows in
// order, so the prefetch runs ahead across 4 KB pages where the hardware's does not): 35-40 GB/s from
// DRAM, one thread, docs/profiling.md. A weight row serves all MR x rows while it is in registers (one
// x row at a time re-read the block for each: at 4-8 rows the LM head took 2-3.6x its one-row time,
// 0.4-0.6x oneDNN's, docs/performance.md), and the MR sums are independent chains. The sum order of
// each (m, n) (k ascending in one accumulator, then a reduce) does not depend on MR or on the rows
// beside it, so a row's result is bit-identical alone or in a batch.
template <int MR>
IC_AVX512 inline void dot_row_rows(const char* const* xr, const char* wr, int64_t K, DType xd, DType wd,
                                   float* out) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  if (xd == DType::kBFloat16 && wd == DType::kBFloat16) {
    const uint16_t* w16 = reinterpret_cast<const uint16_t*>(wr);
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 mk = tail32(K - k);
      _mm_prefetch(reinterpret_cast<const char*>(w16 + k) + kPrefetchBytes, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, w16 + k);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, reinterpret_cast<const uint16_t*>(xr[m]) + k);
        acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
      }
    }
  } else {
    const int64_t we = esize(wd);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mk = tail16(K - k);
      _mm_prefetch(wr + k * we + kPrefetchBytes, _MM_HINT_T0);
      const __m512 wv = load16(wr + k * we, wd, mk);
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(load16(elem_ptr(xr[m], k, xd), xd, mk), wv, acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

template <int MR>
IC_AVX512 void nk_rows_avx512(const RowsMatmulParams& p, const char* x, const char* w, char* out, int64_t m0,
                              int64_t n0, int64_t n1) {
  const int64_t xe = esize(p.x_dtype), w_row_bytes = p.w_sr * esize(p.w_dtype);
  const char* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = x + (m0 + m) * p.x_sm * xe;
  float r[MR];
  for (int64_t n = n0; n < n1; ++n) {
    dot_row_rows<MR>(xr, w + n * w_row_bytes, p.K, p.x_dtype, p.w_dtype, r);
    for (int m = 0; m < MR; ++m) store_f(out, (m0 + m) * p.o_sm + n, r[m], p.out_dtype);
  }
}

IC_AVX512 void avx512_task(const RowsMatmulParams& p, int64_t g, int64_t n0, int64_t n1) {
  const char* x = elem_ptr(p.x, g * p.x_sg, p.x_dtype);
  const char* w = elem_ptr(p.w, g * p.w_sg, p.w_dtype);
  char* out = const_cast<char*>(elem_ptr(p.out, g * p.o_sg, p.out_dtype));
  if (!p.w_nk) return kn_task_avx512(p, x, w, out, n0, n1);
  using Rows = void (*)(const RowsMatmulParams&, const char*, const char*, char*, int64_t, int64_t, int64_t);
  static constexpr Rows kRows[kRowsAtOnce] = {nk_rows_avx512<1>, nk_rows_avx512<2>, nk_rows_avx512<3>,
                                              nk_rows_avx512<4>, nk_rows_avx512<5>, nk_rows_avx512<6>,
                                              nk_rows_avx512<7>, nk_rows_avx512<8>};
  for (int64_t m0 = 0; m0 < p.M; m0 += kRowsAtOnce)
    kRows[std::min<int64_t>(kRowsAtOnce, p.M - m0) - 1](p, x, w, out, m0, n0, n1);
}
#undef IC_AVX512

// ---------------------------------------------------------------------------------- AVX2
// CPUs with AVX2 + FMA but no AVX-512 BF16 (Zen 2/3, Haswell to Cascade Lake): 8 fp32 lanes, bf16
// widened by a shift, FMA. A task widens each x row to fp32 once (zeros to a multiple of 8); a
// weight row's last K % 8 values, or a block's last N % 8 columns, are read through a zero-padded
// copy. Every output is one fixed-order sum: w_nk, four 8-lane accumulators over k (32 values a
// step, then 8 at a time into the first, the padded tail into the second), added as (a0 + a1) +
// (a2 + a3) and the 8 lanes as a tree; w [K, N], one lane per column over k ascending.
#define IC_AVX2 __attribute__((target("avx2,fma")))

IC_AVX2 inline __m256 load8(const char* p, DType dt) {
  if (dt == DType::kFloat32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The first n (< 8) values at p as fp32, the other lanes zero.
IC_AVX2 inline __m256 load8_tail(const char* p, DType dt, int64_t n) {
  alignas(32) char buf[32] = {};
  std::memcpy(buf, p, n * esize(dt));
  return load8(buf, dt);
}

// Lanes i + 4, then i + 2, then i + 1.
IC_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x: K fp32 values, zeros after them to a multiple of 8. Each 32-value step prefetches the weight
// kPrefetchBytes ahead (one cache line of bf16, two of fp32), as the AVX-512 rows do.
IC_AVX2 inline float dot_row8(const float* x, const char* w, int64_t K, DType wd) {
  const int64_t we = esize(wd);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(w + k * we + kPrefetchBytes, _MM_HINT_T0);
    if (we == 4) _mm_prefetch(w + k * we + 64 + kPrefetchBytes, _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k * we, wd), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8(w + (k + 8) * we, wd), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load8(w + (k + 16) * we, wd), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load8(w + (k + 24) * we, wd), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k * we, wd), a0);
  if (k < K) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8_tail(w + k * we, wd, K - k), a1);
  return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// The first n (<= 8) lanes of v to out[0:n).
IC_AVX2 inline void store8(char* out, __m256 v, DType dt, int64_t n) {
  if (dt == DType::kFloat32 && n == 8) return _mm256_storeu_ps(reinterpret_cast<float*>(out), v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t i = 0; i < n; ++i) store_f(out, i, tmp[i], dt);
}

// Row m of x as fp32 into xf (K values, then zeros to a multiple of 8).
inline void widen_row(const char* x, int64_t K, DType xd, std::vector<float>& xf) {
  xf.assign((K + 7) / 8 * 8, 0.0f);
  for (int64_t k = 0; k < K; ++k) xf[k] = load_f(x, k, xd);
}

// w [K, N]: as kn_task_avx512, 8 lanes a vector, the block's last cols % 8 columns read through
// load8_tail's zero-padded copy; xf is x's row widened to fp32.
IC_AVX2 void kn_row_avx2(const RowsMatmulParams& p, const float* xf, const char* w, char* orow, int64_t n0,
                         int64_t n1) {
  const int64_t we = esize(p.w_dtype), oe = esize(p.out_dtype);
  const int64_t w_row_bytes = p.w_sr * we, cols = n1 - n0, full = cols / 8, left = cols % 8;
  alignas(32) float acc[kKnBlock];
  std::fill(acc, acc + 8 * (full + (left > 0)), 0.0f);
  for (int64_t k = 0; k < p.K; ++k) {
    const __m256 xs = _mm256_set1_ps(xf[k]);
    const char* wr = w + k * w_row_bytes + n0 * we;
    for (int64_t b = 0; b < cols * we; b += 64) _mm_prefetch(wr + b + kPrefetchBytes, _MM_HINT_T0);
    for (int64_t j = 0; j < full; ++j)
      _mm256_store_ps(acc + 8 * j, _mm256_fmadd_ps(xs, load8(wr + 8 * j * we, p.w_dtype), _mm256_load_ps(acc + 8 * j)));
    if (left)
      _mm256_store_ps(acc + 8 * full, _mm256_fmadd_ps(xs, load8_tail(wr + 8 * full * we, p.w_dtype, left),
                                                      _mm256_load_ps(acc + 8 * full)));
  }
  for (int64_t j = 0; j * 8 < cols; ++j)
    store8(orow + (n0 + 8 * j) * oe, _mm256_load_ps(acc + 8 * j), p.out_dtype, std::min<int64_t>(8, cols - 8 * j));
}

IC_AVX2 void avx2_task(const RowsMatmulParams& p, int64_t g, int64_t n0, int64_t n1) {
  const char* x = elem_ptr(p.x, g * p.x_sg, p.x_dtype);
  const char* w = elem_ptr(p.w, g * p.w_sg, p.w_dtype);
  char* out = const_cast<char*>(elem_ptr(p.out, g * p.o_sg, p.out_dtype));
  const int64_t xe = esize(p.x_dtype), we = esize(p.w_dtype), oe = esize(p.out_dtype);
  const int64_t w_row_bytes = p.w_sr * we;
  thread_local std::vector<float> xf;
  for (int64_t m = 0; m < p.M; ++m) {
    widen_row(x + m * p.x_sm * xe, p.K, p.x_dtype, xf);
    char* orow = out + m * p.o_sm * oe;
    if (p.w_nk) {
      for (int64_t n = n0; n < n1; ++n) store_f(orow, n, dot_row8(xf.data(), w + n * w_row_bytes, p.K, p.w_dtype),
                                               p.out_dtype);
      continue;
    }
    kn_row_avx2(p, xf.data(), w, orow, n0, n1);
  }
}
#undef IC_AVX2
#endif

void run(const RowsMatmulParams& p, void (*task)(const RowsMatmulParams&, int64_t, int64_t, int64_t)) {
  const int64_t width = p.w_nk ? kBlock : kKnBlock;
  const int64_t blocks = (p.N + width - 1) / width, tasks = p.G * blocks;
  const int64_t work = p.G * p.M * p.N * p.K;
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / blocks, b = t % blocks;
      task(p, g, b * width, std::min(p.N, (b + 1) * width));
    }
  };
  static const int64_t bound = cpu::serial_work_bound("INDEXCACHE_ROWS_MATMUL_SERIAL_WORK", kParallelWork);
  TORCH_CHECK(bound >= 0, "INDEXCACHE_ROWS_MATMUL_SERIAL_WORK must be a non-negative integer (multiply-adds), got '",
              std::getenv("INDEXCACHE_ROWS_MATMUL_SERIAL_WORK"), "'");
  if (work < bound) return body(0, tasks);
  const int64_t per_task = std::max<int64_t>(work / tasks, 1);
  at::parallel_for(0, tasks, std::max<int64_t>(kChunkWork / per_task, 1), body);
}

void rows_matmul_op(const at::Tensor& x, const at::Tensor& w, bool w_nk, at::Tensor& out) {
  const RowsMatmulParams p = [&] {
    TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [M, K] or [G, M, K], got shape ", x.sizes());
    TORCH_CHECK(w.dim() == x.dim() && out.dim() == x.dim(), "x, w and out must have the same number of dims, got ",
                x.sizes(), ", ", w.sizes(), " and ", out.sizes());
    IC_CHECK_SAME_DEVICE(x, w, "x", "w");
    IC_CHECK_SAME_DEVICE(x, out, "x", "out");
    RowsMatmulParams q{};
    q.x_dtype = float_dtype(x, "x");
    q.w_dtype = float_dtype(w, "w");
    q.out_dtype = float_dtype(out, "out");
    const int b = x.dim() == 3 ? 1 : 0;
    q.G = b ? x.size(0) : 1;
    q.M = x.size(b);
    q.K = x.size(b + 1);
    q.N = w_nk ? w.size(b) : w.size(b + 1);
    const int64_t wk = w_nk ? w.size(b + 1) : w.size(b);
    TORCH_CHECK(wk == q.K, "w ", w.sizes(), (w_nk ? " ([.., N, K])" : " ([.., K, N])"), " does not take x's K = ", q.K,
                " (x ", x.sizes(), ")");
    TORCH_CHECK(!b || (w.size(0) == q.G && out.size(0) == q.G), "x, w and out need the same G, got ", x.sizes(), ", ",
                w.sizes(), " and ", out.sizes());
    TORCH_CHECK(out.size(b) == q.M && out.size(b + 1) == q.N, "out must be [.., ", q.M, ", ", q.N, "], got ",
                out.sizes());
    check_unit_last(x, "x");
    check_unit_last(w, "w");
    check_unit_last(out, "out");
    q.x = x.data_ptr();
    q.w = w.data_ptr();
    q.out = out.data_ptr();
    q.x_sg = b ? x.stride(0) : 0;
    q.x_sm = x.stride(b);
    q.w_sg = b ? w.stride(0) : 0;
    q.w_sr = w.stride(b);
    q.o_sg = b ? out.stride(0) : 0;
    q.o_sm = out.stride(b);
    q.w_nk = w_nk;
    return q;
  }();
  rows_matmul_cpu(p);
}

}  // namespace

void register_rows_matmul_cpu(torch::Library& m) { m.impl("rows_matmul", &rows_matmul_op); }

void rows_matmul_cpu(const RowsMatmulParams& p) {
  if (p.G == 0 || p.M == 0 || p.N == 0) return;
  if (p.K == 0) {  // empty sums
    for (int64_t g = 0; g < p.G; ++g)
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t n = 0; n < p.N; ++n)
          store_f(const_cast<char*>(elem_ptr(p.out, g * p.o_sg, p.out_dtype)), m * p.o_sm + n, 0.0f, p.out_dtype);
    return;
  }
#if defined(__x86_64__)
  const CpuPath path = cpu_op_path(CpuOp::kRowsMatmul, p.w_dtype);
  if (path == CpuPath::kAvx512Bf16) return run(p, avx512_task);
  if (path == CpuPath::kAvx2) return run(p, avx2_task);
#endif
  run(p, portable_task);
}

}  // namespace indexcache
