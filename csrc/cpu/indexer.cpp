// CPU indexer: scoring (prefill and paged decode), top-k into the shared buffer, and the
// fused scoring + top-k that never materialises the [s_q, s_kv] logits.
//
// Scores are computed 32 keys at a time. With AVX-512 BF16 the key tile is packed as
// bf16 pairs ([d/2][32 keys][2], exact for e4m3 and bf16 inputs) and each query head's
// pair is broadcast into vdpbf16ps with fp32 accumulation; fp32 inputs there run an AVX-512 FMA
// kernel of the same shape on a [d][32] fp32 tile (8 heads x 32 keys in registers). On the avx2
// path every dtype's keys are widened to that fp32 tile and scored by AVX2 FMAs, 6 heads x 16 keys
// in registers (indexer_avx2.cpp); otherwise a portable fp32 loop runs on the tile. The fused and plain ops call the same tile
// routine, so they select from bit-identical scores.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "../checks.h"
#include "registry.h"
#include "avx2.h"
#include "blas.h"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "indexer_common.h"
#include "select.h"
#include "simd.h"

namespace indexcache {
namespace {

using cpu::dense_keys;
using cpu::dense_windows;
using cpu::DenseKeys;
using cpu::PagedKeys;
using cpu::fill_neg_inf;
using cpu::key_splits;
using cpu::paged_windows;
using cpu::write_short_row;

constexpr int kTile = 32;
constexpr int64_t kRowBlock = kIndexerRowBlock;  // query rows sharing one packed key tile
constexpr int64_t kKeyChunk = 2048;   // keys per task in the plain logits op

// The indexer's path is cpu_op_path(kIndexer, dt) (blas declines fp32, which then runs avx512bf16's
// FMA tiles).
// The tile kernel scores run on: vdpbf16ps on bf16 pairs, AVX-512 FMAs on fp32 (both the
// avx512bf16 path's), AVX2 FMAs on fp32 tiles of any key dtype (the avx2 path's), or the portable
// fp32 loop (its target_clones build for the CPU).
enum class Tiles { kF32, kF32Avx512, kBf16, kF32Avx2 };
Tiles tiles_for(DType dt) {
  const CpuPath path = cpu_op_path(CpuOp::kIndexer, dt);
  if (path == CpuPath::kAvx2) return Tiles::kF32Avx2;
  if (path != CpuPath::kAvx512Bf16) return Tiles::kF32;
  return dt == DType::kFloat32 ? Tiles::kF32Avx512 : Tiles::kBf16;
}

inline float elem_f32(const void* row, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat32: return static_cast<const float*>(row)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
    default: return cpu::e4m3_tables().f32[static_cast<const uint8_t*>(row)[i]];
  }
}
inline uint16_t elem_bf16(const void* row, DType dt, int64_t i) {
  return dt == DType::kBFloat16 ? static_cast<const uint16_t*>(row)[i]
                                : cpu::e4m3_tables().bf16[static_cast<const uint8_t*>(row)[i]];
}

// A packed tile of up to 32 keys starting at s0; missing keys are zero.
struct KeyTile {
  alignas(64) uint32_t pairs[kMaxIndexerHeadDim / 2 * kTile];  // bf16 path, [d/2][32]
  std::vector<float> f32;                                  // portable path, [d][32]
  float scale[kTile];
  int n = 0;
};

// The avx512bf16 path's tiles (kind kBf16 or kF32Avx512) by 16 x 16 transposes of whole rows of
// 32-bit elements: bf16 pairs (bf16 keys in place; fp8 rows converted to pairs first) or fp32.
template <typename Keys>
__attribute__((target("avx512f"))) void pack_tile_avx512(const Keys& keys, DType dt, int64_t d, int64_t s0, int n,
                                                        Tiles kind, KeyTile& t) {
  alignas(64) static const uint32_t zeros[kMaxIndexerHeadDim] = {};
  alignas(64) uint32_t conv[kTile][kMaxIndexerHeadDim / 2];
  const int64_t cols = kind == Tiles::kBf16 ? d / 2 : d;
  const uint32_t* rows[kTile];
  for (int j = 0; j < kTile; ++j) {
    if (j >= n) {
      rows[j] = zeros;
    } else if (kind == Tiles::kBf16 && dt != DType::kBFloat16) {
      // e4m3 -> fp32 -> bf16 pairs, 16 at a time; exact (every e4m3 value is a bf16 value).
      const uint8_t* r = static_cast<const uint8_t*>(keys.row(s0 + j));
      for (int64_t c = 0; c < d; c += 16) {
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(cpu::e4m3x16(r + c)), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(conv[j] + c / 2), _mm512_cvtepi32_epi16(bits));
      }
      rows[j] = conv[j];
    } else {
      rows[j] = reinterpret_cast<const uint32_t*>(keys.row(s0 + j));
    }
  }
  uint32_t* dst = kind == Tiles::kBf16 ? t.pairs : reinterpret_cast<uint32_t*>(t.f32.data());
  for (int j = 0; j < kTile; j += 16)
    for (int64_t c = 0; c < cols; c += 16) cpu::transpose16x16_epi32(rows + j, c, dst + c * kTile + j, kTile);
}

