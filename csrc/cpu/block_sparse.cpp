// MiniMax-M3's block-sparse ops on CPU (indexcache/block_sparse.h; reference.py's MiniMax-M3
// section defines them).
//
// block_topk: one task per query row. The row's visible keys are walked one index block at a
// time: the block's key rows are converted to fp32 once into a tile, every indexer head's dot
// products with them are max-pooled on the spot, so only [h, num_blocks] scores ever exist (never
// [s_q, s_kv]). The local blocks are then forced in and the top blocks kept under the order
// (score desc, block id asc; NaN above +inf), written ascending, then -1.
//
// block_sparse_attention: one task per (row group, KV head), a group being consecutive rows of one
// request. The group's selected blocks are visited once each in ascending order: the block's
// visible keys and values are loaded once for every row that selects it and every query head of
// the KV group, scored by a register-blocked micro-kernel (query vectors x key lanes), softmaxed
// online per (row, head), and P·V added by the same shape of micro-kernel (block_sparse_impl.h;
// bf16 on the avx512bf16 path: both products on vdpbf16ps, P split into two bf16 parts,
// block_sparse_bf16.h). The next block's K/V rows are prefetched while one block is computed.
// fp32 attention on the avx2 and avx512bf16 paths lays the block's query vectors across the lanes
// instead (block_sparse_lanes.h, 8 or 16 lanes from one source: no key transpose, a lane-wise
// softmax, the next block's rows copied during this one), and so does bf16 on the avx2 path.
// Each (row, head) is reduced in its own fixed order, so results are bit-identical run to run and
// whatever the grouping or thread count.
//
// ISA paths: the kernel bodies (block_sparse_impl.h) are compiled three times here: portable
// (baseline x86-64 / any CPU), AVX2+FMA (the avx2 path) and AVX-512 (the avx512bf16 path), from
// generic-vector lane loops plus FMA / vdpbf16ps intrinsics in the micro-kernels, and once more in
// block_sparse_amx.cpp with AMX tiles for bf16 attention (the blas path on AMX CPUs; its
// block_topk is the avx512bf16 one); isa.h's cpu_op_path() picks one at run time.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <initializer_list>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "avx2_convert.h"  // the avx2 build's transpose and bf16 conversion (block_sparse_lanes.h)
#pragma GCC pop_options
#endif

#include "../block_sparse_checks.h"
#include "../checks.h"
#include "indexcache/block_sparse.h"
#include "blas.h"
#include "isa.h"
#include "registry.h"

