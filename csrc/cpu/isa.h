// The CPU kernels' code paths: one feature probe, one numbering, one run-time choice.
// Nothing is decided at build time: the same library loads on every x86-64 CPU (and on
// others, where only the portable path exists) and picks its path when an op first runs.
#pragma once

#include <string>

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
// The path the indexer, top-k and cache ops take.
CpuPath cpu_path();
// The path sparse MLA takes (the same today; kept apart because its choice is measured apart).
CpuPath sparse_mla_path();

// The AVX-512 kernels (quantization, top-k filter, bf16 tiles) run on the AVX-512 BF16 and blas
// paths, where the CPU has them; the portable and avx2 paths never run them (so forcing 'avx2'
// on an AVX-512 CPU tests the AVX2 kernels).
inline bool avx512_family(CpuPath p) { return p == CpuPath::kAvx512Bf16 || p == CpuPath::kBlas; }
inline bool use_avx512() { return avx512_family(cpu_path()) && cpu_features().avx512; }
inline bool use_avx512bf16() { return avx512_family(cpu_path()) && cpu_features().avx512bf16; }
// The AVX2 + FMA kernels (csrc/cpu/avx2.cpp: sparse MLA, the top-k filter) run on the avx2 path,
// which only a CPU with AVX2, FMA and F16C can take.
inline bool use_avx2() { return cpu_path() == CpuPath::kAvx2; }

}  // namespace indexcache
