// The CPU kernels' op families: each file registers its own ops through one of these,
// called from the single TORCH_LIBRARY_IMPL(indexcache, CPU, ...) block in registration.cpp.
#pragma once

#include <torch/library.h>

namespace indexcache {

void register_buffer_cpu(torch::Library& m);
void register_cache_ops_cpu(torch::Library& m);
void register_indexer_cpu(torch::Library& m);
void register_sparse_mla_cpu(torch::Library& m);
void register_block_sparse_cpu(torch::Library& m);
void register_delta_rule_cpu(torch::Library& m);
void register_rows_matmul_cpu(torch::Library& m);
void register_swiglu_rows_cpu(torch::Library& m);
void register_norm_rope_cpu(torch::Library& m);
void register_kpool_pool_cpu(torch::Library& m);

}  // namespace indexcache
