// Element conversions and the 8 x 8 transpose of the AVX2 kernels (avx2.cpp: sparse MLA;
// indexer_avx2.cpp: the indexer's key tiles; block_sparse.cpp: block-sparse attention's Qᵀ panels). Include it only after a translation unit's `#pragma GCC target("avx2,fma,f16c")`
// (its inline functions take that target from the pragma), and <immintrin.h> before the pragma.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace indexcache {
namespace avx2 {

// n bf16 values (n a multiple of 8) -> fp32.
inline void bf16_to_f32(const uint16_t* src, float* dst, int n) {
  for (int c = 0; c < n; c += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c)));
    _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
}

// 8 bf16 values -> fp32.
inline __m256 bf16x8(const uint16_t* src) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// dst[i * ld + j] = r[j][i] for i, j < 8.
inline void transpose8_store(const __m256 (&r)[8], float* dst, int64_t ld) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
  }
}

// 8 e4m3 bytes -> fp32, exact (e4m3_to_float), without denormal arithmetic: normal values
// rebias the exponent (7 -> 127) as integers, subnormals (exponent 0) are mantissa · 2^-9.
inline __m256 e4m3x8(const uint8_t* src) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f));
  __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub,
                              _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
  return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
}

}  // namespace avx2
}  // namespace indexcache
