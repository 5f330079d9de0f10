// Run-time choice of the CPU kernels' code path. Nothing here is decided at build time:
// the same library loads and picks its path on Zen 4 (AVX-512 BF16), on Xeons with AMX
// (the oneDNN brgemm path, which runs on the tile unit) and on CPUs with neither.
#include <ATen/native/CPUBlas.h>

#include <atomic>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "blas.h"

namespace indexcache {
namespace {

std::atomic<int> g_isa_request{kIsaAuto};

}  // namespace

bool cpu_has_avx512bf16_rt() {
#if defined(__x86_64__)
  static const bool v = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512f");
  return v;
#else
  return false;
#endif
}

bool cpu_has_amx_bf16_rt() {
#if defined(__x86_64__)
  static const bool v = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    if (!tile || !bf16) return false;
    // Linux hands a process the 8 KiB tile-data register state only on request
    // (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile load faults.
    // oneDNN asks too; asking twice is harmless.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return v;
#else
  return false;
#endif
}

bool blas_uses_tiles() {
  static const bool v = cpu_has_amx_bf16_rt() && at::native::cpublas::could_pack(at::kBFloat16);
  return v;
}

TileRelease::~TileRelease() {
  if (blas_uses_tiles()) at::native::cpublas::brgemm_release(true);
}

void set_cpu_isa(int isa) { g_isa_request.store(isa); }

int cpu_isa() {
  switch (g_isa_request.load()) {
    case kIsaPortable: return kPathPortable;
    case kIsaAvx512: return cpu_has_avx512bf16_rt() ? kPathAvx512Bf16 : kPathPortable;
    case kIsaBlas: return kPathBlas;
    default:
      if (blas_uses_tiles()) return kPathBlas;
      return cpu_has_avx512bf16_rt() ? kPathAvx512Bf16 : kPathPortable;
  }
}

int sparse_mla_path() {
  // Kept apart from cpu_isa() because the choice for sparse MLA was measured separately: on
  // Zen 4 brgemm led in wall-time runs on a loaded machine, but not in CPU time nor at one or
  // two decode rows (docs/performance.md), so 'auto' keeps the AVX-512 BF16 kernels there.
  return cpu_isa();
}

}  // namespace indexcache