namespace indexcache {
namespace {

// ------------------------------------------------------------------ selection (scalar, shared)

// Order key of a block score: larger float -> larger key; NaN above +inf (as torch.sort).
inline uint32_t order_key(float v) {
  if (std::isnan(v)) return 0xFFFFFFFFu;
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// bs [nb] block scores of one (row, head); qb the query's block. Writes out [topk] ascending, -1 pad.
void select_row(const float* bs, int64_t nb, int64_t qb, int64_t topk, int64_t local,
                std::vector<std::pair<uint32_t, int32_t>>& cand, int32_t* out) {
  cand.clear();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b) {
    float v = bs[b];
    if (b <= qb && b > qb - local) v = inf;  // forced: a local block ending at the query (clamped at 0)
    if (v == -inf) continue;                 // nothing visible: never selected
    cand.emplace_back(order_key(v), static_cast<int32_t>(b));
  }
  const int64_t k = std::min<int64_t>(topk, static_cast<int64_t>(cand.size()));
  auto better = [](const std::pair<uint32_t, int32_t>& a, const std::pair<uint32_t, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), better);
  for (int64_t i = 0; i < k; ++i) out[i] = cand[i].second;
  std::sort(out, out + k);
  for (int64_t i = k; i < topk; ++i) out[i] = -1;
}

// Rows scored together share their request's keys (each key block is converted once per group).
constexpr int64_t kGroupRows = 16;

// Keys row t sees (its window length; <= 0: none).
inline int64_t row_keys(const BlockTopkParams& p, int64_t t) {
  if (p.ks != nullptr) return static_cast<int64_t>(p.ke[t]) - p.ks[t];
  return static_cast<int64_t>(p.seq_lens[t / p.next_n]) - p.next_n + t % p.next_n + 1;
}

// Group starts (then s_q): runs of <= kGroupRows consecutive rows over the same keys (same ks in
// prefill, same request in decode).
inline void group_rows(const BlockTopkParams& p, std::vector<int64_t>& starts) {
  starts.clear();
  for (int64_t t = 0; t < p.s_q; ++t) {
    const bool same = !starts.empty() && t - starts.back() < kGroupRows &&
                      (p.ks != nullptr ? p.ks[t] == p.ks[starts.back()] : t / p.next_n == starts.back() / p.next_n);
    if (!same) starts.push_back(t);
  }
  starts.push_back(p.s_q);
}

inline int64_t pad16(int64_t d) { return (d + 15) / 16 * 16; }
inline int64_t elem_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

// ------------------------------------------------------------------ per-ISA kernel bodies

#define IC_BLOCK_SPARSE_DRIVERS                                                                             \
  void block_topk(const BlockTopkParams& p) {                                                                 \
    const int64_t es = elem_size(p.qk_dtype), bsz = p.block_size;                                             \
    const char* kbase = static_cast<const char*>(p.k);                                                        \
    std::vector<int64_t> groups;                                                                              \
    group_rows(p, groups);                                                                                    \
    at::parallel_for(0, static_cast<int64_t>(groups.size()) - 1, 1, [&](int64_t g0, int64_t g1) {             \
      std::vector<float> qf(kGroupRows * p.h * p.d), tile((bsz + kChunk) * p.d, 0.0f), krow(p.d), bs;         \
      std::vector<std::pair<uint32_t, int32_t>> cand;                                                         \
      int64_t n[kGroupRows];                                                                                  \
      for (int64_t gi = g0; gi < g1; ++gi) {                                                                  \
        const int64_t t0 = groups[gi], rows = groups[gi + 1] - t0;                                            \
        int64_t n_max = 0;                                                                                    \
        for (int64_t r = 0; r < rows; ++r) n_max = std::max(n_max, n[r] = row_keys(p, t0 + r));               \
        to_float(static_cast<const char*>(p.q) + t0 * p.h * p.d * es, p.qk_dtype, rows * p.h * p.d, qf.data());\
        const int64_t nb = (n_max + bsz - 1) / bsz;                                                           \
        bs.assign(std::max<int64_t>(1, rows * p.h * nb), 0.0f);                                               \
        if (p.ks != nullptr) {                                                                                \
          const int64_t lo = p.ks[t0];                                                                        \
          auto row = [&](int64_t i) { return kbase + (lo + i) * p.d * es; };                                  \
          score_blocks(qf.data(), n, rows, p.h, p.d, nb, bsz, p.qk_dtype, row, tile.data(), krow.data(), bs.data());\
        } else {                                                                                              \
          const int32_t* bt = p.block_table + (t0 / p.next_n) * p.max_pages;                                  \
          auto row = [&](int64_t i) {                                                                         \
            return kbase + (static_cast<int64_t>(bt[i / p.page_size]) * p.page_size + i % p.page_size) * p.d * es;\
          };                                                                                                  \
          score_blocks(qf.data(), n, rows, p.h, p.d, nb, bsz, p.qk_dtype, row, tile.data(), krow.data(), bs.data());\
        }                                                                                                     \
        for (int64_t r = 0; r < rows; ++r) {                                                                  \
          int32_t* out = p.out + (t0 + r) * p.h * p.topk_blocks;                                              \
          if (n[r] <= 0) {                                                                                    \
            std::fill(out, out + p.h * p.topk_blocks, -1);                                                    \
            continue;                                                                                         \
          }                                                                                                   \
          const int64_t nbr = (n[r] + bsz - 1) / bsz;                                                         \
          for (int64_t hh = 0; hh < p.h; ++hh)                                                                \
            select_row(&bs[(r * p.h + hh) * nb], nbr, (n[r] - 1) / bsz, p.topk_blocks, p.local_blocks, cand,  \
                       out + hh * p.topk_blocks);                                                             \
        }                                                                                                     \
      }                                                                                                       \
    });                                                                                                       \
  }                                                                                                           \

#define IC_VEC_BYTES 16
namespace portable {
#include "block_sparse_impl.h"
IC_BLOCK_SPARSE_DRIVERS
}  // namespace portable

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#undef IC_VEC_BYTES
#define IC_VEC_BYTES 32
#define IC_LANES 1  // attention: query vectors across the lanes (block_sparse_lanes.h)
namespace avx2_build {  // (not avx2: that is avx2_convert.h's namespace)
#include "block_sparse_impl.h"
IC_BLOCK_SPARSE_DRIVERS
}  // namespace avx2_build
#undef IC_LANES
#pragma GCC pop_options

#pragma GCC push_options
// The avx512bf16 path only runs on CPUs with AVX-512 BF16 (isa.cpp), so its build may use vdpbf16ps.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")
#undef IC_VEC_BYTES
#define IC_VEC_BYTES 64
#define IC_BF16_DOT 1
#define IC_LANES 1  // fp32 attention: 16 query vectors across the lanes of __m512
namespace avx512 {
#include "block_sparse_impl.h"
IC_BLOCK_SPARSE_DRIVERS
}  // namespace avx512
#undef IC_LANES
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------ op impls (checks: block_sparse_checks.h)

void block_topk_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ks, const at::Tensor& ke,
                   int64_t block_size, int64_t local_blocks, at::Tensor& out) {
  block_topk_cpu(block_sparse_checks::make_block_topk_params(q, k, ks, ke, block_size, local_blocks, out, true));
}

