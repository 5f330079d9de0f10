// AVX-512 helpers the CPU kernels share (compiled per function with target attributes, so a
// translation unit needs no -mavx512f and runs only where the caller checked the CPU at run time).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace indexcache {
namespace cpu {

// exp(x) for x <= 0 (softmax numerators): 2^n · e^r, |r| <= ln2/2, degree-6 Taylor polynomial
// for e^r; inputs below -87 give exp(-87) ~ 1.6e-38 (callers handle NaN scores before this).
__attribute__((target("avx512f"))) inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 e4m3 bytes -> fp32, exact (e4m3_to_float): normal values rebias the exponent (7 -> 127) as
// integers, subnormals (exponent 0) are mantissa · 2^-9, 0x7F is NaN, the sign is or-ed back.
__attribute__((target("avx512f"))) inline __m512 e4m3x16(const uint8_t* src) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  v = _mm512_mask_mov_ps(v, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)),
                         _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f)));
  v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                         _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));  // (or_ps would need AVX-512 DQ)
}

}  // namespace cpu
}  // namespace indexcache
