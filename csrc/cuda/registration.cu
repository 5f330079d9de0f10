// The one registration block of the CUDA backend: every op of csrc/torch_bindings.cpp's
// schema gets its CUDA kernel here, family by family (registry.h).
#include <torch/library.h>

#include "registry.h"

namespace indexcache {

TORCH_LIBRARY_IMPL(indexcache, CUDA, m) {
  register_buffer_cuda(m);
  register_cache_ops_cuda(m);
  register_indexer_cuda(m);
  register_topk_cuda(m);
  register_sparse_mla_cuda(m);
  register_block_sparse_cuda(m);
  register_delta_rule_cuda(m);
  register_kpool_pool_cuda(m);
}

}  // namespace indexcache
