// AVX-512 helpers the CPU kernels share (compiled per function with target attributes, so a
// translation unit needs no -mavx512f and runs only where the caller checked the CPU at run time).
#pragma once

#include <immintrin.h>

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

}  // namespace cpu
}  // namespace indexcache
