// The avx512bf16 path's bf16 tiles and micro-kernels of block_sparse_attention (block_sparse_impl.h
// includes this file inside its namespace when IC_BF16_DOT is set; no includes: the includer has
// them). Both products run on vdpbf16ps, which adds two bf16 products per fp32 lane:
//   S = Q·Kᵀ over pairs of head channels: query panels [d/2][16] and the key tile [d/2][keys] of
//       channel pairs, both packed by 16 x 16 transposes of 32-bit words;
//   O = P·V over pairs of keys: the value tile [keys/2][dp] of key pairs, and P split into
//       P_hi = bf16(P) and P_lo = bf16(P - P_hi), so Σ P·v = Σ P_hi·v + P_lo·v (each product exact
//       in fp32) carries P to 2^-17 relative instead of bf16's 2^-9: the result stays within a few
//       fp32 roundings of the fp32-P paths, at half vdpbf16ps's rate, which is still twice that of
//       fp32 FMAs.
// A query vector's arithmetic is its own (broadcast values, fixed key order), whatever else shares
// its panel.

// Query vectors per packed chunk (one 16 x 16 transpose wide); a score panel lies inside one chunk.
constexpr int64_t kQChunk = 16;

// dst[c * ld + j] = rows[j][c] for j < 16, c < n (32-bit words): whole 16-column blocks by
// register transposes, the rest element by element.
inline void pack_t16(const uint32_t* const* rows, int64_t n, uint32_t* dst, int64_t ld) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) cpu::transpose16x16_epi32(rows, c, dst + c * ld, ld);
  for (; c < n; ++c)
    for (int64_t j = 0; j < 16; ++j) dst[c * ld + j] = rows[j][c];
}

// Key tile of one block: kt2[c][i] = channel pair c of key i, for i < nk rounded up to 16 (keys
// past nk zero). key(i) points at key i's d bf16 values; zero is d/2 zero words.
template <class Key>
inline void pack_keys_bf16(Key key, int64_t nk, int64_t d2, const uint32_t* zero, uint32_t* kt2, int64_t ld) {
  const uint32_t* rows[16];
  for (int64_t i0 = 0; i0 < nk; i0 += 16) {
    for (int64_t j = 0; j < 16; ++j) rows[j] = i0 + j < nk ? reinterpret_cast<const uint32_t*>(key(i0 + j)) : zero;
    pack_t16(rows, d2, kt2 + i0, ld);
  }
}

// Value tile of one block: vt2[kp][c] = (V[2kp][c], V[2kp+1][c]) as one 32-bit word (the even
// key in the low half), for kp < ceil(nk / 2), c < dp (a multiple of 32); columns past d and the
// odd key past nk are zero. val(i) points at value row i's d bf16 values.
template <class Val>
inline void pack_values_bf16(Val val, int64_t nk, int64_t d, int64_t dp, uint32_t* vt2) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < (nk + 1) / 2; ++kp) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(val(2 * kp));
    const uint16_t* b = 2 * kp + 1 < nk ? reinterpret_cast<const uint16_t*>(val(2 * kp + 1)) : nullptr;
    for (int64_t c = 0; c < dp; c += 32) {
      __m512i va, vb = _mm512_setzero_si512();
      if (d - c >= 32) {
        va = _mm512_loadu_si512(a + c);
        if (b) vb = _mm512_loadu_si512(b + c);
      } else {
        const __mmask32 m = static_cast<__mmask32>((1u << (d - c)) - 1);
        va = _mm512_maskz_loadu_epi16(m, a + c);
        if (b) vb = _mm512_maskz_loadu_epi16(m, b + c);
      }
      _mm512_storeu_si512(vt2 + kp * dp + c, _mm512_permutex2var_epi16(va, ilo, vb));
      _mm512_storeu_si512(vt2 + kp * dp + c + 16, _mm512_permutex2var_epi16(va, ihi, vb));
    }
  }
}