template <typename Keys>
void pack_tile(const Keys& keys, DType dt, int64_t d, int64_t s0, int n, Tiles kind, KeyTile& t) {
  t.n = n;
  for (int j = 0; j < kTile; ++j) t.scale[j] = j < n ? keys.scale_of(s0 + j) : 0.f;
  if (kind == Tiles::kF32Avx2 && d % 8 == 0) {
    t.f32.resize(d * kTile);
    const void* rows[kTile];
    for (int j = 0; j < n; ++j) rows[j] = keys.row(s0 + j);
    indexer_pack_tile_avx2(rows, n, dt, d, t.f32.data());
    return;
  }
  if ((kind == Tiles::kBf16 || kind == Tiles::kF32Avx512) && d % 32 == 0 && d <= kMaxIndexerHeadDim) {
    if (kind == Tiles::kF32Avx512) t.f32.resize(d * kTile);
    pack_tile_avx512(keys, dt, d, s0, n, kind, t);
    return;
  }
  if (kind == Tiles::kBf16) {
    const int64_t pairs = d / 2;
    for (int j = 0; j < kTile; ++j) {
      if (j >= n) {
        for (int64_t p = 0; p < pairs; ++p) t.pairs[p * kTile + j] = 0;
        continue;
      }
      const void* r = keys.row(s0 + j);
      for (int64_t p = 0; p < pairs; ++p) {
        t.pairs[p * kTile + j] = static_cast<uint32_t>(elem_bf16(r, dt, 2 * p)) |
                                 (static_cast<uint32_t>(elem_bf16(r, dt, 2 * p + 1)) << 16);
      }
    }
  } else if (dt == DType::kFloat32) {
    t.f32.resize(d * kTile);
    for (int j = 0; j < kTile; ++j) {
      const float* r = j < n ? reinterpret_cast<const float*>(keys.row(s0 + j)) : nullptr;
      for (int64_t c = 0; c < d; ++c) t.f32[c * kTile + j] = r ? r[c] : 0.f;
    }
  } else {
    t.f32.resize(d * kTile);
    for (int j = 0; j < kTile; ++j) {
      const void* r = j < n ? keys.row(s0 + j) : nullptr;
      for (int64_t c = 0; c < d; ++c) t.f32[c * kTile + j] = r ? elem_f32(r, dt, c) : 0.f;
    }
  }
}

// One query row prepared for scoring: bf16 pairs [h][d/2] or fp32 [h][d].
struct QueryRow {
  std::vector<uint32_t> pairs;
  std::vector<float> f32;
  const float* w = nullptr;  // [h]
};

void prepare_query(const void* q, DType dt, int64_t h, int64_t d, Tiles kind, const float* w, QueryRow& out) {
  out.w = w;
  if (kind == Tiles::kBf16) {
    out.pairs.resize(h * d / 2);
    for (int64_t i = 0; i < h * d / 2; ++i)
      out.pairs[i] = static_cast<uint32_t>(elem_bf16(q, dt, 2 * i)) | (static_cast<uint32_t>(elem_bf16(q, dt, 2 * i + 1)) << 16);
  } else {
    out.f32.resize(h * d);
    for (int64_t i = 0; i < h * d; ++i) out.f32[i] = elem_f32(q, dt, i);
  }
}

// ---------------------------------------------------------------- tile scoring

