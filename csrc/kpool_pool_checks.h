// Argument checks and the params-struct builder of kpool_pool_paged, shared by the CPU op
// (csrc/cpu/kpool_pool.cpp) and the CUDA one (csrc/cuda/kpool_pool.cu), so both devices reject the
// same inputs with the same messages. check_kpool_values reads the lengths and block ids (host
// pointers): the CPU always; CUDA only with INDEXCACHE_CHECK=1, else its kernel skips a request
// with bad lengths or a pool whose block id is out of range and counts it in the error word.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

#include "checks.h"
#include "indexcache/kpool_pool.h"

namespace indexcache {
namespace kpool_checks {

inline KpoolPoolParams make_kpool_pool_params(const at::Tensor& index_raw, at::Tensor& index_pool, const at::Tensor& ape,
                                              const at::Tensor& block_table, const at::Tensor& ctx_lens,
                                              const at::Tensor& q_lens) {
  IC_CHECK_DIM(ape, 2, "ape");
  IC_CHECK_DIM(index_raw, 3, "index_raw");
  IC_CHECK_DIM(index_pool, 3, "index_pool");
  IC_CHECK_DIM(block_table, 2, "block_table");
  IC_CHECK_DIM(ctx_lens, 1, "ctx_lens");
  IC_CHECK_DIM(q_lens, 1, "q_lens");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&index_raw, "index_raw"}, {&index_pool, "index_pool"},
                                {&ape, "ape"}, {&block_table, "block_table"}, {&ctx_lens, "ctx_lens"}, {&q_lens, "q_lens"}}) {
    TORCH_CHECK(t->device() == index_raw.device(), name, " must be on index_raw's device ", index_raw.device(),
                ", got ", t->device());
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous, got strides ", t->strides());
  }
  IC_CHECK_DTYPE(block_table, at::kInt, "block_table");
  IC_CHECK_DTYPE(ctx_lens, at::kInt, "ctx_lens");
  IC_CHECK_DTYPE(q_lens, at::kInt, "q_lens");
  KpoolPoolParams p{};
  p.raw_dtype = float_dtype(index_raw, "index_raw");
  p.pool_dtype = float_dtype(index_pool, "index_pool");
  p.ape_dtype = float_dtype(ape, "ape");
  p.P = ape.size(0);
  p.d = ape.size(1);
  p.num_blocks = index_raw.size(0);
  p.block_size = index_raw.size(1);
  TORCH_CHECK(p.P >= 1, "ape must be [P, d] with P >= 1, got ", ape.sizes());
  TORCH_CHECK(index_raw.size(2) == 2 * p.d, "index_raw must be [num_blocks, block_size, 2 d = ", 2 * p.d, "], got ",
              index_raw.sizes());
  TORCH_CHECK(p.block_size % p.P == 0, "the pool size P = ", p.P, " must divide the block size ", p.block_size);
  TORCH_CHECK(index_pool.size(0) == p.num_blocks && index_pool.size(1) == p.block_size / p.P && index_pool.size(2) == p.d,
              "index_pool must be [num_blocks, block_size / P, d] = [", p.num_blocks, ", ", p.block_size / p.P, ", ", p.d,
              "], got ", index_pool.sizes());
  p.B = block_table.size(0);
  p.max_blocks = block_table.size(1);
  TORCH_CHECK(ctx_lens.size(0) == p.B && q_lens.size(0) == p.B, "ctx_lens and q_lens must be [B = ", p.B, "], got ",
              ctx_lens.sizes(), " and ", q_lens.sizes());
  p.raw = index_raw.data_ptr();
  p.pool = index_pool.data_ptr();
  p.ape = ape.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.ctx_lens = ctx_lens.data_ptr<int32_t>();
  p.q_lens = q_lens.data_ptr<int32_t>();
  return p;
}

// The lengths (>= 0, inside the table) and the block ids of the completing pools; p's
// block_table, ctx_lens and q_lens must be host pointers.
inline void check_kpool_values(const KpoolPoolParams& p) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t ctx = p.ctx_lens[b], q = p.q_lens[b];
    TORCH_CHECK(ctx >= 0 && q >= 0, "ctx_lens and q_lens must be >= 0, got ", ctx, " and ", q, " for request ", b);
    const int64_t done = ctx / p.P, total = (ctx + q) / p.P;
    TORCH_CHECK(total <= done || total * p.P <= p.max_blocks * p.block_size, "block_table's ", p.max_blocks,
                " blocks of ", p.block_size, " do not hold request ", b, "'s ", total * p.P, " positions");
    for (int64_t j = done; j < total; ++j) {
      const int64_t blk = p.block_table[b * p.max_blocks + j * p.P / p.block_size];
      TORCH_CHECK(blk >= 0 && blk < p.num_blocks, "block_table holds a block outside [0, ", p.num_blocks,
                  ") where a completed pool lies (request ", b, ", block ", blk, ")");
    }
  }
}

}  // namespace kpool_checks
}  // namespace indexcache
