// Row-wise RMSNorm and rotary embedding: the small ops of a decode step (four norms and four
// rotations a DSA layer), each one pass over its rows instead of a dozen torch ops with fp32
// temporaries. Torch-free: raw pointers, shapes and strides. fp32 arithmetic throughout, one
// rounding to the output's dtype; every row is summed in a fixed order (16 lanes over the row,
// then a fixed tree), so results never depend on the thread count or on the ISA path.
//
//   rms_norm: out[n, d] = x[n, d] * (1 / sqrt(sum_d x[n, d]^2 / D + eps)) * w[d]
//   rope:     pairs (a, b) of each head of x rotated by the row's angle: (a c - b s, b c + a s),
//             c = cos[n, i], s = sin[n, i], each as fma(a, c, -(b s)) / fma(b, c, a s): b s and
//             a s rounded, then one fused multiply-add; interleaved pairs (x[2i], x[2i + 1]) or
//             NeoX split-half pairs (x[i], x[i + R/2])
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

struct RmsNormParams {
  const void* x;       // [N, D] x_dtype, rows x_sn apart, last dim contiguous
  const void* w;       // [D] w_dtype, contiguous
  void* out;           // [N, D] out_dtype, rows o_sn apart, last dim contiguous
  int64_t N, D;
  int64_t x_sn, o_sn;  // element strides of x and out over n
  float eps;
  DType x_dtype, w_dtype, out_dtype;  // each fp32 or bf16
};

struct RopeParams {
  const void* x;       // [N, H, R] x_dtype, strides (x_sn, x_sh, 1); R even
  const float* cos;    // [N, R / 2] fp32, contiguous
  const float* sin;    // [N, R / 2] fp32, contiguous
  void* out;           // [N, H, R] out_dtype, strides (o_sn, o_sh, 1); may be x itself (same strides)
  int64_t N, H, R;
  int64_t x_sn, x_sh, o_sn, o_sh;
  bool interleaved;
  DType x_dtype, out_dtype;  // each fp32 or bf16
};

void rms_norm_cpu(const RmsNormParams& p);
void rope_cpu(const RopeParams& p);

}  // namespace indexcache
