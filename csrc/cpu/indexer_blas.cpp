// Indexer scoring on the "blas" path (blas.h): q·kᵀ of a block of query rows (all heads)
// against a block of keys is one oneDNN brgemm, bf16 × bf16 → fp32; the ReLU-weighted head
// sum and the k scale follow on the fp32 block. e4m3 and bf16 values are exact in bf16 and
// the products accumulate in fp32, so scores match the fp32 reference fed the same
// dequantized inputs to fp32 rounding (as the AVX-512 BF16 kernels do).
//
// Memory per thread is O(rows × keys per GEMM): the fused ops never hold [s_q, s_kv].
// Keys are processed on a fixed grid of kKeys-aligned blocks and query rows in fixed blocks
// of kRows, so the plain and fused ops score every (row, key) with the same GEMM shape and
// select from bit-identical scores, whatever the key split.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "aligned.h"
#include "blas.h"
#include "indexcache/fp8.h"
#include "indexer_common.h"
#include "select.h"
#include "simd.h"

namespace indexcache {
namespace {

using cpu::dense_keys;
using cpu::dense_windows;
using cpu::DenseKeys;
using cpu::elem_bytes;
using cpu::PagedKeys;
using cpu::fill_neg_inf;
using cpu::key_splits;
using cpu::paged_windows;
using cpu::write_short_row;

constexpr int64_t kRows = kIndexerRowBlock;  // query rows per GEMM: M = kRows · h (isa.h)
constexpr int64_t kKeys = 256;         // keys per GEMM (N), zero-padded at the end
constexpr int64_t kTaskKeys = 2048;    // keys per task in the plain ops

struct Work {
  cpu::AlignedVec<uint16_t> q;    // [rows · h][d] bf16 (A)
  cpu::AlignedVec<uint32_t> kb;   // [d/2][kKeys] bf16 pairs: the VNNI layout brgemm takes for B
  cpu::AlignedVec<float> dots;    // [rows · h][kKeys]
  alignas(64) float scale[kKeys];
  alignas(64) float scores[kKeys];
};

Work& work(int64_t rows, int64_t h, int64_t d) {
  static thread_local Work w;
  w.q.resize(rows * h * d);
  w.kb.resize(d / 2 * kKeys);
  w.dots.resize(rows * h * kKeys);
  return w;
}

// Query rows [0, nr) of `q` ([nr][h][d], dt) as bf16.
void prep_q(const uint8_t* q, DType dt, int64_t nr, int64_t h, int64_t d, Work& w) {
  const int64_t n = nr * h * d;
  if (dt == DType::kBFloat16) {
    std::memcpy(w.q.data(), q, n * 2);
  } else {
    const uint16_t* t = cpu::e4m3_tables().bf16;
    for (int64_t i = 0; i < n; ++i) w.q[i] = t[q[i]];
  }
}

// Keys [s0, s0 + n) into w.kb as bf16 channel pairs x keys (zero past n) and their scales into
// w.scale. With AVX-512, 16 keys at a time: 16 x 16 transposes of 32-bit pairs (an fp8 key dequantized
// to a bf16 row first, 16 values a vector, exactly: every e4m3 value is a bf16 value); the scalar loop
// otherwise.
template <typename Keys>
__attribute__((target("avx512f"))) void pack_keys_avx512(const Keys& keys, DType dt, int64_t pairs, int64_t s0,
                                                         int64_t n, Work& w) {
  static const uint32_t zero[kIndexHeadDim / 2] = {};
  alignas(64) uint32_t deq[16][kIndexHeadDim / 2];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const uint32_t* rows[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t j = j0 + i;
      if (j >= n) {
        rows[i] = zero;
        continue;
      }
      const uint8_t* r = keys.row(s0 + j);
      if (dt == DType::kBFloat16) {
        rows[i] = reinterpret_cast<const uint32_t*>(r);
      } else {  // e4m3 -> fp32 exactly (simd.h), whose top half is the bf16 value (the table's, every byte)
        uint16_t* d16 = reinterpret_cast<uint16_t*>(deq[i]);
        for (int64_t c = 0; c < 2 * pairs; c += 16)
          _mm256_store_si256(reinterpret_cast<__m256i*>(d16 + c),
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(cpu::e4m3x16(r + c)), 16)));
        rows[i] = deq[i];
      }
    }
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) cpu::transpose16x16_epi32(rows, p0, w.kb.data() + p0 * kKeys + j0, kKeys);
  }
}

