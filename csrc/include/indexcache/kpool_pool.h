// GLM-5.3-Flash's pooled indexer (models/blocks/kpool_indexer.py): the key pools that complete in a
// paged step, from the cache's per-token k | gate rows into its pooled-key rows, one call for the
// batch. Torch-free: raw pointers and shapes.
//
// Request b held ctx_lens[b] tokens and adds q_lens[b]; its pools j with
// ctx_lens[b] / P <= j < (ctx_lens[b] + q_lens[b]) / P complete now. Token t of request b is row
// t % block_size of block block_table[b, t / block_size] of raw ([k (d) | gate (d)]); pool j
// (tokens [j P, (j + 1) P), all in one block since P divides block_size) is, per channel c,
//
//   pool[c] = sum_t e_t k_t[c] / sum_t e_t,  e_t = exp(l_t - max_t l_t),  l_t = gate_t[c] + ape[t mod P, c]
//
// (a channel with a NaN logit or a +inf one is NaN, as torch's softmax makes it; a NaN key gives
// NaN) in fp32 with t ascending, rounded once into row (j P % block_size) / P of block
// block_table[b, j P / block_size] of pool. No other pool row is touched. Each pool is one task's
// fixed-order sums, so the result does not depend on the thread count.
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

struct KpoolPoolParams {
  const void* raw;             // [num_blocks, block_size, 2 d] raw_dtype, contiguous: each token's k | gate
  void* pool;                  // [num_blocks, block_size / P, d] pool_dtype, contiguous: pooled keys
  const void* ape;             // [P, d] ape_dtype, contiguous: the pool's position bias on the gate
  const int32_t* block_table;  // [B, max_blocks], contiguous; entries of completing pools in [0, num_blocks)
  const int32_t* ctx_lens;     // [B] tokens already in the cache (>= 0)
  const int32_t* q_lens;       // [B] tokens this step adds (>= 0)
  int64_t B, max_blocks, num_blocks, block_size, P, d;
  DType raw_dtype, pool_dtype, ape_dtype;  // each fp32 or bf16
};

// Checks the lengths and the completing pools' block ids (a c10::Error naming the first
// bad one), then pools; a no-op when no pool completes.
void kpool_pool_cpu(const KpoolPoolParams& p);

}  // namespace indexcache