template <int HB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void heads_bf16(const uint32_t* qp, const float* w,
                                                                                 const uint32_t* kt, int64_t pairs,
                                                                                 __m512& o0, __m512& o1) {
  __m512 acc0[HB], acc1[HB];
  for (int i = 0; i < HB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * kTile);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + p * kTile + 16);
    for (int i = 0; i < HB; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i * pairs + p]));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], qb, k0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], qb, k1);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < HB; ++i) {
    const __m512 wv = _mm512_set1_ps(w[i]);
    // max_ps returns its second operand when either is NaN: ReLU keeps a NaN dot.
    o0 = _mm512_fmadd_ps(_mm512_max_ps(zero, acc0[i]), wv, o0);
    o1 = _mm512_fmadd_ps(_mm512_max_ps(zero, acc1[i]), wv, o1);
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void score_tile_bf16(const QueryRow& q, const KeyTile& t,
                                                                               int64_t h, int64_t d, float* out) {
  const int64_t pairs = d / 2;
  __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps();
  int64_t hh = 0;
  for (; hh + 8 <= h; hh += 8) heads_bf16<8>(q.pairs.data() + hh * pairs, q.w + hh, t.pairs, pairs, o0, o1);
  for (; hh < h; ++hh) heads_bf16<1>(q.pairs.data() + hh * pairs, q.w + hh, t.pairs, pairs, o0, o1);
  o0 = _mm512_mul_ps(o0, _mm512_loadu_ps(t.scale));
  o1 = _mm512_mul_ps(o1, _mm512_loadu_ps(t.scale + 16));
  _mm512_storeu_ps(out, o0);
  _mm512_storeu_ps(out + 16, o1);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void score_tile_f32(const QueryRow& q, const KeyTile& t,
                                                                                 int64_t h, int64_t d, float* out) {
  float o[kTile] = {};
  const float* kt = t.f32.data();
  for (int64_t hh = 0; hh < h; ++hh) {
    float acc[kTile] = {};
    const float* qh = q.f32.data() + hh * d;
    for (int64_t c = 0; c < d; ++c) {
      const float qv = qh[c];
      for (int j = 0; j < kTile; ++j) acc[j] += qv * kt[c * kTile + j];
    }
    const float w = q.w[hh];
    for (int j = 0; j < kTile; ++j) o[j] += w * (acc[j] < 0.f ? 0.f : acc[j]);  // NaN kept
  }
  for (int j = 0; j < kTile; ++j) out[j] = o[j] * t.scale[j];
}

// HB heads' ReLU-weighted scores against the 32 keys of an fp32 tile kt [d][32], added to o0 / o1.
template <int HB>
__attribute__((target("avx512f"))) inline void heads_f32(const float* qh, const float* w, const float* kt, int64_t d,
                                                        __m512& o0, __m512& o1) {
  __m512 acc0[HB], acc1[HB];
  for (int i = 0; i < HB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m512 k0 = _mm512_loadu_ps(kt + c * kTile), k1 = _mm512_loadu_ps(kt + c * kTile + 16);
    for (int i = 0; i < HB; ++i) {
      const __m512 qb = _mm512_set1_ps(qh[i * d + c]);
      acc0[i] = _mm512_fmadd_ps(qb, k0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(qb, k1, acc1[i]);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < HB; ++i) {
    const __m512 wv = _mm512_set1_ps(w[i]);
    // max_ps returns its second operand when either is NaN: ReLU keeps a NaN dot.
    o0 = _mm512_fmadd_ps(_mm512_max_ps(zero, acc0[i]), wv, o0);
    o1 = _mm512_fmadd_ps(_mm512_max_ps(zero, acc1[i]), wv, o1);
  }
}

// fp32 scores on AVX-512: 8 heads x 32 keys (16 accumulators) per pass over the tile, so each
// tile vector loaded serves 8 heads (the portable loop reloads it for every head).
__attribute__((target("avx512f"))) void score_tile_f32_avx512(const QueryRow& q, const KeyTile& t, int64_t h,
                                                             int64_t d, float* out) {
  __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps();
  const float* kt = t.f32.data();
  int64_t hh = 0;
  for (; hh + 8 <= h; hh += 8) heads_f32<8>(q.f32.data() + hh * d, q.w + hh, kt, d, o0, o1);
  for (; hh + 4 <= h; hh += 4) heads_f32<4>(q.f32.data() + hh * d, q.w + hh, kt, d, o0, o1);
  for (; hh < h; ++hh) heads_f32<1>(q.f32.data() + hh * d, q.w + hh, kt, d, o0, o1);
  _mm512_storeu_ps(out, _mm512_mul_ps(o0, _mm512_loadu_ps(t.scale)));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(o1, _mm512_loadu_ps(t.scale + 16)));
}

inline void score_tile(const QueryRow& q, const KeyTile& t, int64_t h, int64_t d, Tiles kind, float* out) {
  switch (kind) {
    case Tiles::kBf16: score_tile_bf16(q, t, h, d, out); break;
    case Tiles::kF32Avx512: score_tile_f32_avx512(q, t, h, d, out); break;
    case Tiles::kF32Avx2: indexer_score_tile_avx2(q.f32.data(), q.w, h, d, t.f32.data(), t.scale, out); break;
    case Tiles::kF32: score_tile_f32(q, t, h, d, out); break;
  }
}

// ---------------------------------------------------------------- shared drivers

// Rows [r0, r1) with windows [lo[r], hi[r]) over the keys of `keys`; calls
// on_scores(row, s0, n, scores) for every tile that overlaps the row's window, in
// increasing key order, for tiles in [c0, c1).
template <typename Keys, typename RowQ, typename OnScores>
void score_rows(const Keys& keys, DType dt, int64_t h, int64_t d, Tiles kind, int64_t r0, int64_t r1,
                const int64_t* lo, const int64_t* hi, int64_t c0, int64_t c1, RowQ row_query, OnScores on_scores) {
  std::vector<QueryRow> qrows(r1 - r0);
  for (int64_t r = r0; r < r1; ++r) row_query(r, qrows[r - r0]);
  KeyTile tile;
  alignas(64) float scores[kTile];
  for (int64_t s0 = c0; s0 < c1; s0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, c1 - s0));
    bool packed = false;
    for (int64_t r = r0; r < r1; ++r) {
      if (lo[r - r0] >= s0 + n || hi[r - r0] <= s0) continue;
      if (!packed) {
        pack_tile(keys, dt, d, s0, n, kind, tile);
        packed = true;
      }
      score_tile(qrows[r - r0], tile, h, d, kind, scores);
      on_scores(r, s0, n, scores);
    }
  }
}

struct NoGuard {};

// score_rows reports absolute rows; fused_topk's emit takes them relative to the block's r0.
template <typename Emit>
auto relative(int64_t r0, Emit emit) {
  return [r0, emit](int64_t r, int64_t s0, int n, const float* scores) { emit(r - r0, s0, n, scores); };
}

auto dense_query(const IndexerParams& p, Tiles kind) {
  const int64_t elem = cpu::elem_bytes(p.qk_dtype);
  return [&p, kind, elem](int64_t r, QueryRow& q) {
    prepare_query(static_cast<const uint8_t*>(p.q) + r * p.h * p.d * elem, p.qk_dtype, p.h, p.d, kind,
                  p.weights + r * p.h, q);
  };
}

auto paged_query(const PagedIndexerParams& p, Tiles kind) {
  return [&p, kind](int64_t r, QueryRow& q) {
    prepare_query(p.q + r * p.h * p.d, DType::kFp8E4M3, p.h, p.d, kind, p.weights + r * p.h, q);
  };
}

}  // namespace

