// Run-time choice of the CPU kernels' code path (isa.h). The one place that reads CPUID.
#include "isa.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "blas.h"

namespace indexcache {
namespace {

std::atomic<int> g_request{static_cast<int>(CpuPath::kAuto)};

bool probe_amx_bf16() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  if (!tile || !bf16) return false;
  // Linux hands a process the 8 KiB tile-data register state only on request
  // (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile load faults.
  // oneDNN asks too; asking twice is harmless.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// Asks torch rather than guessing from CPUID: its bf16 brgemm with a VNNI-packed B needs a
// oneDNN ukernel for this CPU (AVX-512 or AMX) and raises otherwise ("BFloat16 Brgemm VNNI
// format is only supported ... when amx is supported" on AVX2-only CPUs).
bool probe_brgemm_bf16(bool release_tiles) {
  alignas(64) uint16_t a[2 * 32] = {}, bm[32 * 32] = {};
  alignas(64) float c[2 * 32] = {};
  try {
    at::native::cpublas::brgemm(2, 32, 32, 32, 32, 32, false, reinterpret_cast<const at::BFloat16*>(a),
                                reinterpret_cast<const at::BFloat16*>(bm), c, true);
    if (release_tiles) at::native::cpublas::brgemm_release(true);
  } catch (const c10::Error&) {
    return false;
  }
  for (float v : c)
    if (v != 0.f) return false;
  return true;
}

CpuFeatures probe() {
  CpuFeatures f;
#if defined(__x86_64__)
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  f.avx512bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
  f.amx_bf16 = probe_amx_bf16();
#endif
  f.brgemm_tiles = f.amx_bf16 && at::native::cpublas::could_pack(at::kBFloat16);
  f.brgemm_bf16 = probe_brgemm_bf16(f.brgemm_tiles);
  return f;
}

CpuPath auto_path() {
  const CpuFeatures& f = cpu_features();
  if (f.brgemm_tiles && f.brgemm_bf16) return CpuPath::kBlas;
  if (f.avx512bf16) return CpuPath::kAvx512Bf16;
  if (f.avx2_fma) return CpuPath::kAvx2;
  return CpuPath::kPortable;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

const char* cpu_path_name(CpuPath p) {
  switch (p) {
    case CpuPath::kAuto: return "auto";
    case CpuPath::kPortable: return "portable";
    case CpuPath::kAvx2: return "avx2";
    case CpuPath::kAvx512Bf16: return "avx512bf16";
    case CpuPath::kBlas: return "blas";
  }
  return "?";
}

CpuPath cpu_path_from_name(const std::string& name) {
  if (name == "auto") return CpuPath::kAuto;
  std::string choices = "'auto'";
  for (CpuPath p : kCpuPaths) {
    if (name == cpu_path_name(p)) return p;
    choices += std::string(", '") + cpu_path_name(p) + "'";
  }
  throw std::invalid_argument("unknown CPU path '" + name + "': choose one of " + choices);
}

std::string cpu_path_unavailable(CpuPath p) {
  const CpuFeatures& f = cpu_features();
  switch (p) {
    case CpuPath::kAvx2:
      return f.avx2_fma ? "" : "no AVX2 + FMA + F16C on this CPU";
    case CpuPath::kAvx512Bf16:
      return f.avx512bf16 ? "" : "no AVX-512 BF16 on this CPU";
    case CpuPath::kBlas:
      return f.brgemm_bf16 ? ""
                           : "torch's oneDNN brgemm refuses bf16 on this CPU (it needs AVX-512 or AMX; "
                             "this one has neither)";
    default:
      return "";
  }
}

void request_cpu_path(CpuPath p) {
  if (p != CpuPath::kAuto) {
    const std::string why = cpu_path_unavailable(p);
    if (!why.empty()) throw std::invalid_argument(std::string("CPU path '") + cpu_path_name(p) + "' cannot run here: " + why);
  }
  g_request.store(static_cast<int>(p));
}

CpuPath cpu_path() {
  const auto r = static_cast<CpuPath>(g_request.load());
  return r == CpuPath::kAuto ? auto_path() : r;
}

const char* cpu_op_name(CpuOp op) {
  switch (op) {
    case CpuOp::kIndexer: return "indexer";
    case CpuOp::kTopk: return "topk";
    case CpuOp::kSparseMla: return "sparse_mla";
    case CpuOp::kBlockTopk: return "block_topk";
    case CpuOp::kBlockSparseAttn: return "block_sparse_attention";
    case CpuOp::kQuantize: return "quantize";
    case CpuOp::kDeltaRule: return "delta_rule";
    case CpuOp::kRowsMatmul: return "rows_matmul";
    case CpuOp::kNormRope: return "norm_rope";
    case CpuOp::kKpoolPool: return "kpool_pool";
  }
  return "?";
}

bool cpu_op_takes(CpuOp op, DType dt) {
  switch (op) {
    case CpuOp::kIndexer: return true;
    case CpuOp::kTopk: return dt == DType::kFloat32;
    case CpuOp::kSparseMla: return true;
    case CpuOp::kBlockTopk:
    case CpuOp::kBlockSparseAttn:
    case CpuOp::kQuantize:
    case CpuOp::kDeltaRule:
    case CpuOp::kRowsMatmul:
    case CpuOp::kNormRope:
    case CpuOp::kKpoolPool: return dt != DType::kFp8E4M3;
  }
  return false;
}

bool cpu_path_has_kernel(CpuPath p, CpuOp op, DType dt) {
  if (!cpu_op_takes(op, dt)) return false;
  switch (p) {
    case CpuPath::kPortable: return true;
    // avx2.cpp: sparse MLA in every dtype and the top-k filter; indexer_avx2.cpp: the indexer's
    // FMA tiles for every key dtype (fp32, bf16, fp8 widened to fp32 once per tile);
    // block_sparse_impl.h and delta_rule_impl.h compiled for AVX2 + FMA; rows_matmul's 8-lane
    // widening + FMA kernel (rows_matmul.cpp); the e4m3 quantizer's 8-lane byte conversion
    // (cache_ops.cpp, bit-identical to float_to_e4m3). norm_rope goes on to portable (its portable
    // loops for decode rows, torch's ops beyond), and so does kpool_pool (a step's few completed
    // pools: its portable loop).
    case CpuPath::kAvx2:
      return op != CpuOp::kNormRope && op != CpuOp::kKpoolPool;
    // vdpbf16ps for bf16 / fp8 scores (the indexer's fp32 tile loop compiled for AVX-512F), the
    // AVX-512 top-k filter, block_sparse_impl.h (block_topk fp32 / bf16 and bf16 attention: 16-lane
    // FMA / vdpbf16ps micro-kernels), the e4m3 quantizer compiled for AVX-512 and fp32 sparse MLA's
    // FMA kernels (sparse_mla_avx512.cpp). fp32 block-sparse attention: avx2's lane kernel compiled at
    // 16 lanes (block_sparse_lanes.h, the same bits as avx2's), 1.2-1.7x avx2's rate at 8-64 query
    // heads on the AMX Xeon (two 512-bit FMA ports); on a Zen 4, whose 512-bit FMA is two 256-bit
    // halves, level with avx2 at 8-16 heads and 1.03-1.10x at 64 (docs/performance.md, 2026-12-08).
    // delta_rule_impl.h compiled for AVX-512 takes both its dtypes (its inputs are converted to fp32
    // tiles once; the work is fp32 FMA). rows_matmul: vdpbf16ps for bf16 x bf16, widening + FMA for
    // the other dtype pairs (rows_matmul.cpp). norm_rope.cpp: 16-lane RMSNorm and rotation,
    // bit-identical to its portable loops. kpool_pool.cpp: 16 channels a vector.
    case CpuPath::kAvx512Bf16: return true;
    // oneDNN brgemm in bf16: the indexer and sparse MLA with bf16 / fp8 inputs (blas.h); bf16
    // block-sparse attention on the AMX tiles where the CPU has them (block_sparse_amx.cpp; block_topk
    // goes on to avx512bf16).
    case CpuPath::kBlas:
      if (op == CpuOp::kBlockSparseAttn)
        return dt == DType::kBFloat16 && cpu_features().amx_bf16 && cpu_features().avx512bf16;
      return (op == CpuOp::kIndexer || op == CpuOp::kSparseMla) && dt != DType::kFloat32;
    case CpuPath::kAuto: return false;
  }
  return false;
}

namespace {

// The first path from `want` on, in the fallback order blas, avx512bf16, avx2, portable, that this
// CPU runs and that has a kernel for (op, dt).
CpuPath first_path_from(CpuPath want, CpuOp op, DType dt) {
  static constexpr CpuPath kOrder[] = {CpuPath::kBlas, CpuPath::kAvx512Bf16, CpuPath::kAvx2, CpuPath::kPortable};
  static const bool runs[4] = {cpu_path_unavailable(kOrder[0]).empty(), cpu_path_unavailable(kOrder[1]).empty(),
                               cpu_path_unavailable(kOrder[2]).empty(), true};
  bool started = false;
  for (int i = 0; i < 4; ++i) {
    started = started || kOrder[i] == want;
    if (started && runs[i] && cpu_path_has_kernel(kOrder[i], op, dt)) return kOrder[i];
  }
  return CpuPath::kPortable;
}

}  // namespace

CpuPath cpu_op_path(CpuOp op, DType dt) { return first_path_from(cpu_path(), op, dt); }

TileRelease::~TileRelease() {
  if (cpu_features().brgemm_tiles) at::native::cpublas::brgemm_release(true);
}

}  // namespace indexcache
