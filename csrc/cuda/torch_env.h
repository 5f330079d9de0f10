// The DeviceEnv of the current CUDA device and stream, for the op glue in csrc/cuda/*.cu.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <vector>

#include "kernels.h"

namespace indexcache {
namespace cuda {

// The device's error word (DeviceEnv::err): int32 [1], zero at creation, created on first
// use and kept for the process (never freed, so no teardown order issue). It must exist
// before a CUDA graph capture (any op call or cuda_error_word does it): allocating it
// inside a capture would put it in the graph's private pool.
inline at::Tensor device_error_word(c10::DeviceIndex device) {
  static std::mutex mu;
  static auto* words = new std::vector<at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= words->size()) words->resize(device + 1);
  at::Tensor& w = (*words)[device];
  if (!w.defined()) {
    const c10::cuda::CUDAGuard guard(device);
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
                "indexcache: the error word of cuda:", static_cast<int>(device),
                " does not exist yet and cannot be allocated during a CUDA graph capture; call an indexcache op or "
                "indexcache.ops.cuda_error_count() on this device once before capturing");
    w = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
  }
  return w;
}

// Scratch comes from the caching allocator and is held in `keep` until the op returns;
// the allocator orders any later reuse after this stream's work.
inline DeviceEnv torch_env(std::vector<at::Tensor>& keep) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  DeviceEnv env;
  env.sms = prop->multiProcessorCount;
  env.smem_optin = static_cast<int>(prop->sharedMemPerBlockOptin);
  env.stream = at::cuda::getCurrentCUDAStream().stream();
  env.err = device_error_word(c10::cuda::current_device()).data_ptr<int32_t>();
  const auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::cuda::current_device());
  env.alloc = [&keep, opts](int64_t bytes) -> void* {
    keep.push_back(at::empty({std::max<int64_t>(bytes, 1)}, opts));
    return keep.back().data_ptr();
  };
  return env;
}

}  // namespace cuda
}  // namespace indexcache
