// The blas path of MiniMax-M3's block_sparse_attention: block_sparse_impl.h's attention compiled a
// fourth time, for AVX-512 BF16 + AMX-TILE + AMX-BF16, with IC_AMX set: bf16 Q·Kᵀ and P·V on the
// AMX tiles (block_sparse_amx.h), the online softmax and the tile packing as on the avx512bf16
// path. Only `#pragma GCC target` below enables AMX, so the library still loads on any x86-64;
// isa.cpp sends block_sparse bf16 here only on a CPU with AMX-BF16 whose tile state Linux granted
// (cpu_features().amx_bf16) and AVX-512 BF16.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd.h"
#endif

#include "blas.h"
#include "indexcache/block_sparse.h"
#include "isa.h"

namespace indexcache {

#if defined(__x86_64__)
namespace {
inline int64_t elem_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }
}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c,amx-tile,amx-bf16")
#define IC_VEC_BYTES 64
#define IC_BF16_DOT 1
#define IC_AMX 1
namespace amx {
namespace {
#include "block_sparse_impl.h"
}  // namespace
}  // namespace amx
#pragma GCC pop_options

void block_sparse_attention_amx(const BlockSparseAttnParams& p) {
  TORCH_CHECK(cpu_features().amx_bf16 && cpu_features().avx512bf16,
              "block_sparse_attention's blas kernel needs AMX-BF16 and AVX-512 BF16");
  amx::attention(p);
}
#else
void block_sparse_attention_amx(const BlockSparseAttnParams&) {
  TORCH_CHECK(false, "block_sparse_attention's blas kernel needs an x86-64 CPU with AMX-BF16");
}
#endif

}  // namespace indexcache
