// The "blas" CPU path: the GEMM-shaped cores of the indexer and of sparse MLA handed to
// oneDNN's batch-reduce GEMM through torch (at::native::cpublas::brgemm: bf16 inputs, fp32
// accumulation and output). On a CPU with AMX-BF16 oneDNN runs it on the tile unit; that is
// the reason this path exists (docs/performance.md). Elsewhere torch answers brgemm through
// its own GEMM; there the path is chosen only where it measured faster than the AVX-512 BF16
// kernels (docs/performance.md), and `_set_cpu_isa("blas")` forces it, for tests and benches.
//
// Each entry returns false when it does not handle the inputs (fp32 q or k, fp32 caches);
// the caller then runs its own kernels.
#pragma once

#include "indexcache/ops.h"

namespace indexcache {

// CPU code path override (set_cpu_isa in ops.h): what `_set_cpu_isa` stores.
enum CpuIsaRequest : int { kIsaAuto = 0, kIsaPortable = 1, kIsaAvx512 = 2, kIsaBlas = 3 };
// The path taken (cpu_isa() in ops.h).
enum CpuIsaPath : int { kPathAvx512Bf16 = 0, kPathPortable = 1, kPathBlas = 2 };

bool cpu_has_avx512bf16_rt();  // AVX-512F/BW/BF16, read at run time
bool cpu_has_amx_bf16_rt();     // AMX-TILE/BF16 in CPUID, and Linux granted the tile-data state
bool blas_uses_tiles();         // oneDNN's brgemm runs on AMX here (torch's could_pack)

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
// The path sparse_mla takes (a CpuIsaPath); today the same as cpu_isa() (isa.cpp says why).
int sparse_mla_path();

}  // namespace indexcache
