// Host-side set-up shared by the CPU sparse MLA kernels (avx2.cpp, sparse_mla_avx512.cpp): each
// row's valid key slots and how many ways a row's keys split. Torch-free; included before the
// kernels' target pragmas, so it compiles for the baseline ISA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "indexcache/fp8.h"
#include "indexcache/ops.h"

namespace indexcache {

constexpr int64_t kMlaSplitKeys = 256;  // a split of a row's keys has at least this many entries
constexpr int64_t kMlaFewTasks = 32;    // fewer (row, head block) tasks than this: split the keys

// Row t's valid slots (its indices, then its extra_indices; -1s dropped) at
// slots[t * entries ..], count[t] of them. Serial: a parallel region of its own costs more than
// this scan (a whole scheduler quantum on a loaded machine).
struct MlaSlots {
  int64_t entries;              // topk + n_extra
  std::vector<int32_t> slots;   // [s_q, entries]
  std::vector<int64_t> count;   // [s_q]

  explicit MlaSlots(const SparseMlaParams& p)
      : entries(p.topk + p.n_extra), slots(p.s_q * entries), count(p.s_q) {
    for (int64_t t = 0; t < p.s_q; ++t) {
      int64_t c = 0;
      for (int64_t j = 0; j < entries; ++j) {
        const int32_t v = mla_entry(p, t, j);
        slots[t * entries + c] = v;
        c += v >= 0;
      }
      count[t] = c;
    }
  }
  const int32_t* row(int64_t t) const { return slots.data() + t * entries; }
};

// Asks for cache rows slots[0:n) ahead of their use (every 64-byte line of each row, into L2: a
// tile of 48 fp32 rows is 110 KB, more than L1): a row's selected keys are scattered over the
// cache, so without this each row's first lines wait a full miss when its tile is gathered.
inline void mla_prefetch_rows(const SparseMlaParams& p, const int32_t* slots, int64_t n) {
  const int64_t bytes = p.kv_dtype == DType::kFp8E4M3 ? kMlaFp8Bytes
                        : p.kv_dtype == DType::kBFloat16 ? 2 * p.d_qk
                                                         : 4 * p.d_qk;
  for (int64_t j = 0; j < n; ++j) {
    const char* row = static_cast<const char*>(p.kv) + static_cast<int64_t>(slots[j]) * bytes;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// Ways each row's keys split: more than one only when there are few (row, head block) tasks
// (decode), so that threads have work. The count depends on the shape only, never on the thread
// count, so results are the same on any number of threads.
inline int64_t mla_key_splits(const SparseMlaParams& p, int64_t head_blocks) {
  if (p.s_q * head_blocks >= kMlaFewTasks) return 1;
  return std::max<int64_t>(1, (p.topk + p.n_extra) / kMlaSplitKeys);
}

// Multiply-adds of a call (q·k over d_qk and p·v over d_v for every entry of every row and head):
// below the bound of the kernel that runs it (sparse_mla.cpp, mla_serial_work; all of them set by
// INDEXCACHE_SPARSE_MLA_SERIAL_WORK, serial_work.h) the call runs on the calling thread. A decode
// row of 4 heads over 512 keys is 2.2M, of 16 heads 9.4M, of 64 heads 38M.
inline int64_t mla_work(const SparseMlaParams& p) { return p.s_q * p.h_q * (p.topk + p.n_extra) * (p.d_qk + p.d_v); }
// The kernels whose serial bounds differ: AVX-512 vectors (portable's loops too), AVX2 vectors, AMX tiles.
enum class MlaKernel { kVector, kAvx2, kTiles };
int64_t mla_serial_work(MlaKernel kernel);  // sparse_mla.cpp
inline bool mla_runs_inline(const SparseMlaParams& p, MlaKernel kernel) { return mla_work(p) < mla_serial_work(kernel); }

}  // namespace indexcache