// set_cpu_isa / cpu_isa: csrc/cpu/isa.cpp.

void indexer_logits_cpu(const IndexerParams& p, const LogitsOut& o) {
  if (cpu_op_path(CpuOp::kIndexer, p.qk_dtype) == CpuPath::kBlas && indexer_logits_blas(p, o)) return;
  const Tiles kind = tiles_for(p.qk_dtype);
  std::vector<int64_t> lo, hi;
  dense_windows(p, lo, hi);
  const DenseKeys keys = dense_keys(p);
  const auto row_query = dense_query(p, kind);
  const int64_t blocks = (p.s_q + kRowBlock - 1) / kRowBlock;
  const int64_t chunks = std::max<int64_t>(1, (p.s_kv + kKeyChunk - 1) / kKeyChunk);
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r0 = (task / chunks) * kRowBlock, r1 = std::min(p.s_q, r0 + kRowBlock);
      const int64_t c0 = (task % chunks) * kKeyChunk, c1 = std::min(p.s_kv, c0 + kKeyChunk);
      for (int64_t r = r0; r < r1; ++r) fill_neg_inf(o.logits + r * o.stride + c0, c1 - c0);
      score_rows(keys, p.qk_dtype, p.h, p.d, kind, r0, r1, lo.data() + r0, hi.data() + r0, c0, c1, row_query,
                 [&](int64_t r, int64_t s0, int n, const float* scores) {
                   float* dst = o.logits + r * o.stride;
                   const int64_t a = std::max<int64_t>(lo[r], s0), e = std::min<int64_t>(hi[r], s0 + n);
                   for (int64_t s = a; s < e; ++s) dst[s] = scores[s - s0];
                 });
    }
  });
  // Columns past s_kv (a wider output) are outside every window.
  if (o.cols > p.s_kv)
    for (int64_t r = 0; r < p.s_q; ++r) fill_neg_inf(o.logits + r * o.stride + p.s_kv, o.cols - p.s_kv);
}

