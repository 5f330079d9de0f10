// AVX-512 helpers the CPU kernels share (compiled per function with target attributes, so a
// translation unit needs no -mavx512f and runs only where the caller checked the CPU at run time).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "elem_io.h"

namespace indexcache {
namespace cpu {

// The first min(left, 16) lanes.
inline __mmask16 tail16(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// 16 values from p (fp32 or bf16) as fp32, lanes past `mask` zero (and not read).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const void* p, DType dt, __mmask16 mask) {
  if (dt == DType::kFloat32) return _mm512_maskz_loadu_ps(mask, p);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The lanes under `mask` to p as fp32, or as bf16 rounded by c10::BFloat16 (store_f: nearest even,
// subnormals kept, every NaN 0x7FC0), so the result is the portable loops' to the bit.
// (vcvtneps2bf16 would flush subnormals to zero and keep NaN payloads: norm_rope.cpp's own store.)
__attribute__((target("avx512f"))) inline void store16(void* p, __m512 v, DType dt, __mmask16 mask) {
  if (dt == DType::kFloat32) return _mm512_mask_storeu_ps(p, mask, v);
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) store_f(p, i, tmp[i], dt);
}

// e^x for x >= -87 (the caller clamps): 2^n · e^r, n = x·log2(e) rounded to nearest even,
// r = x - n·ln2 (|r| <= ln2/2, ln2 in two parts), a degree-6 Taylor polynomial for e^r, 2^n applied
// by vscalefps. A NaN x gives NaN.
__attribute__((target("avx512f"))) inline __m512 exp_clamped_ps(__m512 x) {
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

// exp(x) for x <= 0 (softmax numerators), exp_clamped_ps of max(x, -87); inputs below -87 (where
// exp is under ~1.6e-38) give 0, as a softmax term far under its max (a huge attention sink) must:
// the clamp alone gave e^-87 there, and a row whose every key sat under a 1e30 sink came out ~1e-33
// instead of 0. NaN keeps the clamp's e^-87 (callers handle NaN scores before this).
__attribute__((target("avx512f"))) inline __m512 exp_ps(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), exp_clamped_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))));
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

// dst[c * ld + i] = rows[i][c0 + c] for i, c < 16: a 16 x 16 transpose of 32-bit values (rows
// interleaved in 32-bit, then 64-bit steps within 128-bit lanes; then the lanes regrouped across
// vectors). Packs key / query tiles whose pairs of bf16 (or fp32 values) must lie across lanes.
__attribute__((target("avx512f"))) inline void transpose16x16_epi32(const uint32_t* const* rows, int64_t c0,
                                                                   uint32_t* dst, int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + c0);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4g + k], lane m: column 4m + k of rows 4g .. 4g + 3.
  for (int g = 0; g < 16; g += 4) {
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    _mm512_storeu_si512(dst + k * ld, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(dst + (4 + k) * ld, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(dst + (8 + k) * ld, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(dst + (12 + k) * ld, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// dst[c] = a[c] | b[c] << 16 for c < n (a multiple of 32): two keys' bf16 values interleaved channel
// by channel, the pair layout of a P·V operand (the even key in the low half). Lane k of the first
// output takes channel k / 2 of a (k even) or b (k odd); the second, 16 on.
__attribute__((target("avx512f,avx512bw"))) inline void interleave_keys(const uint16_t* a, const uint16_t* b,
                                                                       int64_t n, uint32_t* dst) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t c = 0; c < n; c += 32) {
    const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, lo, vb));
    _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
  }
}

}  // namespace cpu
}  // namespace indexcache