void block_topk_paged_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, int64_t next_n, int64_t block_size, int64_t local_blocks,
                         at::Tensor& out) {
  block_topk_cpu(block_sparse_checks::make_block_topk_paged_params(q, k_cache, block_table, seq_lens, next_n,
                                                                   block_size, local_blocks, out, true));
}

void block_sparse_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_table, const at::Tensor& req, const at::Tensor& pos,
                               const at::Tensor& blocks, int64_t block_size, double scale, at::Tensor& out,
                               at::Tensor& lse) {
  block_sparse_attention_cpu(block_sparse_checks::make_block_sparse_attn_params(
      q, k_cache, v_cache, block_table, req, pos, blocks, block_size, scale, out, lse, true));
}

}  // namespace

void register_block_sparse_cpu(torch::Library& m) {
  m.impl("block_topk", &block_topk_op);
  m.impl("block_topk_paged", &block_topk_paged_op);
  m.impl("block_sparse_attention", &block_sparse_attention_op);
}

void block_topk_cpu(const BlockTopkParams& p) {
#if defined(__x86_64__)
  const CpuPath path = cpu_op_path(CpuOp::kBlockTopk, p.qk_dtype);
  if (path == CpuPath::kAvx512Bf16) return avx512::block_topk(p);
  if (path == CpuPath::kAvx2) return avx2_build::block_topk(p);
#endif
  portable::block_topk(p);
}

void block_sparse_attention_cpu(const BlockSparseAttnParams& p) {
#if defined(__x86_64__)
  const CpuPath path = cpu_op_path(CpuOp::kBlockSparseAttn, p.dtype);
  if (path == CpuPath::kBlas) return block_sparse_attention_amx(p);
  // fp32: the lane kernel at 16 lanes (block_sparse_lanes.h); bf16: the vdpbf16ps panels.
  if (path == CpuPath::kAvx512Bf16) return avx512::attention(p);
  if (path == CpuPath::kAvx2) return avx2_build::attention(p);
#endif
  portable::attention(p);
}

}  // namespace indexcache