void indexer_logits_paged_cpu(const PagedIndexerParams& p, const LogitsOut& o) {
  if (cpu_op_path(CpuOp::kIndexer, DType::kFp8E4M3) == CpuPath::kBlas && indexer_logits_paged_blas(p, o)) return;
  const Tiles kind = tiles_for(DType::kFp8E4M3);
  std::vector<int64_t> lo, hi;
  paged_windows(p, lo, hi);
  const auto row_query = paged_query(p, kind);
  at::parallel_for(0, p.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * p.next_n, r1 = r0 + p.next_n;
      for (int64_t r = r0; r < r1; ++r) fill_neg_inf(o.logits + r * o.stride, o.cols);
      const PagedKeys keys{p.cache, p.block_table + b * p.max_blocks, p.block_size, p.d};
      score_rows(keys, DType::kFp8E4M3, p.h, p.d, kind, r0, r1, lo.data() + r0, hi.data() + r0, 0,
                 std::max<int64_t>(0, p.seq_lens[b]), row_query,
                 [&](int64_t r, int64_t s0, int n, const float* scores) {
                   float* dst = o.logits + r * o.stride;
                   const int64_t e = std::min<int64_t>(hi[r], s0 + n);
                   for (int64_t s = s0; s < e; ++s) dst[s] = scores[s - s0];
                 });
    }
  });
}

namespace {

// Grow-only scratch that is never value-initialised (a vector's resize would zero it).
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> data;
  int64_t cap = 0;
  T* get(int64_t n) {
    if (n > cap) {
      data.reset(new T[n]);
      cap = n;
    }
    return data.get();
  }
};

// Keys of x[0:n) that are >= floor, with their positions, in position order; returns
// how many were written to keys/pos (each must hold n + 16).
__attribute__((target("avx512f"))) int64_t filter_at_least_avx512(const float* x, int64_t n, uint32_t floor,
                                                                    uint32_t* keys, int32_t* pos) {
  int64_t w = 0, i = 0;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i all = _mm512_set1_epi32(-1);
  const __m512i fl = _mm512_set1_epi32(static_cast<int>(floor));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    // order_key: negative -> ~u, else u | sign.
    const __mmask16 neg = _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512());
    __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), neg, u, all);
    // As order_key: -0 is +0, every NaN is the largest key.
    key = _mm512_mask_mov_epi32(key, _mm512_cmpeq_epi32_mask(u, sign), sign);
    const __m512 xf = _mm512_castsi512_ps(u);
    key = _mm512_mask_mov_epi32(key, _mm512_cmp_ps_mask(xf, xf, _CMP_UNORD_Q), all);
    const __mmask16 keep = _mm512_cmpge_epu32_mask(key, fl);
    if (keep) {
      // Compress in registers and store whole vectors (the buffers have 16 spare slots):
      // a masked compress-store to memory is microcoded and very slow on some CPUs.
      _mm512_storeu_si512(keys + w, _mm512_maskz_compress_epi32(keep, key));
      _mm512_storeu_si512(pos + w, _mm512_maskz_compress_epi32(
                                       keep, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i)))));
      w += __builtin_popcount(keep);
    }
  }
  return cpu::keep_at_least(x, i, n, floor, keys, pos, w);
}

