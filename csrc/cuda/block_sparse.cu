// torch glue of MiniMax-M3's block-sparse ops on CUDA; kernels in block_sparse_impl.cuh, argument
// checks shared with the CPU ops in ../block_sparse_checks.h (the same inputs rejected with the
// same messages; index values only with INDEXCACHE_CHECK=1, else the kernels count them).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../block_sparse_checks.h"
#include "../checks.h"
#include "block_sparse_impl.cuh"
#include "registry.h"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

void block_topk_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ks, const at::Tensor& ke,
                        int64_t block_size, int64_t local_blocks, at::Tensor& out) {
  const BlockTopkParams p =
      block_sparse_checks::make_block_topk_params(q, k, ks, ke, block_size, local_blocks, out, cuda_host_checks());
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  block_topk_cuda(p, torch_env(keep));
}

void block_topk_paged_cuda_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_table,
                              const at::Tensor& seq_lens, int64_t next_n, int64_t block_size, int64_t local_blocks,
                              at::Tensor& out) {
  const BlockTopkParams p = block_sparse_checks::make_block_topk_paged_params(
      q, k_cache, block_table, seq_lens, next_n, block_size, local_blocks, out, cuda_host_checks());
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  block_topk_cuda(p, torch_env(keep));
}

void block_sparse_attention_cuda_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& block_table, const at::Tensor& req, const at::Tensor& pos,
                                    const at::Tensor& blocks, int64_t block_size, double scale, at::Tensor& out,
                                    at::Tensor& lse) {
  const BlockSparseAttnParams p = block_sparse_checks::make_block_sparse_attn_params(
      q, k_cache, v_cache, block_table, req, pos, blocks, block_size, scale, out, lse, cuda_host_checks());
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  block_sparse_attention_cuda(p, torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_block_sparse_cuda(torch::Library& m) {
  m.impl("block_topk", &cuda::block_topk_cuda_op);
  m.impl("block_topk_paged", &cuda::block_topk_paged_cuda_op);
  m.impl("block_sparse_attention", &cuda::block_sparse_attention_cuda_op);
}

}  // namespace indexcache
