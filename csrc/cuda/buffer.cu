#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "registry.h"
#include "indexcache/buffer.h"
#include "torch_env.h"

namespace indexcache {
namespace {

// One thread per 4 ints: rows are int32 and usually 16-byte aligned (width % 4 == 0).
__global__ void fill_topk_buffer_kernel(FillParams p) {
  const bool vec = (p.width % 4 == 0) && (p.row_stride % 4 == 0) &&
                   (reinterpret_cast<uintptr_t>(p.buf) % 16 == 0);
  for (int64_t row = blockIdx.y; row < p.num_rows; row += gridDim.y) {
    int32_t* dst = p.buf + row * p.row_stride;
    if (vec) {
      int4* d4 = reinterpret_cast<int4*>(dst);
      for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.width / 4; i += gridDim.x * blockDim.x)
        d4[i] = make_int4(-1, -1, -1, -1);
    } else {
      for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.width; i += gridDim.x * blockDim.x)
        dst[i] = -1;
    }
  }
}

void fill_topk_buffer_cuda_op(at::Tensor& buf, int64_t num_rows) {
  const FillParams p = make_fill_params(buf, num_rows);
  const c10::cuda::CUDAGuard guard(buf.device());
  fill_topk_buffer_cuda(p, at::cuda::getCurrentCUDAStream().stream());
}

// The error word of `like`'s device itself (int32 [1]): reading it (.item()) is the one
// explicit sync; zero_() resets it.
at::Tensor cuda_error_word_op(const at::Tensor& like) {
  TORCH_CHECK(like.is_cuda(), "cuda_error_word needs a CUDA tensor, got ", like.device());
  return cuda::device_error_word(like.device().index());
}

}  // namespace

void fill_topk_buffer_cuda(const FillParams& p, void* stream) {
  if (p.num_rows == 0 || p.width == 0) return;
  const int threads = 128;
  const int64_t per_row = (p.width + 3) / 4;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((per_row + threads - 1) / threads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(p.num_rows, 65535)));
  fill_topk_buffer_kernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void register_buffer_cuda(torch::Library& m) {
  m.impl("fill_topk_buffer_", &fill_topk_buffer_cuda_op);
  m.impl("cuda_error_word", &cuda_error_word_op);
}

}  // namespace indexcache
