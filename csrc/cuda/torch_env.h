// The DeviceEnv of the current CUDA device and stream, for the op glue in csrc/cuda/*.cu.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "kernels.h"

namespace indexcache {
namespace cuda {

// Scratch comes from the caching allocator and is held in `keep` until the op returns;
// the allocator orders any later reuse after this stream's work.
inline DeviceEnv torch_env(std::vector<at::Tensor>& keep) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  DeviceEnv env;
  env.sms = prop->multiProcessorCount;
  env.smem_optin = static_cast<int>(prop->sharedMemPerBlockOptin);
  env.stream = at::cuda::getCurrentCUDAStream().stream();
  const auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::cuda::current_device());
  env.alloc = [&keep, opts](int64_t bytes) -> void* {
    keep.push_back(at::empty({std::max<int64_t>(bytes, 1)}, opts));
    return keep.back().data_ptr();
  };
  return env;
}

}  // namespace cuda
}  // namespace indexcache
