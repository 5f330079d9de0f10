// A few rows through a weight matrix: the projections of a decode step (one row per request),
// where a GEMM library spends more on set-up than on the arithmetic. Torch-free: raw pointers,
// shapes and strides.
//
//   w_nk:  out[g, m, n] = sum_k x[g, m, k] * w[g, n, k]   (a linear layer's [out, in] weight)
//   !w_nk: out[g, m, n] = sum_k x[g, m, k] * w[g, k, n]
//
// Products are summed in fp32 in a fixed order per output element (k ascending within each
// vector lane, lanes summed in a fixed tree), so a result never depends on the thread count.
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

struct RowsMatmulParams {
  const void* x;      // [G, M, K] x_dtype, last dim contiguous
  const void* w;      // [G, N, K] (w_nk) or [G, K, N] w_dtype, last dim contiguous
  void* out;          // [G, M, N] out_dtype, last dim contiguous
  int64_t G, M, N, K;
  int64_t x_sg, x_sm;  // element strides of x over g and m
  int64_t w_sg, w_sr;  // of w over g and over its rows (n for w_nk, k otherwise)
  int64_t o_sg, o_sm;  // of out over g and m
  bool w_nk;
  DType x_dtype, w_dtype, out_dtype;  // each fp32 or bf16
};

void rows_matmul_cpu(const RowsMatmulParams& p);

}  // namespace indexcache
