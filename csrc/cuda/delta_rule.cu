// torch glue of the delta-rule op on CUDA; the kernel is in delta_rule_impl.cuh, the argument
// checks shared with the CPU op in ../delta_rule_checks.h (the same inputs rejected with the
// same messages; cu_seqlens and state_indices values only with INDEXCACHE_CHECK=1, else the
// kernel skips and counts an invalid sequence).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "../delta_rule_checks.h"
#include "delta_rule_impl.cuh"
#include "registry.h"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

void delta_rule_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, at::Tensor& state, const at::Tensor& cu_seqlens,
                        const at::Tensor& state_indices, double scale, at::Tensor& out) {
  const DeltaRuleParams p = delta_rule_checks::make_delta_rule_params(q, k, v, g, beta, state, cu_seqlens,
                                                                      state_indices, scale, out, cuda_host_checks());
  const c10::cuda::CUDAGuard guard(q.device());
  std::vector<at::Tensor> keep;
  delta_rule_cuda(p, torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_delta_rule_cuda(torch::Library& m) { m.impl("delta_rule", &cuda::delta_rule_cuda_op); }

}  // namespace indexcache
