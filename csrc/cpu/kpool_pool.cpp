// The pooled indexer's paged key pooling on CPU (indexcache/kpool_pool.h): every pool completing in
// a step, one call for the batch, instead of a gather / softmax / scatter per request.
//
// Tasks are the completing pools (request after request, pool after pool); a task reads its P
// k | gate rows from one block and writes one pool row, every channel's sums over t ascending, so
// no result depends on the thread count. ISA paths: portable (scalar loops, std::exp) and AVX-512
// (16 channels a vector, simd.h's exp_ps); isa.h's cpu_op_path(CpuOp::kKpoolPool, raw dtype) picks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd.h"
#endif

#include "../kpool_pool_checks.h"
#include "elem_io.h"
#include "indexcache/kpool_pool.h"
#include "isa.h"
#include "registry.h"

namespace indexcache {
namespace {

constexpr int64_t kSerialWork = int64_t{1} << 16;  // k | gate values below which one thread runs a call
constexpr int64_t kChunkWork = int64_t{1} << 14;   // at least this many values per parallel chunk

using cpu::elem_ptr;
using cpu::esize;
using cpu::load_f;
using cpu::store_f;

// One completing pool: its first token's row in raw (block * block_size + row) and its pool row.
struct PoolTask {
  int64_t raw_row, pool_row;
};

// ---------------------------------------------------------------------------------- portable

void portable_pool(const KpoolPoolParams& p, const PoolTask& t) {
  const int64_t d = p.d, w = 2 * d;
  const void* raw = elem_ptr(p.raw, t.raw_row * w, p.raw_dtype);
  for (int64_t c = 0; c < d; ++c) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < p.P; ++i)
      mx = std::max(mx, load_f(raw, i * w + d + c, p.raw_dtype) + load_f(p.ape, i * d + c, p.ape_dtype));
    float sum = 0.0f, num = 0.0f;
    for (int64_t i = 0; i < p.P; ++i) {
      const float e = std::exp(load_f(raw, i * w + d + c, p.raw_dtype) + load_f(p.ape, i * d + c, p.ape_dtype) - mx);
      sum += e;
      num = std::fma(e, load_f(raw, i * w + c, p.raw_dtype), num);
    }
    store_f(p.pool, t.pool_row * d + c, num / sum, p.pool_dtype);
  }
}

// ---------------------------------------------------------------------------------- AVX-512
#if defined(__x86_64__)
#define IC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

using cpu::load16;

// gate + ape for 16 channels of one token
IC_AVX512 inline __m512 logit16(const char* gate, DType gd, const char* ape, DType ad, __mmask16 m) {
  return _mm512_add_ps(load16(gate, gd, m), load16(ape, ad, m));
}

IC_AVX512 void avx512_pool(const KpoolPoolParams& p, const PoolTask& t) {
  const int64_t d = p.d, w = 2 * d, re = esize(p.raw_dtype), ae = esize(p.ape_dtype);
  const char* raw = elem_ptr(p.raw, t.raw_row * w, p.raw_dtype);
  const char* ape = static_cast<const char*>(p.ape);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 m = cpu::tail16(d - c);
    const char* gate = raw + (d + c) * re;
    const char* bias = ape + c * ae;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < p.P; ++i)
      mx = _mm512_max_ps(mx, logit16(gate + i * w * re, p.raw_dtype, bias + i * d * ae, p.ape_dtype, m));
    __m512 sum = _mm512_setzero_ps(), num = _mm512_setzero_ps();
    __mmask16 nan = 0;  // lanes whose l - max is NaN (a NaN logit, or +inf): NaN, as torch's softmax
    for (int64_t i = 0; i < p.P; ++i) {
      const __m512 x = _mm512_sub_ps(logit16(gate + i * w * re, p.raw_dtype, bias + i * d * ae, p.ape_dtype, m), mx);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      const __m512 e = cpu::exp_ps(x);  // exp_ps clamps NaN to exp(-87): the mask restores it
      sum = _mm512_add_ps(sum, e);
      num = _mm512_fmadd_ps(e, load16(raw + (i * w + c) * re, p.raw_dtype, m), num);
    }
    // masked-off lanes divide 0 by 1; only the live lanes are stored
    const __m512 v = _mm512_mask_blend_ps(nan, _mm512_div_ps(num, _mm512_mask_blend_ps(m, _mm512_set1_ps(1.0f), sum)),
                                          _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    cpu::store16(const_cast<char*>(elem_ptr(p.pool, t.pool_row * d + c, p.pool_dtype)), v, p.pool_dtype, m);
  }
}
#undef IC_AVX512
#endif

// The completing pools, request after request (kpool_checks::check_kpool_values has passed).
std::vector<PoolTask> pool_tasks(const KpoolPoolParams& p) {
  std::vector<PoolTask> tasks;
  const int64_t per_block = p.block_size / p.P;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t j = p.ctx_lens[b] / p.P; j < (p.ctx_lens[b] + p.q_lens[b]) / p.P; ++j) {
      const int64_t first = j * p.P, blk = p.block_table[b * p.max_blocks + first / p.block_size];
      const int64_t row = first % p.block_size;
      tasks.push_back({blk * p.block_size + row, blk * per_block + row / p.P});
    }
  return tasks;
}

void run(const KpoolPoolParams& p, const std::vector<PoolTask>& tasks, void (*pool)(const KpoolPoolParams&, const PoolTask&)) {
  const int64_t n = static_cast<int64_t>(tasks.size()), per_task = std::max<int64_t>(p.P * 2 * p.d, 1);
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) pool(p, tasks[t]);
  };
  if (n * per_task < kSerialWork) return body(0, n);
  at::parallel_for(0, n, std::max<int64_t>(kChunkWork / per_task, 1), body);
}

void kpool_pool_paged_op(const at::Tensor& index_raw, at::Tensor& index_pool, const at::Tensor& ape,
                         const at::Tensor& block_table, const at::Tensor& ctx_lens, const at::Tensor& q_lens) {
  kpool_pool_cpu(kpool_checks::make_kpool_pool_params(index_raw, index_pool, ape, block_table, ctx_lens, q_lens));
}

}  // namespace

void register_kpool_pool_cpu(torch::Library& m) { m.impl("kpool_pool_paged", &kpool_pool_paged_op); }

void kpool_pool_cpu(const KpoolPoolParams& p) {
  kpool_checks::check_kpool_values(p);
  const std::vector<PoolTask> tasks = pool_tasks(p);
  if (tasks.empty() || p.d == 0) return;
#if defined(__x86_64__)
  if (cpu_op_path(CpuOp::kKpoolPool, p.raw_dtype) == CpuPath::kAvx512Bf16) return run(p, tasks, avx512_pool);
#endif
  run(p, tasks, portable_pool);
}

}  // namespace indexcache
