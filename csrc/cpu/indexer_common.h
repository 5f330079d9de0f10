// Pieces the CPU indexer's two paths share (indexer.cpp: AVX-512 BF16 / portable kernels;
// indexer_blas.cpp: oneDNN brgemm): row windows, short-row answers and the key-split count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "indexcache/ops.h"

namespace indexcache {
namespace cpu {

constexpr int64_t kMinSplitKeys = 4096;  // a key split of the fused ops keeps at least this many keys

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
  if (row_blocks == 0 || row_blocks >= 2 * threads) return 1;  // 0: an empty batch (was a SIGFPE)
  const int64_t want = (2 * threads + row_blocks - 1) / row_blocks;
  return std::max<int64_t>(1, std::min<int64_t>(want, keys / kMinSplitKeys));
}

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

}  // namespace cpu
}  // namespace indexcache
