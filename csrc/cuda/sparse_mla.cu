// torch glue of sparse_mla on CUDA; kernels in sparse_mla_impl.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "registry.h"
#include "sparse_mla_impl.cuh"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

void sparse_mla_cuda_op(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices, double sm_scale,
                        int64_t d_v, at::Tensor& out, at::Tensor& lse, const std::optional<at::Tensor>& sinks,
                        const std::optional<at::Tensor>& extra_indices) {
  const SparseMlaParams p = make_sparse_mla_params(q, kv_cache, indices, sm_scale, d_v, out, lse, sinks, extra_indices);
  // INDEXCACHE_CHECK=1: host copy (syncs), as on the CPU; else the kernel drops
  // out-of-range indices like -1 and counts them in the error word.
  if (cuda_host_checks()) {
    check_slots_in_range(indices, p.num_slots, "indices");
    if (extra_indices.has_value()) check_slots_in_range(*extra_indices, p.num_slots, "extra_indices");
  }
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  sparse_mla_cuda(p, torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_sparse_mla_cuda(torch::Library& m) {
  m.impl("sparse_mla", &cuda::sparse_mla_cuda_op);
}

}  // namespace indexcache
