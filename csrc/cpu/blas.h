// The "blas" CPU path: the GEMM-shaped cores of the indexer and of sparse MLA handed to
// oneDNN's batch-reduce GEMM through torch (at::native::cpublas::brgemm: bf16 inputs, fp32
// accumulation and output). On a CPU with AMX-BF16 oneDNN runs it on the tile unit; that is
// the reason this path exists (docs/performance.md). On AVX-512 CPUs oneDNN answers bf16
// brgemm with its AVX-512 kernels: there `auto` does not take this path (the AVX-512 BF16
// kernels measured faster) and `_set_cpu_isa("blas")` forces it, for tests and benches. On
// AVX2-only CPUs torch refuses bf16 brgemm, so the path is unavailable there (isa.h).
//
// Each entry returns false when it does not handle the inputs (fp32 q or k, fp32 caches);
// the caller then runs its own kernels.
#pragma once

#include "indexcache/block_sparse.h"
#include "indexcache/ops.h"
#include "isa.h"

namespace indexcache {

// Tile state is per thread; oneDNN wants it released when a thread leaves its brgemm calls.
// One per parallel_for chunk that calls brgemm (defined in isa.cpp).
struct TileRelease {
  ~TileRelease();
};

bool indexer_logits_blas(const IndexerParams& p, const LogitsOut& o);
bool indexer_logits_paged_blas(const PagedIndexerParams& p, const LogitsOut& o);
bool indexer_topk_blas(const IndexerParams& p, const TopkOut& o);
bool indexer_topk_paged_blas(const PagedIndexerParams& p, const TopkOut& o);
bool sparse_mla_blas(const SparseMlaParams& p);
// bf16 block_sparse_attention on the AMX tiles (block_sparse_amx.cpp, not oneDNN): needs
// cpu_features().amx_bf16 and avx512bf16 (isa.cpp routes nothing else here).
void block_sparse_attention_amx(const BlockSparseAttnParams& p);

}  // namespace indexcache
