// Shared top-k buffer helpers (DESIGN.md §3). Torch-free.
#pragma once

#include <cstdint>

namespace indexcache {

// Fill rows [0, num_rows) of an int32 top-k buffer with -1 ("no token").
struct FillParams {
  int32_t* buf;         // [num_rows, row_stride] int32, rows written in place
  int64_t num_rows;     // rows to fill (<= the buffer's rows)
  int64_t width;        // columns to fill in each row (index_topk)
  int64_t row_stride;   // elements between row starts (>= width)
};

void fill_topk_buffer_cpu(const FillParams& p);
#ifdef INDEXCACHE_WITH_CUDA
void fill_topk_buffer_cuda(const FillParams& p, void* stream);
#endif

}  // namespace indexcache
