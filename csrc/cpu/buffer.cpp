#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "registry.h"
#include "indexcache/buffer.h"

namespace indexcache {

void fill_topk_buffer_cpu(const FillParams& p) {
  at::parallel_for(0, p.num_rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::fill_n(p.buf + r * p.row_stride, p.width, -1);
  });
}

namespace {
void fill_topk_buffer_cpu_op(at::Tensor& buf, int64_t num_rows) {
  const FillParams p = make_fill_params(buf, num_rows);
  fill_topk_buffer_cpu(p);
}
}  // namespace

void register_buffer_cpu(torch::Library& m) {
  m.impl("fill_topk_buffer_", &fill_topk_buffer_cpu_op);
}

}  // namespace indexcache
