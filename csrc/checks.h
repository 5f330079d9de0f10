// Argument checks and params-struct builders shared by the CPU and CUDA op impls, so
// both devices reject exactly the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "indexcache/buffer.h"

namespace indexcache {

#define IC_CHECK_DTYPE(t, dt, name) \
  TORCH_CHECK((t).scalar_type() == (dt), name " must be ", (dt), ", got ", (t).scalar_type())
#define IC_CHECK_DIM(t, n, name) \
  TORCH_CHECK((t).dim() == (n), name " must have ", (n), " dims, got shape ", (t).sizes())
#define IC_CHECK_CONTIG(t, name) \
  TORCH_CHECK((t).is_contiguous(), name " must be contiguous, got strides ", (t).strides())
#define IC_CHECK_SAME_DEVICE(a, b, na, nb)                                                    \
  TORCH_CHECK((a).device() == (b).device(), na " and " nb " must be on one device, got ", \
              (a).device(), " and ", (b).device())

inline FillParams make_fill_params(at::Tensor& buf, int64_t num_rows) {
  IC_CHECK_DTYPE(buf, at::kInt, "topk buffer");
  IC_CHECK_DIM(buf, 2, "topk buffer");
  TORCH_CHECK(buf.stride(1) == 1, "topk buffer rows must be contiguous, got strides ", buf.strides());
  TORCH_CHECK(num_rows >= 0, "num_rows must be >= 0, got ", num_rows);
  TORCH_CHECK(num_rows <= buf.size(0), "num_rows=", num_rows, " exceeds the topk buffer's ",
              buf.size(0), " rows (max_num_batched_tokens)");
  return FillParams{buf.data_ptr<int32_t>(), num_rows, buf.size(1), buf.stride(0)};
}

}  // namespace indexcache
