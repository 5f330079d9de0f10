// torch glue of the element-wise ops on CUDA; kernels in cache_impl.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "registry.h"
#include "cache_impl.cuh"
#include "torch_env.h"

namespace indexcache {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cuda_op(const at::Tensor& x, double eps, bool hadamard) {
  auto [values, scales] = make_quant_outputs(x);
  const QuantParams p = make_quant_params(x, values, scales, eps, hadamard);
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> keep;
  quantize_fp8_cuda(p, torch_env(keep));
  return {values, scales};
}

void index_k_cache_insert_cuda_op(const at::Tensor& k, const at::Tensor& slot_mapping, at::Tensor& cache,
                                  bool hadamard) {
  const IndexKInsertParams p = make_index_k_insert_params(k, slot_mapping, cache, hadamard);
  // INDEXCACHE_CHECK=1: the CPU op's check on a host copy (syncs); else the kernel skips
  // out-of-range slots and counts them in the error word.
  if (cuda_host_checks()) check_slots_in_range(slot_mapping, p.num_blocks * p.block_size, "slot_mapping");
  const c10::cuda::CUDAGuard guard(cache.device());
  std::vector<at::Tensor> keep;
  index_k_insert_cuda(p, torch_env(keep));
}

void mla_kv_cache_insert_cuda_op(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& slot_mapping,
                                 at::Tensor& cache) {
  const MlaInsertParams p = make_mla_insert_params(kv_c, k_pe, slot_mapping, cache);
  if (cuda_host_checks()) check_slots_in_range(slot_mapping, p.num_slots, "slot_mapping");  // else on the device
  const c10::cuda::CUDAGuard guard(cache.device());
  std::vector<at::Tensor> keep;
  mla_insert_cuda(p, torch_env(keep));
}

void positions_to_slots_cuda_op(const at::Tensor& positions, const at::Tensor& req_of_row,
                                const at::Tensor& block_table, int64_t block_size, int64_t num_blocks,
                                at::Tensor& slots) {
  const SlotParams p = make_slot_params(positions, req_of_row, block_table, block_size, num_blocks, slots);
  if (cuda_host_checks()) {
    // The CPU op's validation on host copies (syncs): requests, positions, block ids.
    const at::Tensor pos_h = positions.cpu(), req_h = req_of_row.cpu(), table_h = block_table.cpu();
    SlotParams hp = p;
    hp.positions = pos_h.data_ptr<int32_t>();
    hp.req_of_row = req_h.data_ptr<int32_t>();
    hp.block_table = table_h.data_ptr<int32_t>();
    hp.slots = nullptr;
    check_positions_cpu(hp);
  }  // else: invalid entries become -1 on the device and are counted in the error word
  const c10::cuda::CUDAGuard guard(positions.device());
  std::vector<at::Tensor> keep;
  positions_to_slots_cuda(p, torch_env(keep));
}

}  // namespace
}  // namespace cuda

void register_cache_ops_cuda(torch::Library& m) {
  m.impl("quantize_fp8", &cuda::quantize_fp8_cuda_op);
  m.impl("index_k_cache_insert", &cuda::index_k_cache_insert_cuda_op);
  m.impl("mla_kv_cache_insert", &cuda::mla_kv_cache_insert_cuda_op);
  m.impl("positions_to_slots", &cuda::positions_to_slots_cuda_op);
}

}  // namespace indexcache