// Top-k of one long row (n > k) through a sampled floor: a strided sample estimates a key
// that about 1.5k elements exceed; one vectorised pass keeps those, and the exact radix
// select runs on the survivors only. If fewer than k survive, the full radix select runs.
// Either way the result is the exact top k under (value desc, position asc).
int64_t topk_row(const float* x, int64_t n, int64_t k, int32_t* out, std::vector<uint32_t>& scratch,
                 Scratch<uint32_t>& key_buf, Scratch<int32_t>& pos_buf) {
  int64_t j = 0;
  const CpuPath path = cpu_op_path(CpuOp::kTopk, DType::kFloat32);
  const bool avx512 = path == CpuPath::kAvx512Bf16;
  if (n >= 8 * k && n >= 4096 && (avx512 || path == CpuPath::kAvx2)) {
    // 32 contiguous runs of 16 (one cache line each) spread over the row: as good a sample
    // for the floor as 512 strided values, at 32 cache misses instead of 512.
    constexpr int64_t m = 512, run = 16, runs = m / run;
    const int64_t stride = (n - run) / (runs - 1);
    uint32_t sample[m];
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t i = 0; i < run; ++i) sample[r * run + i] = cpu::order_key(x[r * stride + i]);
    const double expect = m * static_cast<double>(k) / static_cast<double>(n);
    const int64_t rank = std::min<int64_t>(m - 1, static_cast<int64_t>(1.5 * expect + 4 * std::sqrt(expect) + 8));
    std::nth_element(sample, sample + rank, sample + m, std::greater<uint32_t>());
    uint32_t* keys = key_buf.get(n + 16);
    int32_t* pos = pos_buf.get(n + 16);
    const int64_t c = avx512 ? filter_at_least_avx512(x, n, sample[rank], keys, pos)
                             : filter_at_least_avx2(x, n, sample[rank], keys, pos);
    if (c >= k && !avx512) {
      scratch.resize(std::max<size_t>(scratch.size(), c));
      return select_survivors_avx2(keys, pos, c, k, out, scratch.data());
    }
    if (c >= k) {
      const cpu::Threshold t = cpu::select_threshold(c, k, [&](int64_t i) { return keys[i]; }, scratch);
      cpu::emit_selected(c, t, [&](int64_t i) { return keys[i]; }, [&](int64_t i) { out[j++] = pos[i]; });
      return j;
    }
  }
  auto key_at = [x](int64_t i) { return cpu::order_key(x[i]); };
  const cpu::Threshold t = cpu::select_threshold(n, k, key_at, scratch);
  cpu::emit_selected(n, t, key_at, [&](int64_t i) { out[j++] = static_cast<int32_t>(i); });
  return j;
}

}  // namespace

void topk_cpu(const TopkParams& p, const TopkOut& o) {
  at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
    // Per-thread scratch kept across calls: a fresh 128 KB+ buffer per call is an mmap and
    // page faults on every touch.
    static thread_local std::vector<uint32_t> scratch;
    static thread_local Scratch<uint32_t> keys;
    static thread_local Scratch<int32_t> pos;
    for (int64_t r = begin; r < end; ++r) {
      int32_t* out = o.out + r * o.stride;
      const int64_t lo = p.ks[r];
      const int64_t window = std::max<int64_t>(0, static_cast<int64_t>(p.ke[r]) - lo);
      if (window <= o.topk) {
        write_short_row(out, window, o);
        continue;
      }
      int64_t j = topk_row(p.logits + r * p.logits_stride + lo, window, o.topk, out, scratch, keys, pos);
      for (; j < o.width; ++j) out[j] = -1;
    }
  });
}

void indexer_topk_cpu(const IndexerParams& p, const TopkOut& o) {
  if (cpu_op_path(CpuOp::kIndexer, p.qk_dtype) == CpuPath::kBlas && indexer_topk_blas(p, o)) return;
  const Tiles kind = tiles_for(p.qk_dtype);
  std::vector<int64_t> lo, hi;
  dense_windows(p, lo, hi);
  const DenseKeys keys = dense_keys(p);
  const auto row_query = dense_query(p, kind);
  cpu::fused_topk<NoGuard>(p.s_q, kRowBlock, p.s_kv, kTile, lo.data(), hi.data(), o,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const int64_t* rlo, const int64_t* rhi,
                 auto on_scores) {
               score_rows(keys, p.qk_dtype, p.h, p.d, kind, r0, r1, rlo, rhi, c0, c1, row_query, relative(r0, on_scores));
             });
}