// P rows split for vdpbf16ps: hi[j] = bf16(s[j]) (round to nearest even), lo[j] = bf16(s[j] - hi[j])
// for j < n (a multiple of 32).
inline void split_p_bf16(const float* s, int64_t n, uint16_t* hi, uint16_t* lo) {
  for (int64_t j = 0; j < n; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(s + j), x1 = _mm512_loadu_ps(s + j + 16);
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // words 0..15 from x0, 16..31 from x1
    const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    _mm512_storeu_si512(hi + j, h);
    _mm512_storeu_si512(lo + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0)));
  }
}

// ob[r][:dp] (+)= Σ_{2·kp0 <= i < nk} P[r][i] · V[i][:dp] for r < MR (added to ob's values when add,
// else written): ph / pl the P_hi / P_lo rows as key-pair words (row stride ldw), vt2 the value
// tile of key pairs (row stride dp, a multiple of 32), ob rows of stride dp. Pairs kp0 <= kp < nk / 2
// by vdpbf16ps (P_hi then P_lo); an odd last key alone by an fp32 FMA with its fp32 P (pf rows of
// stride lds), since its pair's other key is one the row does not read (a value there, even inf or
// NaN, must not reach it). Pairs go in ascending order, so a split at an even key is bit-exact.
template <int MR>
inline void panel_pv_bf16(const uint32_t* __restrict ph, const uint32_t* __restrict pl, int64_t ldw,
                          const float* __restrict pf, int64_t lds, const uint32_t* __restrict vt2, int64_t dp,
                          int64_t kp0, int64_t nk, bool add, float* __restrict ob) {
  const int64_t np = nk / 2;
  for (int64_t c = 0; c < dp; c += kNW) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) {
      a0[r] = add ? _mm512_loadu_ps(ob + r * dp + c) : _mm512_setzero_ps();
      a1[r] = add ? _mm512_loadu_ps(ob + r * dp + c + kVecLanes) : _mm512_setzero_ps();
    }
    const uint32_t* v = vt2 + kp0 * dp + c;
    for (int64_t kp = kp0; kp < np; ++kp, v += dp) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(v), v1 = (__m512bh)_mm512_loadu_si512(v + kVecLanes);
      for (int r = 0; r < MR; ++r) {
        const __m512bh h = (__m512bh)_mm512_set1_epi32(static_cast<int>(ph[r * ldw + kp]));
        a0[r] = _mm512_dpbf16_ps(a0[r], v0, h);
        a1[r] = _mm512_dpbf16_ps(a1[r], v1, h);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512bh l = (__m512bh)_mm512_set1_epi32(static_cast<int>(pl[r * ldw + kp]));
        a0[r] = _mm512_dpbf16_ps(a0[r], v0, l);
        a1[r] = _mm512_dpbf16_ps(a1[r], v1, l);
      }
    }
    if (nk & 1) {  // the even half of pair np is key nk - 1: bf16 -> fp32 is a 16-bit shift
      const __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(v), 16));
      const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(v + kVecLanes), 16));
      for (int r = 0; r < MR; ++r) {
        const __m512 p = _mm512_set1_ps(pf[r * lds + nk - 1]);
        a0[r] = _mm512_fmadd_ps(p, f0, a0[r]);
        a1[r] = _mm512_fmadd_ps(p, f1, a1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(ob + r * dp + c, a0[r]);
      _mm512_storeu_ps(ob + r * dp + c + kVecLanes, a1[r]);
    }
  }
}

template <int MR = kMR>
inline void panel_pv_bf16_n(int mr, const uint32_t* ph, const uint32_t* pl, int64_t ldw, const float* pf, int64_t lds,
                            const uint32_t* vt2, int64_t dp, int64_t kp0, int64_t nk, bool add, float* ob) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_pv_bf16_n<MR - 1>(mr, ph, pl, ldw, pf, lds, vt2, dp, kp0, nk, add, ob);
  }
  panel_pv_bf16<MR>(ph, pl, ldw, pf, lds, vt2, dp, kp0, nk, add, ob);
}
