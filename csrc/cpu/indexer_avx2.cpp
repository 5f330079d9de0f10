// The indexer's scoring kernel on the avx2 path (avx2.h; indexer.cpp packs and drives it): AVX2 +
// FMA on a 32-key fp32 tile [d][32], for fp32, bf16 and e4m3 key caches alike.
//
// Packing: each key row is read once per tile, widened to fp32 (bf16 by a shift, e4m3 by exponent
// arithmetic, exact) 8 channels at a time and transposed 8 x 8 in registers, so key lanes run along
// the tile's rows. Scoring: for each half of the tile (16 keys = two vectors) a block of 6 query
// heads keeps 12 accumulators in registers (4 heads x 2 for the 8-head case and the remainders),
// so each tile vector loaded serves every head of the block and each FMA a full vector; the
// ReLU-weighted head sum is fused at the end of each block (heads in order: the result does not
// depend on the thread count). The tile is packed once for all query rows of a row block
// (indexer.cpp's score_rows) and stays in L1 (16 KB at d = 128) while they are scored.
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>

#include "avx2.h"
#include "indexcache/ops.h"

#if defined(__x86_64__)

// Everything defined below (and nothing from the headers above) is compiled for AVX2 + FMA + F16C.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "avx2_convert.h"

namespace indexcache {
namespace {

constexpr int kTile = 32;  // keys per tile (indexer.cpp's kTile)

// Channels [c, c + 8) of a key row as fp32.
template <DType DT>
inline __m256 load8(const void* row, int64_t c) {
  if constexpr (DT == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(row) + c);
  if constexpr (DT == DType::kBFloat16) return avx2::bf16x8(static_cast<const uint16_t*>(row) + c);
  return avx2::e4m3x8(static_cast<const uint8_t*>(row) + c);
}

template <DType DT>
void pack(const void* const* rows, int n, int64_t d, float* tile) {
  for (int j0 = 0; j0 < kTile; j0 += 8) {
    for (int64_t c = 0; c < d; c += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = j0 + i < n ? load8<DT>(rows[j0 + i], c) : _mm256_setzero_ps();
      avx2::transpose8_store(r, tile + c * kTile + j0, kTile);
    }
  }
}

// HB heads' ReLU-weighted scores against 16 keys (kt: a half of a [d][32] tile) added to o0 / o1.
template <int HB>
inline void heads(const float* q, const float* w, int64_t d, const float* kt, __m256& o0, __m256& o1) {
  __m256 a0[HB], a1[HB];
  for (int i = 0; i < HB; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m256 k0 = _mm256_loadu_ps(kt + c * kTile), k1 = _mm256_loadu_ps(kt + c * kTile + 8);
    for (int i = 0; i < HB; ++i) {
      const __m256 qb = _mm256_broadcast_ss(q + i * d + c);
      a0[i] = _mm256_fmadd_ps(qb, k0, a0[i]);
      a1[i] = _mm256_fmadd_ps(qb, k1, a1[i]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < HB; ++i) {
    const __m256 wv = _mm256_set1_ps(w[i]);
    // max_ps returns its second operand when either is NaN: ReLU keeps a NaN dot.
    o0 = _mm256_fmadd_ps(_mm256_max_ps(zero, a0[i]), wv, o0);
    o1 = _mm256_fmadd_ps(_mm256_max_ps(zero, a1[i]), wv, o1);
  }
}

}  // namespace

void indexer_pack_tile_avx2(const void* const* rows, int n, DType dt, int64_t d, float* tile) {
  switch (dt) {
    case DType::kFloat32: return pack<DType::kFloat32>(rows, n, d, tile);
    case DType::kBFloat16: return pack<DType::kBFloat16>(rows, n, d, tile);
    default: return pack<DType::kFp8E4M3>(rows, n, d, tile);
  }
}

void indexer_score_tile_avx2(const float* q, const float* w, int64_t h, int64_t d, const float* tile,
                             const float* scale, float* out) {
  for (int half = 0; half < kTile; half += 16) {
    __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps();
    const float* kt = tile + half;
    int64_t hh = 0;
    // Blocks of 6 heads, but 8 as 4 + 4 (6 + 2 would leave a 2-head block with 4 accumulators).
    for (; h - hh >= 6 && h - hh != 8; hh += 6) heads<6>(q + hh * d, w + hh, d, kt, o0, o1);
    for (; h - hh >= 4; hh += 4) heads<4>(q + hh * d, w + hh, d, kt, o0, o1);
    for (; h - hh >= 2; hh += 2) heads<2>(q + hh * d, w + hh, d, kt, o0, o1);
    for (; hh < h; ++hh) heads<1>(q + hh * d, w + hh, d, kt, o0, o1);
    _mm256_storeu_ps(out + half, _mm256_mul_ps(o0, _mm256_loadu_ps(scale + half)));
    _mm256_storeu_ps(out + half + 8, _mm256_mul_ps(o1, _mm256_loadu_ps(scale + half + 8)));
  }
}

}  // namespace indexcache

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: the avx2 path is never taken (isa.cpp)

namespace indexcache {
void indexer_pack_tile_avx2(const void* const*, int, DType, int64_t, float*) {
  TORCH_CHECK(false, "the avx2 CPU path needs an x86-64 CPU");
}
void indexer_score_tile_avx2(const float*, const float*, int64_t, int64_t, const float*, const float*, float*) {
  TORCH_CHECK(false, "the avx2 CPU path needs an x86-64 CPU");
}
}  // namespace indexcache

#endif
