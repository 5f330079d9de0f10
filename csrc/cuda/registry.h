// The CUDA kernels' op families: each file registers its own ops through one of these,
// called from the single TORCH_LIBRARY_IMPL(indexcache, CUDA, ...) block in registration.cu.
#pragma once

#include <torch/library.h>

namespace indexcache {

void register_buffer_cuda(torch::Library& m);
void register_cache_ops_cuda(torch::Library& m);
void register_indexer_cuda(torch::Library& m);
void register_topk_cuda(torch::Library& m);
void register_sparse_mla_cuda(torch::Library& m);
void register_block_sparse_cuda(torch::Library& m);
void register_delta_rule_cuda(torch::Library& m);
void register_kpool_pool_cuda(torch::Library& m);

}  // namespace indexcache
