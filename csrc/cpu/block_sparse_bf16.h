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
// Without AMX the softmax writes P_hi / P_lo in the pass that takes the exponentials
// (block_softmax_split_bf16), and the P·V kernel starts from o·alpha and stores o itself, so the
// online softmax's rescale costs no pass of its own.
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

// P rows split for vdpbf16ps (the AMX path; the avx512bf16 one splits in block_softmax_split_bf16):
// hi[j] = bf16(s[j]) (round to nearest even), lo[j] = bf16(s[j] - hi[j]) for j < n (a multiple of 32).
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

// exp_v (block_sparse_impl.h) with AVX-512's FMAs and vscalefps (simd.h's polynomial): the same
// clamp at -87 (e^-87 below it, not simd.h exp_ps's 0) and the same polynomial, 11 vector operations
// where the generic form takes ~25 (no contraction of a * b + c under -std=c++20).
inline __m512 exp_fma(__m512 x) {
  // vmaxps returns its second operand for a NaN: NaN stays
  return cpu::exp_clamped_ps(_mm512_max_ps(_mm512_set1_ps(-87.0f), x));
}

// Lanes j .. j + 15 of a row that are below nk.
inline __mmask16 lanes_below(int64_t j, int64_t nk) {
  return nk >= j + 16 ? static_cast<__mmask16>(0xFFFF) : (nk <= j ? 0 : static_cast<__mmask16>((1u << (nk - j)) - 1));
}

// block_softmax (below) for one query vector's scores s [ncols] (a multiple of 32), with the split
// of split_p_bf16 in the same pass: hi / lo [ncols] get P_hi / P_lo (0 past nk); s keeps the
// scores but for an odd nk, where s[nk - 1 rounded down to 32 ..] gets the fp32 P that
// panel_pv_bf16 reads for the odd key. Reductions across lanes by halving trees (fixed order).
inline float block_softmax_split_bf16(float* s, int64_t nk, int64_t ncols, float scale, float* run_max, float* alpha,
                                      bool* bad, uint16_t* hi, uint16_t* lo) {
  const __m512 vs = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 kbad = 0;
  for (int64_t j = 0; j < ncols; j += kVecLanes) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + j), vs);
    const __mmask16 ok = lanes_below(j, nk);
    kbad |= ok & ~_mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_EQ_OQ);  // v - v is 0 exactly when finite
    vmax = _mm512_mask_mov_ps(vmax, ok & _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ), v);
  }
  const float red = _mm512_reduce_max_ps(vmax), mx = red > *run_max ? red : *run_max;
  *bad = *bad || kbad != 0;
  *alpha = std::exp(*run_max - mx);
  *run_max = mx;
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = zero;
  const int64_t odd = nk & 1 ? (nk - 1) / 32 * 32 : -1;
  for (int64_t j = 0; j < ncols; j += 32) {
    const __m512 x0 = _mm512_maskz_mov_ps(lanes_below(j, nk),
                                          exp_fma(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), vs), vm)));
    const __m512 x1 = _mm512_maskz_mov_ps(lanes_below(j + 16, nk),
                                          exp_fma(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j + 16), vs), vm)));
    vsum = _mm512_add_ps(_mm512_add_ps(vsum, x0), x1);
    if (j == odd) {
      _mm512_storeu_ps(s + j, x0);
      _mm512_storeu_ps(s + j + 16, x1);
    }
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // words 0..15 from x0, 16..31 from x1
    const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    _mm512_storeu_si512(hi + j, h);
    _mm512_storeu_si512(lo + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0)));
  }
  return _mm512_reduce_add_ps(vsum);
}

// How panel_pv_bf16 starts a vector's accumulators: zero, its out row as it is, or its out row times
// the vector's softmax rescale alpha (o = o·alpha + P·V in one pass over o).
enum class PvInit { kZero, kLoad, kScale };

// o[r][:dp] = init(o[r]) + Σ_{2·kp0 <= i < nk} P[r][i] · V[i][:dp] for r < MR, o[r] = orow[r] (dp
// floats; init per PvInit, alpha[r] for kScale): ph / pl the P_hi / P_lo rows as key-pair words
// (row stride ldw), vt2 the value tile of key pairs (row stride dp, a multiple of 32). Pairs
// kp0 <= kp < nk / 2 by vdpbf16ps (P_hi then P_lo); an odd last key alone by an fp32 FMA with its
// fp32 P (pf rows of stride lds), since its pair's other key is one the row does not read (a value
// there, even inf or NaN, must not reach it). Pairs go in ascending order, so a split at an even
// key continued with kLoad is bit-exact.
template <int MR>
inline void panel_pv_bf16(const uint32_t* __restrict ph, const uint32_t* __restrict pl, int64_t ldw,
                          const float* __restrict pf, int64_t lds, const uint32_t* __restrict vt2, int64_t dp,
                          int64_t kp0, int64_t nk, PvInit init, const float* alpha, float* const* orow) {
  const int64_t np = nk / 2;
  for (int64_t c = 0; c < dp; c += kNW) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) {
      if (init == PvInit::kZero) {
        a0[r] = a1[r] = _mm512_setzero_ps();
        continue;
      }
      a0[r] = _mm512_loadu_ps(orow[r] + c);
      a1[r] = _mm512_loadu_ps(orow[r] + c + kVecLanes);
      if (init == PvInit::kScale) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        a0[r] = _mm512_mul_ps(a0[r], al);
        a1[r] = _mm512_mul_ps(a1[r], al);
      }
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
      _mm512_storeu_ps(orow[r] + c, a0[r]);
      _mm512_storeu_ps(orow[r] + c + kVecLanes, a1[r]);
    }
  }
}

template <int MR = kMR>
inline void panel_pv_bf16_n(int mr, const uint32_t* ph, const uint32_t* pl, int64_t ldw, const float* pf, int64_t lds,
                            const uint32_t* vt2, int64_t dp, int64_t kp0, int64_t nk, PvInit init, const float* alpha,
                            float* const* orow) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_pv_bf16_n<MR - 1>(mr, ph, pl, ldw, pf, lds, vt2, dp, kp0, nk, init, alpha, orow);
  }
  panel_pv_bf16<MR>(ph, pl, ldw, pf, lds, vt2, dp, kp0, nk, init, alpha, orow);
}