template <typename Keys>
void pack_keys(const Keys& keys, DType dt, int64_t d, int64_t s0, int64_t n, Work& w) {
  const int64_t pairs = d / 2;
  uint32_t* kb = w.kb.data();
  for (int64_t j = 0; j < n; ++j) w.scale[j] = keys.scale_of(s0 + j);
  if (n < kKeys) std::fill_n(w.scale + n, kKeys - n, 0.f);
  const int64_t n16 = (n + 15) / 16 * 16;  // the vector packing writes whole groups of 16 keys
  const bool vec = cpu_features().avx512 && pairs % 16 == 0;
  const int64_t filled = vec ? n16 : n;
  if (filled < kKeys)
    for (int64_t p = 0; p < pairs; ++p) std::fill_n(kb + p * kKeys + filled, kKeys - filled, 0u);
  if (vec) return pack_keys_avx512(keys, dt, pairs, s0, n, w);
  const uint16_t* t = cpu::e4m3_tables().bf16;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* r = keys.row(s0 + j);
    if (dt == DType::kBFloat16) {
      uint32_t pr[kIndexHeadDim / 2];
      std::memcpy(pr, r, pairs * 4);
      for (int64_t p = 0; p < pairs; ++p) kb[p * kKeys + j] = pr[p];
    } else {
      for (int64_t p = 0; p < pairs; ++p)
        kb[p * kKeys + j] = static_cast<uint32_t>(t[r[2 * p]]) | (static_cast<uint32_t>(t[r[2 * p + 1]]) << 16);
    }
  }
}

// scores[j] = scale[j] · Σ_h w[h] · ReLU(dots[h][j]); the ReLU keeps NaN (docs/ops.md).
__attribute__((target_clones("avx512f", "avx2", "default"))) void head_sum(const float* dots, const float* w,
                                                                           int64_t h, const float* scale,
                                                                           float* scores) {
  float acc[kKeys] = {};
  for (int64_t hh = 0; hh < h; ++hh) {
    const float wv = w[hh];
    const float* dr = dots + hh * kKeys;
    for (int64_t j = 0; j < kKeys; ++j) {
      const float v = dr[j];
      acc[j] += wv * (v < 0.f ? 0.f : v);
    }
  }
  for (int64_t j = 0; j < kKeys; ++j) scores[j] = acc[j] * scale[j];
}

// Rows [0, nr) (queries already in w.q, weights [nr][h], windows lo/hi) against keys
// [c0, c1) on the kKeys grid; on_scores(r, s0, n, scores) per row and block it overlaps.
template <typename Keys, typename OnScores>
void score_rows(const Keys& keys, DType dt, int64_t h, int64_t d, int64_t nr, const float* weights,
                const int64_t* lo, const int64_t* hi, int64_t c0, int64_t c1, Work& w, OnScores on_scores) {
  for (int64_t s0 = c0; s0 < c1; s0 += kKeys) {
    const int64_t n = std::min(kKeys, c1 - s0);
    bool any = false;
    for (int64_t r = 0; r < nr && !any; ++r) any = lo[r] < s0 + n && hi[r] > s0;
    if (!any) continue;
    pack_keys(keys, dt, d, s0, n, w);
    at::native::cpublas::brgemm(nr * h, kKeys, d, d, kKeys, kKeys, false,
                                reinterpret_cast<const at::BFloat16*>(w.q.data()),
                                reinterpret_cast<const at::BFloat16*>(w.kb.data()), w.dots.data(), true);
    for (int64_t r = 0; r < nr; ++r) {
      if (lo[r] >= s0 + n || hi[r] <= s0) continue;
      head_sum(w.dots.data() + r * h * kKeys, weights + r * h, h, w.scale, w.scores);
      on_scores(r, s0, n, w.scores);
    }
  }
}

const uint8_t* dense_q(const IndexerParams& p, int64_t r) {
  return static_cast<const uint8_t*>(p.q) + r * p.h * p.d * elem_bytes(p.qk_dtype);
}

}  // namespace

bool indexer_logits_blas(const IndexerParams& p, const LogitsOut& o) {
  if (p.qk_dtype == DType::kFloat32 || p.d != kIndexHeadDim) return false;
  std::vector<int64_t> lo, hi;
  dense_windows(p, lo, hi);
  const DenseKeys keys = dense_keys(p);
  const int64_t blocks = (p.s_q + kRows - 1) / kRows;
  const int64_t chunks = std::max<int64_t>(1, (p.s_kv + kTaskKeys - 1) / kTaskKeys);
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    TileRelease release;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r0 = (task / chunks) * kRows, r1 = std::min(p.s_q, r0 + kRows);
      const int64_t c0 = (task % chunks) * kTaskKeys, c1 = std::min(p.s_kv, c0 + kTaskKeys);
      for (int64_t r = r0; r < r1; ++r) fill_neg_inf(o.logits + r * o.stride + c0, c1 - c0);
      Work& w = work(r1 - r0, p.h, p.d);
      prep_q(dense_q(p, r0), p.qk_dtype, r1 - r0, p.h, p.d, w);
      score_rows(keys, p.qk_dtype, p.h, p.d, r1 - r0, p.weights + r0 * p.h, lo.data() + r0, hi.data() + r0, c0,
                 c1, w, [&](int64_t r, int64_t s0, int64_t n, const float* scores) {
                   float* dst = o.logits + (r0 + r) * o.stride;
                   const int64_t a = std::max(lo[r0 + r], s0), e = std::min(hi[r0 + r], s0 + n);
                   for (int64_t s = a; s < e; ++s) dst[s] = scores[s - s0];
                 });
    }
  });
  if (o.cols > p.s_kv)
    for (int64_t r = 0; r < p.s_q; ++r) fill_neg_inf(o.logits + r * o.stride + p.s_kv, o.cols - p.s_kv);
  return true;
}

