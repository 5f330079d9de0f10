// Pieces the CPU indexer's two paths share (indexer.cpp: AVX-512 BF16 / portable kernels;
// indexer_blas.cpp: oneDNN brgemm): e4m3 tables, key sources, row windows, short-row answers,
// the key-split count and the fused scoring + top-k driver.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "select.h"

namespace indexcache {
namespace cpu {

constexpr int64_t kMinSplitKeys = 1024;  // a key split of the fused ops keeps at least this many keys

inline void fill_neg_inf(float* row, int64_t n) { std::fill_n(row, n, -std::numeric_limits<float>::infinity()); }

// A row whose window holds <= topk keys selects all of them: 0..window-1, then -1.
inline void write_short_row(int32_t* out, int64_t window, const TopkOut& o) {
  int64_t j = 0;
  for (; j < window && j < o.topk; ++j) out[j] = static_cast<int32_t>(j);
  for (; j < o.width; ++j) out[j] = -1;
}

// Number of key splits per row block for the fused ops, so that every thread has work
// even when there are few rows (decode), while each split keeps >= kMinSplitKeys keys.
inline int64_t key_splits(int64_t row_blocks, int64_t keys) {
  const int64_t threads = at::get_num_threads();
  // 0: an empty batch (was a SIGFPE); one thread: a split would only add a merge
  if (row_blocks == 0 || threads == 1 || row_blocks >= 2 * threads) return 1;
  const int64_t want = (2 * threads + row_blocks - 1) / row_blocks;
  return std::max<int64_t>(1, std::min<int64_t>(want, keys / kMinSplitKeys));
}

// e4m3 byte -> fp32 and -> bf16 bits (exact: every e4m3 value is a bf16 value).
struct E4m3Tables {
  uint16_t bf16[256];
  float f32[256];
  E4m3Tables() {
    for (int i = 0; i < 256; ++i) {
      f32[i] = e4m3_to_float(static_cast<uint8_t>(i));
      bf16[i] = float_to_bf16(f32[i]);
    }
  }
};
inline const E4m3Tables& e4m3_tables() {
  static const E4m3Tables t;
  return t;
}

inline int64_t elem_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : (dt == DType::kBFloat16 ? 2 : 1); }

// Keys [0, s_kv) of a dense [s_kv, d] tensor.
struct DenseKeys {
  const uint8_t* base;
  int64_t row_bytes;
  const float* scale;  // nullable
  const uint8_t* row(int64_t s) const { return base + s * row_bytes; }
  float scale_of(int64_t s) const { return scale ? scale[s] : 1.0f; }
};

inline DenseKeys dense_keys(const IndexerParams& p) {
  return DenseKeys{static_cast<const uint8_t*>(p.k), p.d * elem_bytes(p.qk_dtype), p.k_scale};
}

// Request positions [0, seq_len) of one request in the paged index-K cache.
struct PagedKeys {
  const uint8_t* cache;
  const int32_t* table;  // this request's block-table row
  int64_t block_size, d;
  const uint8_t* block(int64_t s) const {
    return cache + static_cast<int64_t>(table[s / block_size]) * block_size * (d + 4);
  }
  const uint8_t* row(int64_t s) const { return block(s) + (s % block_size) * d; }
  float scale_of(int64_t s) const {
    float v;
    std::memcpy(&v, block(s) + block_size * d + (s % block_size) * 4, 4);
    return v;
  }
};

// Prefill rows: row r sees keys [ks[r], ke[r]), clamped to the keys there are.
inline void dense_windows(const IndexerParams& p, std::vector<int64_t>& lo, std::vector<int64_t>& hi) {
  lo.resize(p.s_q);
  hi.resize(p.s_q);
  for (int64_t r = 0; r < p.s_q; ++r) {
    lo[r] = std::clamp<int64_t>(p.ks[r], 0, p.s_kv);
    hi[r] = std::clamp<int64_t>(p.ke[r], lo[r], p.s_kv);
  }
}

// Decode rows: row j of request b sees positions [0, seq_len - next_n + j + 1).
inline void paged_windows(const PagedIndexerParams& p, std::vector<int64_t>& lo, std::vector<int64_t>& hi) {
  const int64_t rows = p.batch * p.next_n;
  lo.assign(rows, 0);
  hi.resize(rows);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t j = 0; j < p.next_n; ++j)
      hi[b * p.next_n + j] = std::max<int64_t>(0, p.seq_lens[b] - p.next_n + j + 1);
}

