// torch glue of the indexer ops on CUDA; kernels in indexer_impl.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "registry.h"
#include "indexer_impl.cuh"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

// INDEXCACHE_CHECK=1: the longest sequence from a host copy of seq_lens (syncs; the CPU op
// reads it the same way). Default: no copy; the bound is what the block table can hold,
// and the kernels make a longer (or otherwise invalid) request empty, counted.
int64_t max_seq_len(const at::Tensor& seq_lens, const PagedIndexerParams& p, bool host) {
  if (!host) return p.max_blocks * p.block_size;
  if (seq_lens.numel() == 0) return 0;
  return std::max<int64_t>(0, seq_lens.max().item<int64_t>());
}

void indexer_logits_cuda_op(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_scale,
                            const at::Tensor& weights, const at::Tensor& ks, const at::Tensor& ke, at::Tensor& out) {
  const IndexerParams p = make_indexer_params(q, k, k_scale, weights, ks, ke, cuda_host_checks());
  const LogitsOut o = make_logits_out(out, p.s_q, p.s_kv, q);
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  indexer_logits_cuda(p, o, torch_env(keep));
}

void indexer_logits_paged_cuda_op(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t next_n,
                                  at::Tensor& out) {
  const bool host = cuda_host_checks();
  const PagedIndexerParams p = make_paged_params(q, weights, cache, block_table, seq_lens, next_n, host);
  // Default: a request longer than the output is empty (counted), not an error.
  const int64_t width = out.dim() == 2 ? out.size(1) : 0;
  const int64_t max_len = host ? max_seq_len(seq_lens, p, true) : std::min(width, p.max_blocks * p.block_size);
  const LogitsOut o = make_logits_out(out, q.size(0), host ? max_len : 0, q);
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  indexer_logits_paged_cuda(p, max_len, o, torch_env(keep));
}

void indexer_topk_cuda_op(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_scale,
                          const at::Tensor& weights, const at::Tensor& ks, const at::Tensor& ke, int64_t topk,
                          at::Tensor& out) {
  const IndexerParams p = make_indexer_params(q, k, k_scale, weights, ks, ke, cuda_host_checks());
  const TopkOut o = make_topk_out(out, p.s_q, topk, q);
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  indexer_topk_cuda(p, o, torch_env(keep));
}

void indexer_topk_paged_cuda_op(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t next_n,
                                int64_t topk, at::Tensor& out) {
  const bool host = cuda_host_checks();
  const PagedIndexerParams p = make_paged_params(q, weights, cache, block_table, seq_lens, next_n, host);
  const TopkOut o = make_topk_out(out, q.size(0), topk, q);
  const int64_t max_len = max_seq_len(seq_lens, p, host);
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  indexer_topk_paged_cuda(p, max_len, o, torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_indexer_cuda(torch::Library& m) {
  m.impl("indexer_logits", &cuda::indexer_logits_cuda_op);
  m.impl("indexer_logits_paged", &cuda::indexer_logits_paged_cuda_op);
  m.impl("indexer_topk", &cuda::indexer_topk_cuda_op);
  m.impl("indexer_topk_paged", &cuda::indexer_topk_paged_cuda_op);
}

}  // namespace indexcache