void indexer_topk_paged_cpu(const PagedIndexerParams& p, const TopkOut& o) {
  if (cpu_op_path(CpuOp::kIndexer, DType::kFp8E4M3) == CpuPath::kBlas && indexer_topk_paged_blas(p, o)) return;
  const Tiles kind = tiles_for(DType::kFp8E4M3);
  std::vector<int64_t> lo, hi;
  paged_windows(p, lo, hi);
  const auto row_query = paged_query(p, kind);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) max_keys = std::max<int64_t>(max_keys, p.seq_lens[b]);
  if (p.next_n <= kRowBlock) {
    // Decode / MTP verify: one row block per request; its draft rows share the request's keys.
    cpu::fused_topk<NoGuard>(p.batch * p.next_n, p.next_n, max_keys, kTile, lo.data(), hi.data(), o,
               [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const int64_t* rlo, const int64_t* rhi,
                   auto on_scores) {
                 const PagedKeys keys{p.cache, p.block_table + (r0 / p.next_n) * p.max_blocks, p.block_size, p.d};
                 score_rows(keys, DType::kFp8E4M3, p.h, p.d, kind, r0, r1, rlo, rhi, c0, c1, row_query,
                            relative(r0, on_scores));
               });
    return;
  }
  // Many rows per request (a prefill chunk scored as next_n decode rows): blocks of
  // kRowBlock rows keep each block's queries in cache while its key tiles stream past.
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t base = b * p.next_n;
    const PagedKeys keys{p.cache, p.block_table + b * p.max_blocks, p.block_size, p.d};
    const TopkOut ob{o.out + base * o.stride, o.stride, o.width, o.topk};
    auto query = [&](int64_t r, QueryRow& q) { row_query(base + r, q); };
    cpu::fused_topk<NoGuard>(p.next_n, kRowBlock, p.seq_lens[b], kTile, lo.data() + base, hi.data() + base, ob,
               [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const int64_t* rlo, const int64_t* rhi,
                   auto on_scores) {
                 score_rows(keys, DType::kFp8E4M3, p.h, p.d, kind, r0, r1, rlo, rhi, c0, c1, query, relative(r0, on_scores));
               });
  }
}

}  // namespace indexcache

namespace indexcache {
namespace {

void indexer_logits_op(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_scale,
                       const at::Tensor& weights, const at::Tensor& ks, const at::Tensor& ke, at::Tensor& out) {
  const IndexerParams p = make_indexer_params(q, k, k_scale, weights, ks, ke);
  indexer_logits_cpu(p, make_logits_out(out, p.s_q, p.s_kv, q));
}

void indexer_logits_paged_op(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t next_n,
                             at::Tensor& out) {
  const PagedIndexerParams p = make_paged_params(q, weights, cache, block_table, seq_lens, next_n);
  int64_t max_len = 0;
  for (int64_t b = 0; b < p.batch; ++b) max_len = std::max<int64_t>(max_len, p.seq_lens[b]);
  indexer_logits_paged_cpu(p, make_logits_out(out, q.size(0), max_len, q));
}

void topk_indices_op(const at::Tensor& logits, const at::Tensor& ks, const at::Tensor& ke, int64_t topk,
                     at::Tensor& out) {
  const TopkParams p = make_topk_params(logits, ks, ke);
  topk_cpu(p, make_topk_out(out, p.rows, topk, logits));
}

void indexer_topk_op(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_scale,
                     const at::Tensor& weights, const at::Tensor& ks, const at::Tensor& ke, int64_t topk,
                     at::Tensor& out) {
  const IndexerParams p = make_indexer_params(q, k, k_scale, weights, ks, ke);
  indexer_topk_cpu(p, make_topk_out(out, p.s_q, topk, q));
}

void indexer_topk_paged_op(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t next_n, int64_t topk,
                           at::Tensor& out) {
  const PagedIndexerParams p = make_paged_params(q, weights, cache, block_table, seq_lens, next_n);
  indexer_topk_paged_cpu(p, make_topk_out(out, q.size(0), topk, q));
}

}  // namespace

void register_indexer_cpu(torch::Library& m) {
  m.impl("indexer_logits", &indexer_logits_op);
  m.impl("indexer_logits_paged", &indexer_logits_paged_op);
  m.impl("topk_indices", &topk_indices_op);
  m.impl("indexer_topk", &indexer_topk_op);
  m.impl("indexer_topk_paged", &indexer_topk_paged_op);
}

}  // namespace indexcache
