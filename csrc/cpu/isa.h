// The CPU kernels' code paths: one feature probe, one numbering, one run-time choice.
// Nothing is decided at build time: the same library loads on every x86-64 CPU (and on
// others, where only the portable path exists) and picks its path when an op first runs.
#pragma once

#include <string>

#include "indexcache/ops.h"

namespace indexcache {

// The code paths, in the order `auto` prefers them from last to first. kAuto is a request only.
// The numbers are names only (kAvx2 came last); kCpuPaths gives the order.
enum class CpuPath : int { kAuto = -1, kPortable = 0, kAvx512Bf16 = 1, kBlas = 2, kAvx2 = 3 };
inline constexpr CpuPath kCpuPaths[] = {CpuPath::kPortable, CpuPath::kAvx2, CpuPath::kAvx512Bf16, CpuPath::kBlas};

// What this CPU (and this torch) can run, read once.
struct CpuFeatures {
  bool avx2_fma = false;     // AVX2 + FMA + F16C
  bool avx512 = false;       // AVX-512 F + BW
  bool avx512bf16 = false;   // AVX-512 F + BW + BF16 dot products
  bool amx_bf16 = false;     // AMX-TILE + AMX-BF16 in CPUID, and Linux granted the tile state
  bool brgemm_bf16 = false;  // torch's cpublas::brgemm accepts bf16 (VNNI-packed B) here
  bool brgemm_tiles = false; // ... and runs it on the AMX tiles (torch's could_pack)
};
const CpuFeatures& cpu_features();

const char* cpu_path_name(CpuPath p);
// CpuPath::kAuto for "auto"; throws std::invalid_argument naming the choices otherwise.
CpuPath cpu_path_from_name(const std::string& name);
// Empty when path `p` can run on this CPU; else why not (e.g. "no AVX-512 BF16 on this CPU").
std::string cpu_path_unavailable(CpuPath p);

// Requests a path (kAuto restores the default); throws std::invalid_argument with the reason
// when the CPU cannot run it, leaving the current request unchanged.
void request_cpu_path(CpuPath p);
// The path requested, with kAuto resolved to the CPU's first choice (blas where AMX tiles are,
// else avx512bf16, else avx2, else portable): where the op runs when that path has a kernel for
// its input dtype. cpu_op_path below is what an op actually takes.
CpuPath cpu_path();

// The op families as dispatch sees them; each takes one path per input dtype.
enum class CpuOp : int {
  kIndexer = 0,
  kTopk,
  kSparseMla,
  kBlockTopk,
  kBlockSparseAttn,
  kQuantize,
  kDeltaRule,
  kRowsMatmul,
  kNormRope,
  kKpoolPool
};
inline constexpr CpuOp kCpuOps[] = {CpuOp::kIndexer,    CpuOp::kTopk,       CpuOp::kSparseMla, CpuOp::kBlockTopk,
                                    CpuOp::kBlockSparseAttn, CpuOp::kQuantize, CpuOp::kDeltaRule, CpuOp::kRowsMatmul,
                                    CpuOp::kNormRope,   CpuOp::kKpoolPool};
const char* cpu_op_name(CpuOp op);  // "indexer", "topk", "sparse_mla", "block_topk", "block_sparse_attention",
                                   // "quantize", "delta_rule", "rows_matmul", "norm_rope", "kpool_pool"
// The input dtypes an op takes (the key of its dispatch): indexer fp32 / bf16 / fp8 (q and k);
// topk fp32 (logits); sparse_mla fp32 (q or cache fp32), bf16 (bf16 q and cache), fp8 (bf16 q,
// fp8_ds_mla cache); block_topk and block_sparse_attention fp32 / bf16 (q / k / v); quantize fp32 /
// bf16 (its input); delta_rule fp32 / bf16 (q, k, v); rows_matmul fp32 / bf16 (the weight); norm_rope
// fp32 / bf16 (x: rms_norm and rope); kpool_pool fp32 / bf16 (index_raw: the pooled indexer's k | gate
// rows).
bool cpu_op_takes(CpuOp op, DType dt);
// Whether path p has its own vectorised kernel for (op, dt); portable has every one (the scalar
// reference loops, which no other path falls back to unless it is the only path the CPU runs).
bool cpu_path_has_kernel(CpuPath p, CpuOp op, DType dt);
// The path (op, dt) takes: the requested path (cpu_path()) where that path has a kernel for it,
// else the first path after it in the order blas, avx512bf16, avx2, portable that this CPU runs
// and that has one. So 'auto' takes, per op and dtype, the fastest kernel this CPU has (the
// quantizer on an AVX2-only CPU: the portable loop), and a forced path runs its own kernels
// wherever it has them ('avx2' on an AVX-512 CPU tests the AVX2 kernels; 'portable' the loops).
CpuPath cpu_op_path(CpuOp op, DType dt);
// Query rows of one request that the indexer's kernels score together against one packed key tile
// (the blas path's GEMM: M = rows x heads). Every indexer and sparse MLA call takes cpu_op_path(op, dt)
// whatever its heads or rows: since their blas kernels pack keys 16 at a time and sparse MLA runs its
// own AMX tiles (2026-12-06), blas beat or matched avx512bf16 on an AMX Xeon at every shape measured,
// one decode row of 1-64 heads included (docs/ops.md, "Thin calls"; docs/performance.md).
inline constexpr int64_t kIndexerRowBlock = 8;
// sparse_mla's dispatch dtype for a query and cache dtype (cpu_op_takes above).
inline DType sparse_mla_dtype(DType q, DType kv) {
  if (q == DType::kFloat32 || kv == DType::kFloat32) return DType::kFloat32;
  return kv;
}

}  // namespace indexcache
