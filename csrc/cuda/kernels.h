// Host entry points shared between the CUDA translation units. Torch-free.
#pragma once

#ifndef IC_CUDA_EMULATION
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <functional>

#include "indexcache/ops.h"

namespace indexcache {
namespace cuda {

// What the launch code needs from the device and the framework.
struct DeviceEnv {
  int sms = 1;              // multiprocessors
  int smem_optin = 48 << 10;  // max dynamic shared memory per block
  cudaStream_t stream = nullptr;
  // The device's int32 error word: kernels atomically add the number of out-of-range
  // index entries, slots, positions, block ids, windows and sequence lengths they met
  // (each treated as invalid: -1 or an empty window). nullptr: not counted.
  int32_t* err = nullptr;
  // Device scratch that stays valid until the op returns (stream-ordered reuse after).
  std::function<void*(int64_t bytes)> alloc;
};

// How many keys each row may select from: dense rows [ks, ke); paged row j of request b
// sees max(0, seq_len[b] - next_n + j + 1) keys (positions from 0).
struct WindowSrc {
  const int32_t* ks = nullptr;        // dense: [rows]
  const int32_t* ke = nullptr;
  const int32_t* seq_lens = nullptr;  // paged: [batch]
  int64_t next_n = 1;
};

// Candidate scratch: for each local row, `segments` runs of up to `cap` (key, position)
// pairs in ascending position order, segment after segment; cnt [rows, segments].
struct CandidateSet {
  const uint32_t* keys;
  const int32_t* pos;   // window-relative positions
  const int32_t* cnt;
  int segments;
  int cap;
};

// Exact top-k of the union of each row's candidates into o (rows [row_begin, row_begin+rows)):
// positions ascending, then -1. Rows whose window is <= topk get 0..window-1 directly.
void launch_merge(const CandidateSet& c, const WindowSrc& w, int64_t row_begin, int64_t rows, const TopkOut& o,
                  const DeviceEnv& env);

// Windows as the kernels read them: row r's [ks, ke) if 0 <= ks <= ke <= s_kv, else the
// empty [0, 0) and one count in env.err. Writes int32 [rows] lo, hi (device scratch).
void sanitize_windows_cuda(const int32_t* ks, const int32_t* ke, int64_t rows, int64_t s_kv, int32_t* lo, int32_t* hi,
                           const DeviceEnv& env);

// topk_indices on device pointers (allocates its own scratch on the current device).
// max_window: the logits width; windows outside [0, max_window] are empty and counted
// (sanitize_windows_cuda).
void topk_cuda(const TopkParams& p, const TopkOut& o, int64_t max_window, const DeviceEnv& env);
// The same on windows that are already valid (max_window bounds every ke - ks; it only
// steers the launch shape).
void topk_launch(const TopkParams& p, const TopkOut& o, int64_t max_window, const DeviceEnv& env);

// The other ops' launchers (csrc/cuda/*_impl.cuh); pointers are device pointers.
void quantize_fp8_cuda(const QuantParams& p, const DeviceEnv& env);
void index_k_insert_cuda(const IndexKInsertParams& p, const DeviceEnv& env);
void mla_insert_cuda(const MlaInsertParams& p, const DeviceEnv& env);
void positions_to_slots_cuda(const SlotParams& p, const DeviceEnv& env);
void indexer_logits_cuda(const IndexerParams& p, const LogitsOut& o, const DeviceEnv& env);
// max_len: an upper bound on the keys a request may have (the caller's choice: the longest
// seq_len read on the host, or max_blocks * block_size, capped by the logits width). A
// seq_len < 0, above max_len or above max_blocks * block_size, or whose blocks are not all
// in [0, num_blocks), makes its request empty (no keys) and counts once in env.err.
void indexer_logits_paged_cuda(const PagedIndexerParams& p, int64_t max_len, const LogitsOut& o, const DeviceEnv& env);
void indexer_topk_cuda(const IndexerParams& p, const TopkOut& o, const DeviceEnv& env);
void indexer_topk_paged_cuda(const PagedIndexerParams& p, int64_t max_len, const TopkOut& o, const DeviceEnv& env);
void sparse_mla_cuda(const SparseMlaParams& p, const DeviceEnv& env);

}  // namespace cuda
}  // namespace indexcache