// The fused scoring + top-k driver of both paths: rows [0, rows) in blocks of row_block; each
// (block, key split) task keeps a RunningTopk per row over its key range; the splits of a row
// are merged in key order. Rows whose window fits in topk need no scoring (0..window-1).
// run_block(r0, r1, c0, c1, lo + r0, hi + r0, emit) scores rows [r0, r1) over keys [c0, c1)
// and calls emit(r - r0, s0, n, scores) per tile of n keys from s0. Split boundaries are
// multiples of `tile` keys, so no tile straddles two splits. Guard: one per worker chunk (the
// blas path releases its AMX tiles there).
template <typename Guard, typename RunBlock>
void fused_topk(int64_t rows, int64_t row_block, int64_t max_keys, int64_t tile, const int64_t* lo, const int64_t* hi,
                const TopkOut& o, RunBlock run_block) {
  std::vector<int64_t> lo_eff(lo, lo + rows), hi_eff(hi, hi + rows);
  for (int64_t r = 0; r < rows; ++r)
    if (hi[r] - lo[r] <= o.topk) lo_eff[r] = hi_eff[r] = 0;
  const int64_t blocks = (rows + row_block - 1) / row_block;
  const int64_t splits = key_splits(blocks, max_keys);
  std::vector<RunningTopk> sel(rows * splits);
  at::parallel_for(0, blocks * splits, 1, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] Guard guard;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, sp = task % splits;
      const int64_t r0 = b * row_block, r1 = std::min(rows, r0 + row_block);
      int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = 0;
      for (int64_t r = r0; r < r1; ++r) {
        sel[r * splits + sp].reset(o.topk);
        if (hi_eff[r] > lo_eff[r]) {
          lo_all = std::min(lo_all, lo_eff[r]);
          hi_all = std::max(hi_all, hi_eff[r]);
        }
      }
      if (hi_all <= lo_all) continue;
      const int64_t base = lo_all / tile * tile;
      const int64_t per = ((hi_all - base + splits - 1) / splits + tile - 1) / tile * tile;
      const int64_t c0 = base + sp * per, c1 = std::min(hi_all, c0 + per);
      if (c1 <= c0) continue;
      run_block(r0, r1, c0, c1, lo_eff.data() + r0, hi_eff.data() + r0,
                [&](int64_t r, int64_t s0, int64_t n, const float* scores) {
                  RunningTopk& rs = sel[(r0 + r) * splits + sp];
                  const int64_t a = std::max(lo_eff[r0 + r], s0), e = std::min(hi_eff[r0 + r], s0 + n);
                  for (int64_t s = a; s < e; ++s) rs.push(order_key(scores[s - s0]), static_cast<int32_t>(s));
                });
    }
  });
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t* out = o.out + r * o.stride;
      const int64_t window = std::max<int64_t>(0, hi[r] - lo[r]);
      if (window <= o.topk) {
        write_short_row(out, window, o);
        continue;
      }
      RunningTopk& first = sel[r * splits];
      for (int64_t sp = 1; sp < splits; ++sp) first.absorb(sel[r * splits + sp]);
      int64_t j = first.finish(out, static_cast<int32_t>(lo[r]));
      for (; j < o.width; ++j) out[j] = -1;
    }
  });
}

}  // namespace cpu
}  // namespace indexcache
