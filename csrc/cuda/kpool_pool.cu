// torch glue of kpool_pool_paged on CUDA; the kernel is in kpool_pool_impl.cuh, the argument checks
// shared with the CPU op in ../kpool_pool_checks.h (the same inputs rejected with the same messages;
// the lengths and block ids only with INDEXCACHE_CHECK=1, else the kernel skips and counts them).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "../kpool_pool_checks.h"
#include "kpool_pool_impl.cuh"
#include "registry.h"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

void kpool_pool_paged_cuda_op(const at::Tensor& index_raw, at::Tensor& index_pool, const at::Tensor& ape,
                              const at::Tensor& block_table, const at::Tensor& ctx_lens, const at::Tensor& q_lens) {
  const KpoolPoolParams p =
      kpool_checks::make_kpool_pool_params(index_raw, index_pool, ape, block_table, ctx_lens, q_lens);
  const c10::cuda::CUDAGuard guard(index_raw.device());
  if (cuda_host_checks()) {
    const at::Tensor table = block_table.cpu(), ctx = ctx_lens.cpu(), q = q_lens.cpu();
    KpoolPoolParams host = p;
    host.block_table = table.data_ptr<int32_t>();
    host.ctx_lens = ctx.data_ptr<int32_t>();
    host.q_lens = q.data_ptr<int32_t>();
    kpool_checks::check_kpool_values(host);
  }
  std::vector<at::Tensor> keep;
  kpool_pool_cuda(p, torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_kpool_pool_cuda(torch::Library& m) { m.impl("kpool_pool_paged", &cuda::kpool_pool_paged_cuda_op); }

}  // namespace indexcache
