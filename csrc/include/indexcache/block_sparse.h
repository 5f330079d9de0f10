// MiniMax-M3's block-sparse ops (DESIGN.md §5, §6): the indexer's block scoring + block top-k
// and block-sparse GQA attention over a paged KV cache. Torch-free: raw pointers, shapes only;
// python/indexcache/reference.py (the MiniMax-M3 section) is the formal definition.
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

// Block scoring + block top-k. Prefill: keys k [s_kv, d], row t's request keys k[ks[t]:ke[t]),
// its query at request position ke[t] - ks[t] - 1. Paged decode (ks == nullptr): keys in a paged
// cache through block_table; row j of request b sees seq_lens[b] - next_n + j + 1 keys.
struct BlockTopkParams {
  const void* q;               // [s_q, h, d] qk_dtype, contiguous
  const void* k;               // prefill: [s_kv, d]; paged: [num_pages, page_size, d]; qk_dtype, contiguous
  const int32_t* ks;           // [s_q] window start (prefill), nullptr for paged decode
  const int32_t* ke;           // [s_q] window end (prefill), nullptr for paged decode
  const int32_t* block_table;  // [batch, max_pages] (paged), row stride max_pages
  const int32_t* seq_lens;     // [batch] keys in the cache per request (paged)
  int32_t* out;                // [s_q, h, topk_blocks] request-relative block ids ascending, then -1
  int64_t s_q;
  int64_t h;                   // indexer heads
  int64_t d;                   // head dim
  int64_t s_kv;                // prefill keys
  int64_t num_pages;           // paged
  int64_t page_size;           // paged
  int64_t batch;               // paged
  int64_t max_pages;           // paged
  int64_t next_n;              // paged: query rows per request
  int64_t block_size;          // keys per index block
  int64_t topk_blocks;
  int64_t local_blocks;        // blocks ending at the query's block that are always kept
  DType qk_dtype;              // kFloat32 or kBFloat16
};

// Block-sparse GQA attention: query head hq reads KV head hq / (h_q / h_kv) at the keys of the
// row's selected blocks for that KV head that are <= pos[t] (duplicates count once).
struct BlockSparseAttnParams {
  const void* q;               // [s_q, h_q, d] dtype, contiguous
  const void* k_cache;         // [num_pages, page_size, h_kv, d] dtype, contiguous
  const void* v_cache;         // [num_pages, page_size, h_kv, d] dtype, contiguous
  const int32_t* block_table;  // [batch, max_pages]
  const int32_t* req;          // [s_q] request of each row
  const int32_t* pos;          // [s_q] request position of each row (keys [0, pos] causal)
  const int32_t* blocks;       // [s_q, h_kv, topk] selected block ids, -1 = none
  void* out;                   // [s_q, h_q, d] dtype
  float* lse;                  // [s_q, h_q] natural-log softmax denominator, -inf for no key
  int64_t s_q;
  int64_t h_q;
  int64_t h_kv;
  int64_t d;
  int64_t topk;
  int64_t num_pages;
  int64_t page_size;
  int64_t batch;
  int64_t max_pages;
  int64_t block_size;          // keys per index block
  float scale;                 // softmax scale on q·k
  DType dtype;                 // kFloat32 or kBFloat16
};

// The CPU kernels (csrc/cpu/block_sparse.cpp): vectorised per ISA path, parallel, deterministic.
void block_topk_cpu(const BlockTopkParams& p);
void block_sparse_attention_cpu(const BlockSparseAttnParams& p);

}  // namespace indexcache