bool indexer_logits_paged_blas(const PagedIndexerParams& p, const LogitsOut& o) {
  std::vector<int64_t> lo, hi;
  paged_windows(p, lo, hi);
  const int64_t rows = p.batch * p.next_n;
  for (int64_t r = 0; r < rows; ++r) fill_neg_inf(o.logits + r * o.stride, o.cols);
  // Tasks are (request, key chunk), so one long request still spreads over every thread.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t c0 = 0; c0 < p.seq_lens[b]; c0 += kTaskKeys) tasks.emplace_back(b, c0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    TileRelease release;
    for (int64_t t = begin; t < end; ++t) {
      const auto [b, c0] = tasks[t];
      const int64_t c1 = std::min<int64_t>(p.seq_lens[b], c0 + kTaskKeys);
      const PagedKeys keys{p.cache, p.block_table + b * p.max_blocks, p.block_size, p.d};
      for (int64_t r0 = b * p.next_n; r0 < (b + 1) * p.next_n; r0 += kRows) {
        const int64_t r1 = std::min((b + 1) * p.next_n, r0 + kRows);
        Work& w = work(r1 - r0, p.h, p.d);
        prep_q(p.q + r0 * p.h * p.d, DType::kFp8E4M3, r1 - r0, p.h, p.d, w);
        score_rows(keys, DType::kFp8E4M3, p.h, p.d, r1 - r0, p.weights + r0 * p.h, lo.data() + r0, hi.data() + r0,
                   c0, c1, w, [&](int64_t r, int64_t s0, int64_t n, const float* scores) {
                     float* dst = o.logits + (r0 + r) * o.stride;
                     const int64_t e = std::min(hi[r0 + r], s0 + n);
                     for (int64_t s = s0; s < e; ++s) dst[s] = scores[s - s0];
                   });
      }
    }
  });
  return true;
}

bool indexer_topk_blas(const IndexerParams& p, const TopkOut& o) {
  if (p.qk_dtype == DType::kFloat32 || p.d != kIndexHeadDim) return false;
  std::vector<int64_t> lo, hi;
  dense_windows(p, lo, hi);
  const DenseKeys keys = dense_keys(p);
  cpu::fused_topk<TileRelease>(p.s_q, kRows, p.s_kv, kKeys, lo.data(), hi.data(), o,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const int64_t* rlo, const int64_t* rhi,
                 auto on_scores) {
               Work& w = work(r1 - r0, p.h, p.d);
               prep_q(dense_q(p, r0), p.qk_dtype, r1 - r0, p.h, p.d, w);
               score_rows(keys, p.qk_dtype, p.h, p.d, r1 - r0, p.weights + r0 * p.h, rlo, rhi, c0, c1, w, on_scores);
             });
  return true;
}

bool indexer_topk_paged_blas(const PagedIndexerParams& p, const TopkOut& o) {
  std::vector<int64_t> lo, hi;
  paged_windows(p, lo, hi);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) max_keys = std::max<int64_t>(max_keys, p.seq_lens[b]);
  auto run = [&](int64_t base, int64_t b) {
    return [&p, base, b](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const int64_t* rlo, const int64_t* rhi,
                         auto on_scores) {
      const int64_t req = b >= 0 ? b : (base + r0) / p.next_n;
      const PagedKeys keys{p.cache, p.block_table + req * p.max_blocks, p.block_size, p.d};
      Work& w = work(r1 - r0, p.h, p.d);
      prep_q(p.q + (base + r0) * p.h * p.d, DType::kFp8E4M3, r1 - r0, p.h, p.d, w);
      score_rows(keys, DType::kFp8E4M3, p.h, p.d, r1 - r0, p.weights + (base + r0) * p.h, rlo, rhi, c0, c1, w,
                 on_scores);
    };
  };
  if (p.next_n <= kRows) {
    // Decode / MTP verify: one row block per request (its draft rows share its keys).
    cpu::fused_topk<TileRelease>(p.batch * p.next_n, p.next_n, max_keys, kKeys, lo.data(), hi.data(), o, run(0, -1));
    return true;
  }
  // A prefill chunk scored as next_n decode rows: row blocks of kRows within each request.
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t base = b * p.next_n;
    const TopkOut ob{o.out + base * o.stride, o.stride, o.width, o.topk};
    cpu::fused_topk<TileRelease>(p.next_n, kRows, p.seq_lens[b], kKeys, lo.data() + base, hi.data() + base, ob,
                                 run(base, b));
  }
  return true;
}

}  // namespace indexcache
