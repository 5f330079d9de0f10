// The one registration block of the CPU backend: every op of csrc/torch_bindings.cpp's
// schema gets its CPU kernel here, family by family (registry.h).
#include <torch/library.h>

#include "registry.h"

namespace indexcache {

TORCH_LIBRARY_IMPL(indexcache, CPU, m) {
  register_buffer_cpu(m);
  register_cache_ops_cpu(m);
  register_indexer_cpu(m);
  register_sparse_mla_cpu(m);
  register_block_sparse_cpu(m);
  register_delta_rule_cpu(m);
  register_rows_matmul_cpu(m);
  register_swiglu_rows_cpu(m);
  register_norm_rope_cpu(m);
  register_kpool_pool_cpu(m);
}

}  // namespace indexcache
