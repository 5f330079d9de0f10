// torch glue of topk_indices on CUDA; kernels in topk_impl.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "registry.h"
#include "topk_impl.cuh"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

void topk_indices_cuda_op(const at::Tensor& logits, const at::Tensor& ks, const at::Tensor& ke, int64_t topk,
                          at::Tensor& out) {
  // INDEXCACHE_CHECK=1: windows checked on a host copy (syncs); else on the device.
  const TopkParams p = make_topk_params(logits, ks, ke, cuda_host_checks());
  const TopkOut o = make_topk_out(out, p.rows, topk, logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  std::vector<at::Tensor> keep;
  topk_cuda(p, o, logits.size(1), torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_topk_cuda(torch::Library& m) {
  m.impl("topk_indices", &cuda::topk_indices_cuda_op);
}

}  // namespace indexcache
