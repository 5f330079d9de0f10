// CPU sparse MLA (absorbed form, DESIGN.md §5): per query row, attention of h_q heads over
// the selected cache slots. Two passes per (row, head block): scores for every selected
// key, an exact softmax, then P·V. With AVX-512 BF16 the scores run on vdpbf16ps (exact
// bf16 products, fp32 sums) and P·V on fp32 FMAs with P kept in fp32. fp32 inputs (q or cache)
// run sparse_mla_avx512.cpp's FMA kernels on that path (the avx2 path has its own, avx2.cpp); the
// fp32 row loop below is the portable path's.
// Every path is a template on the row width D = d_qk (576 for DSA, 512 for DeepSeek-V4's K=V
// head, whose value is the whole row), so the 576 loops keep their compile-time bounds; a row's
// keys are the valid entries of indices and then of extra_indices (mla_entry).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../checks.h"
#include "mla_slots.h"
#include "registry.h"
#include "serial_work.h"
#include "avx2.h"
#include "blas.h"
#include "sparse_mla_avx512.h"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "simd.h"

namespace indexcache {
namespace {

using cpu::exp_ps;

constexpr int kTile = 32;
constexpr int64_t kHeadBlock = 64;

// Row s of the cache as fp32 [D] (fp8_ds_mla only for D = 576).
template <int D>
void load_kv_row(const SparseMlaParams& p, int64_t slot, float* dst) {
  if constexpr (D == kMlaDim) {
    if (p.kv_dtype == DType::kFp8E4M3) {
      const uint8_t* row = static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes;
      float scales[4];
      std::memcpy(scales, row + kMlaLatent, 16);
      for (int i = 0; i < kMlaLatent; ++i) dst[i] = e4m3_to_float(row[i]) * scales[i / kQuantGroup];
      const uint8_t* rope = row + kMlaLatent + 16;
      for (int i = 0; i < kMlaRope; ++i) {
        uint16_t h;
        std::memcpy(&h, rope + 2 * i, 2);
        dst[kMlaLatent + i] = bf16_to_float(h);
      }
      return;
    }
  }
  if (p.kv_dtype == DType::kBFloat16) {
    const uint16_t* row = static_cast<const uint16_t*>(p.kv) + slot * D;
    for (int i = 0; i < D; ++i) dst[i] = bf16_to_float(row[i]);
  } else {
    std::memcpy(dst, static_cast<const float*>(p.kv) + slot * D, D * sizeof(float));
  }
}

// Row s of the cache as bf16 [D] (fp8 values are dequantized, then rounded to bf16).
template <int D>
void load_kv_row_bf16(const SparseMlaParams& p, int64_t slot, uint16_t* dst) {
  if (p.kv_dtype == DType::kBFloat16) {
    std::memcpy(dst, static_cast<const uint16_t*>(p.kv) + slot * D, D * 2);
    return;
  }
  if constexpr (D == kMlaDim) {
    if (p.kv_dtype == DType::kFp8E4M3) {
      mla_fp8_row_to_bf16(static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes, dst);
      return;
    }
  }
  float tmp[D];
  load_kv_row<D>(p, slot, tmp);
  for (int i = 0; i < D; ++i) dst[i] = float_to_bf16(tmp[i]);
}

float q_elem(const SparseMlaParams& p, int64_t i) {
  return p.q_dtype == DType::kFloat32 ? static_cast<const float*>(p.q)[i]
                                      : bf16_to_float(static_cast<const uint16_t*>(p.q)[i]);
}

void store_out(const SparseMlaParams& p, int64_t i, float v) {
  if (p.q_dtype == DType::kFloat32) {
    static_cast<float*>(p.out)[i] = v;
  } else {
    static_cast<uint16_t*>(p.out)[i] = float_to_bf16(v);
  }
}

// Softmax over scores [nh][n] in place -> probabilities; writes lse per head, NaN for a
// head with a non-finite score or a NaN / +inf sink (the caller then writes NaN out;
// docs/ops.md). sinks [nh] or nullptr: each head's sink joins its denominator (and its max).
void softmax_rows(float* s, int64_t nh, int64_t n, int64_t ld, float* lse, const float* sinks) {
  for (int64_t hh = 0; hh < nh; ++hh) {
    float* row = s + hh * ld;
    const float sink = sinks != nullptr ? sinks[hh] : -std::numeric_limits<float>::infinity();
    float m = -std::numeric_limits<float>::infinity();
    float z = 0.f;  // 0, or NaN once a score is NaN or +-inf (x - x)
    for (int64_t j = 0; j < n; ++j) {
      m = std::max(m, row[j]);
      z += row[j] - row[j];
    }
    if (z != z || !(sink < std::numeric_limits<float>::infinity())) {
      lse[hh] = quiet_nan();
      continue;
    }
    m = std::max(m, sink);
    double sum = std::exp(sink - m);  // 0 for no sink (-inf)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - m);
      sum += row[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    lse[hh] = m + static_cast<float>(std::log(sum));
  }
}

// ------------------------------------------------------------------ bf16 path
//
// Heads run across the 16 lanes, so neither product needs the keys transposed:
//   S^T[key][h] = Σ_p bcast(k_row[key] pair p) · qT[p][h..h+15]   (vdpbf16ps)
//   O^T[v][h]   = Σ_k bcast(V[k][v]) · P[k][h..h+15]                  (fp32 FMA, P fp32)
// or, with 16 heads or fewer, O[h][v..v+15] = Σ_k bcast(P[k][h]) · V[k][v..v+15] (pv_heads).
// K rows are read in place from a bf16 cache (fp8 rows are dequantized to bf16 once).

// A head block is NV 16-lane vectors: NV = 2 (32 heads) in general, NV = 1 when h_q <= 16 (a
// tensor-parallel rank's share: V3.2 at TP 8 has 16 heads, GLM-5 8), so few heads are not padded
// to 32. Scores and probabilities are st[key][16 * NV], the output O^T[v][16 * NV].

// S^T[j][0:16NV] for keys j0..j0+KB-1 of one head block (rows of D bf16, D / 2 pairs).
template <int D, int KB, int NV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void qk_keys(const uint32_t* qT, int64_t ldq,
                                                                              const uint32_t* const* krows,
                                                                              float scale, float* st) {
  __m512 a[KB][NV];
  for (int j = 0; j < KB; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qT + p * ldq + 16 * v);
    for (int j = 0; j < KB; ++j) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(krows[j][p]));
      for (int v = 0; v < NV; ++v) a[j][v] = _mm512_dpbf16_ps(a[j][v], kb, q[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < KB; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + (j * NV + v) * 16, _mm512_mul_ps(a[j][v], sc));
}

// 8 heads or fewer (GLM-5 at TP 8): S^T[j][0:8] for keys j0..j0+KB-1 with 16 lanes = 8 heads x 2
// channel pairs, so the heads fill a whole vector: lanes 2i, 2i + 1 of qQ[pq] hold head i's pairs
// 2pq, 2pq + 1 (D / 4 quads of 4 bf16), a key's quad is one 64-bit broadcast, and the two halves
// of a head are added once per key. Lanes 8..15 of st are 0 (no heads there).
template <int D, int KB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void qk_keys8(const uint32_t* qQ,
                                                                               const uint32_t* const* krows,
                                                                               float scale, float* st) {
  __m512 a[KB];
  for (int j = 0; j < KB; ++j) a[j] = _mm512_setzero_ps();
  for (int pq = 0; pq < D / 4; ++pq) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qQ + pq * 16);
    for (int j = 0; j < KB; ++j) {
      int64_t quad;
      std::memcpy(&quad, krows[j] + 2 * pq, sizeof(quad));
      a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_set1_epi64(quad), q);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < KB; ++j) {
    const __m512 x = _mm512_add_ps(a[j], _mm512_permute_ps(a[j], 0xB1));
    _mm512_storeu_ps(st + j * 16, _mm512_mul_ps(_mm512_maskz_permutexvar_ps(0x00FF, even, x), sc));
  }
}

// O^T[v0..v0+C][0:16NV] += Σ_k V[k][v] · P[k][0:16NV] over one chunk of key pairs, in fp32: P stays
// fp32 (rounding the probabilities to bf16 for vdpbf16ps would add ~2e-3 relative error, a
// hundred times what the other paths carry), and each bf16 value of a pair vt[kp][v] =
// (V[2kp][v], V[2kp+1][v]) is exact in fp32 (a shift or a mask of its 32 bits).
template <int NV, int C>
__attribute__((target("avx512f,avx512bw"))) inline void pv_cols(const float* pt, const uint32_t* vt, int64_t ldv,
                                                                 int64_t pairs, float* ot) {
  constexpr int LH = 16 * NV;
  __m512 a[C][NV];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < NV; ++v) a[c][v] = _mm512_loadu_ps(ot + c * LH + 16 * v);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const float* pe = pt + 2 * kp * LH;
    __m512 e[NV], o[NV];
    for (int v = 0; v < NV; ++v) {
      e[v] = _mm512_loadu_ps(pe + 16 * v);
      o[v] = _mm512_loadu_ps(pe + LH + 16 * v);
    }
    const uint32_t* vr = vt + kp * ldv;
    for (int c = 0; c < C; ++c) {
      const __m512 ve = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(vr[c] << 16)));
      const __m512 vo = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(vr[c] & 0xFFFF0000u)));
      for (int v = 0; v < NV; ++v) a[c][v] = _mm512_fmadd_ps(vo, o[v], _mm512_fmadd_ps(ve, e[v], a[c][v]));
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + c * LH + 16 * v, a[c][v]);
}

// Few heads (h_q <= 16): O[h][c0 + 0:16CB] = Σ_k P[k][h] · V[k][c0 + 0:16CB] for HB heads from h0,
// value columns across the lanes, read straight from the bf16 key rows (exact in fp32) and each
// reused for HB heads; P[k][h] (fp32, st[k][16]) is broadcast. With heads across the lanes
// instead, 8 heads would fill half a vector and every value would need a broadcast of its own.
template <int HB, int CB>
__attribute__((target("avx512f,avx512bw"))) inline void pv_heads(const float* st, const uint32_t* const* krows,
                                                                  int64_t n, int64_t h0, int64_t c0, float* o,
                                                                  int64_t ldo) {
  __m512 a[HB][CB];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < CB; ++c) a[h][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; ++k) {
    const uint16_t* vr = reinterpret_cast<const uint16_t*>(krows[k]) + c0;
    __m512 v[CB];
    for (int c = 0; c < CB; ++c)
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * c))), 16));
    for (int h = 0; h < HB; ++h) {
      const __m512 pb = _mm512_set1_ps(st[k * 16 + h0 + h]);
      for (int c = 0; c < CB; ++c) a[h][c] = _mm512_fmadd_ps(pb, v[c], a[h][c]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(o + (h0 + h) * ldo + c0 + 16 * c, a[h][c]);
}

// Softmax over the scores st[k][0:16NV] (keys k < n, heads h0.. across the lanes) in place ->
// probabilities, rows n..rows-1 zeroed; per head its max, sum and NaN flag (bad: NaN when a score
// or its sink is NaN / +inf). sinks [h_q] or nullptr.
template <int NV>
__attribute__((target("avx512f,avx512bw"))) void softmax_heads(float* st, int64_t n, int64_t rows, const float* sinks,
                                                                int64_t h0, int64_t h_q, float* mx, float* sum,
                                                                float* bad) {
  constexpr int LH = 16 * NV;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // z: 0 per head, NaN once one of its scores is NaN or +-inf (x - x); such heads get NaN
  // out and lse (docs/ops.md), one subtraction per score instead of a pass over the inputs.
  __m512 m[NV], z[NV], sm[NV];
  for (int v = 0; v < NV; ++v) {
    m[v] = _mm512_set1_ps(-kInf);
    z[v] = sm[v] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < n; ++k)
    for (int v = 0; v < NV; ++v) {
      const __m512 x = _mm512_loadu_ps(st + k * LH + 16 * v);
      m[v] = _mm512_max_ps(m[v], x);
      z[v] = _mm512_add_ps(z[v], _mm512_sub_ps(x, x));
    }
  if (sinks != nullptr) {
    // The sinks join max and sum (exp(-inf) would come out ~1e-38 from exp_ps: masked to 0);
    // a NaN / +inf sink flags its head like a non-finite score.
    alignas(64) float sk[LH], skbad[LH];
    for (int64_t hh = 0; hh < LH; ++hh) {
      const float x = h0 + hh < h_q ? sinks[h0 + hh] : -kInf;
      const bool ok = x < kInf;
      sk[hh] = ok ? x : -kInf;
      skbad[hh] = ok ? 0.f : quiet_nan();
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 kv = _mm512_load_ps(sk + 16 * v);
      m[v] = _mm512_max_ps(m[v], kv);
      z[v] = _mm512_add_ps(z[v], _mm512_load_ps(skbad + 16 * v));
      sm[v] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(kv, _mm512_set1_ps(-kInf), _CMP_NEQ_OQ),
                                  exp_ps(_mm512_sub_ps(kv, m[v])));
    }
  }
  for (int64_t k = 0; k < n; ++k)
    for (int v = 0; v < NV; ++v) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(st + k * LH + 16 * v), m[v]));
      _mm512_storeu_ps(st + k * LH + 16 * v, e);
      sm[v] = _mm512_add_ps(sm[v], e);
    }
  __m512 inv[NV];
  for (int v = 0; v < NV; ++v) {
    _mm512_store_ps(bad + 16 * v, z[v]);
    _mm512_store_ps(mx + 16 * v, m[v]);
    _mm512_store_ps(sum + 16 * v, sm[v]);
    inv[v] = _mm512_div_ps(_mm512_set1_ps(1.0f), sm[v]);
  }
  // P[k][h] = e[k][h] / sum[h] in place; a missing odd key (row n) contributes 0.
  for (int64_t k = 0; k < n; ++k)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(st + k * LH + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(st + k * LH + 16 * v), inv[v]));
  std::fill_n(st + n * LH, (rows - n) * LH, 0.f);
}

// One row's bf16 operands: key row pointers krows[0:2*pairs) (an odd count padded with a zero row),
// V as key pairs vt[pairs][d_v] (pair_values: for the 32-head blocks' P·V), q as pairs with heads
// across lanes qT[D / 2][h_pad], or (quads: 8 heads or fewer) as qk_keys8's qQ[D / 4][16].
struct RowBf16 {
  std::vector<uint16_t> deq;  // fp8 rows dequantized to bf16 [n][576]
  std::vector<const uint32_t*> krows;
  std::vector<uint32_t> vt, qT;
  std::vector<float> st, ot;  // scores / probabilities [2 * pairs][LH], O^T [d_v][LH]
};

template <int D>
__attribute__((target("avx512f,avx512bw"))) void prepare_row_bf16(const SparseMlaParams& p, int64_t t,
                                                                   const std::vector<int32_t>& slots, int64_t h_pad,
                                                                   bool pair_values, bool quads, RowBf16& w) {
  constexpr int kPairs = D / 2;
  static const uint16_t zero_row[kMlaDim] = {};
  const int64_t n = static_cast<int64_t>(slots.size()), pairs = (n + 1) / 2;
  w.krows.resize(pairs * 2);
  if (p.kv_dtype == DType::kBFloat16) {
    for (int64_t j = 0; j < n; ++j)
      w.krows[j] = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.kv) + slots[j] * D);
  } else {
    w.deq.resize(n * D);
    for (int64_t j = 0; j < n; ++j) {
      load_kv_row_bf16<D>(p, slots[j], w.deq.data() + j * D);
      w.krows[j] = reinterpret_cast<const uint32_t*>(w.deq.data() + j * D);
    }
  }
  if (n % 2) w.krows[n] = reinterpret_cast<const uint32_t*>(zero_row);
  if (pair_values) {
    w.vt.resize(pairs * p.d_v);
    for (int64_t kp = 0; kp < pairs; ++kp)
      cpu::interleave_keys(reinterpret_cast<const uint16_t*>(w.krows[2 * kp]),
                           reinterpret_cast<const uint16_t*>(w.krows[2 * kp + 1]), p.d_v, w.vt.data() + kp * p.d_v);
  }
  const uint32_t* qsrc = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.q) + t * p.h_q * D);
  if (quads) {
    w.qT.assign(kPairs * 8, 0);
    for (int64_t h = 0; h < p.h_q; ++h)
      for (int pp = 0; pp < kPairs; ++pp) w.qT[(pp / 2) * 16 + 2 * h + pp % 2] = qsrc[h * kPairs + pp];
    return;
  }
  w.qT.assign(kPairs * h_pad, 0);
  for (int64_t h = 0; h < p.h_q; ++h)
    for (int pp = 0; pp < kPairs; ++pp) w.qT[pp * h_pad + h] = qsrc[h * kPairs + pp];
}

// Row t over its selected slots, head blocks of 16 * NV heads.
template <int D, int NV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void row_bf16(const SparseMlaParams& p, int64_t t,
                                                                        const std::vector<int32_t>& slots) {
  constexpr int LH = 16 * NV, KB = 16 / NV, C = 16 / NV;  // 16 accumulators in each product
  const int64_t n = static_cast<int64_t>(slots.size()), pairs = (n + 1) / 2;
  const int64_t h_pad = (p.h_q + LH - 1) / LH * LH;
  static thread_local RowBf16 w;
  const bool quads = NV == 1 && p.h_q <= 8;
  prepare_row_bf16<D>(p, t, slots, h_pad, NV == 2, quads, w);
  w.st.resize(pairs * 2 * LH);
  w.ot.resize(p.d_v * LH);
  float* st = w.st.data();
  for (int64_t h0 = 0; h0 < p.h_q; h0 += LH) {
    const uint32_t* qb = w.qT.data() + h0;
    int64_t j = 0;
    if (quads) {
      for (; j + KB <= n; j += KB) qk_keys8<D, KB>(qb, w.krows.data() + j, p.sm_scale, st + j * LH);
      for (; j < n; ++j) qk_keys8<D, 1>(qb, w.krows.data() + j, p.sm_scale, st + j * LH);
    }
    for (; j + KB <= n; j += KB) qk_keys<D, KB, NV>(qb, h_pad, w.krows.data() + j, p.sm_scale, st + j * LH);
    for (; j < n; ++j) qk_keys<D, 1, NV>(qb, h_pad, w.krows.data() + j, p.sm_scale, st + j * LH);
    alignas(64) float mx[LH], sum[LH], bad[LH];
    softmax_heads<NV>(st, n, 2 * pairs, p.sinks, h0, p.h_q, mx, sum, bad);
    const int64_t nh = std::min<int64_t>(LH, p.h_q - h0);
    // O^T[v][LH] (32-head blocks) or O[16][d_v] (few heads, pv_heads)
    int64_t ld_h = 1, ld_c = LH;
    if constexpr (NV == 1) {
      ld_h = p.d_v;
      ld_c = 1;
      // 8 heads x 32 columns per block where 8 heads remain: each converted value vector serves 8.
      for (int64_t c0 = 0; c0 < p.d_v; c0 += 64) {
        int64_t hh = 0;
        for (; hh + 8 <= nh; hh += 8)
          for (int64_t c = c0; c < c0 + 64; c += 32) pv_heads<8, 2>(st, w.krows.data(), n, hh, c, w.ot.data(), p.d_v);
        for (; hh < nh; hh += 4) pv_heads<4, 4>(st, w.krows.data(), n, hh, c0, w.ot.data(), p.d_v);
      }
    } else {
      // Chunks of 64 key pairs keep their P (16 KB) in L1 while every value column sweeps it.
      std::fill(w.ot.begin(), w.ot.end(), 0.f);
      for (int64_t c0 = 0; c0 < pairs; c0 += 64) {
        const int64_t cn = std::min<int64_t>(64, pairs - c0);
        for (int64_t v0 = 0; v0 < p.d_v; v0 += C)
          pv_cols<NV, C>(st + 2 * c0 * LH, w.vt.data() + c0 * p.d_v + v0, p.d_v, cn, w.ot.data() + v0 * LH);
      }
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = h0 + hh;
      const bool nan = bad[hh] != bad[hh];
      p.lse[t * p.h_q + h] = nan ? quiet_nan() : mx[hh] + std::log(sum[hh]);
      for (int64_t c = 0; c < p.d_v; ++c)
        store_out(p, (t * p.h_q + h) * p.d_v + c, nan ? quiet_nan() : w.ot[hh * ld_h + c * ld_c]);
    }
  }
}

template <int D>
void row_bf16_heads(const SparseMlaParams& p, int64_t t, const std::vector<int32_t>& slots) {
  if (p.h_q <= 16) {
    row_bf16<D, 1>(p, t, slots);
  } else {
    row_bf16<D, 2>(p, t, slots);
  }
}

// ------------------------------------------------------------------ portable fp32 path

// The body of row_f32 for rows of D, inlined into each of its ISA clones.
template <int D>
__attribute__((always_inline)) inline void row_f32_body(const SparseMlaParams& p, int64_t t, int64_t h0, int64_t nh,
                                                        const std::vector<int32_t>& slots) {
  const int64_t n = static_cast<int64_t>(slots.size());
  std::vector<float> kv(n * D);
  for (int64_t j = 0; j < n; ++j) load_kv_row<D>(p, slots[j], kv.data() + j * D);
  std::vector<float> q(nh * D), s(nh * n), o(nh * p.d_v, 0.f), lse(nh);
  for (int64_t i = 0; i < nh * D; ++i) q[i] = q_elem(p, (t * p.h_q + h0) * D + i);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      const float* kr = kv.data() + j * D;
      const float* qr = q.data() + hh * D;
      for (int c = 0; c < D; ++c) acc += qr[c] * kr[c];
      s[hh * n + j] = acc * p.sm_scale;
    }
  softmax_rows(s.data(), nh, n, n, lse.data(), p.sinks != nullptr ? p.sinks + h0 : nullptr);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t j = 0; j < n; ++j) {
      const float w = s[hh * n + j];
      const float* vr = kv.data() + j * D;
      float* orow = o.data() + hh * p.d_v;
      for (int64_t c = 0; c < p.d_v; ++c) orow[c] += w * vr[c];
    }
  for (int64_t i = 0; i < nh; ++i) {
    p.lse[t * p.h_q + h0 + i] = lse[i];
    const bool bad = lse[i] != lse[i];  // a non-finite score (softmax_rows)
    for (int64_t c = 0; c < p.d_v; ++c)
      store_out(p, (t * p.h_q + h0 + i) * p.d_v + c, bad ? quiet_nan() : o[i * p.d_v + c]);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void row_f32(const SparseMlaParams& p, int64_t t,
                                                                          int64_t h0, int64_t nh,
                                                                          const std::vector<int32_t>& slots) {
  if (p.d_qk == kMlaDim) {
    row_f32_body<kMlaDim>(p, t, h0, nh, slots);
  } else {
    row_f32_body<kMlaLatent>(p, t, h0, nh, slots);
  }
}

}  // namespace

// Below this many multiply-adds (mla_work) a call runs on the calling thread: a 16-head decode row
// over 512 keys (9.4M) is 0.15 ms on one core, and 7-30 ms at 2 threads when another process holds
// the other core (docs/profiling.md, seventh round); with both cores free, splitting it on the
// AVX-512 vector kernels measured slower too (Zen 5, avx512bf16: 1.07 -> 1.28 ms a step, ninth round).
constexpr int64_t kMlaSerialWork = int64_t{1} << 25;
// The AMX tiles' and the AVX2 kernels' bound: there a decode row of 8 heads or more (4.5M at 8,
// 9.4M at 16) splits its keys. On a quiet AMX Xeon that halved a 16-head row's calls at 2 threads
// (2.6-2.9 -> 1.3-1.5 ms a step; docs/profiling.md, 2026-12-06); on a Zen 3, where the AVX2 kernel
// takes 0.35 ms for that row, 2.7-4.5 -> 1.9-2.4 ms a step (docs/profiling.md, twelfth round).
// Under load `generate`'s --decode-threads auto runs one thread, which opens no region.
constexpr int64_t kMlaSplitEarlyWork = int64_t{1} << 22;

int64_t mla_serial_work(MlaKernel kernel) {
  static const int64_t vec = cpu::serial_work_bound("INDEXCACHE_SPARSE_MLA_SERIAL_WORK", kMlaSerialWork);
  static const int64_t early = cpu::serial_work_bound("INDEXCACHE_SPARSE_MLA_SERIAL_WORK", kMlaSplitEarlyWork);
  TORCH_CHECK(vec >= 0, "INDEXCACHE_SPARSE_MLA_SERIAL_WORK must be a non-negative integer (multiply-adds), got '",
              std::getenv("INDEXCACHE_SPARSE_MLA_SERIAL_WORK"), "'");
  return kernel == MlaKernel::kVector ? vec : early;
}

void sparse_mla_cpu(const SparseMlaParams& p) {
  if (p.s_q == 0 || p.h_q == 0) return;  // nothing to write (zero heads once divided by zero below)
  // isa.h: bf16 / fp8 on blas or avx512bf16 where the CPU has them, fp32 on avx512bf16 (its FMA
  // kernels), everything on AVX2-only CPUs on avx2; portable only where it is the path requested or
  // the only one.
  const DType dt = sparse_mla_dtype(p.q_dtype, p.kv_dtype);
  const CpuPath path = cpu_op_path(CpuOp::kSparseMla, dt);
  if (path == CpuPath::kAvx512Bf16 && dt == DType::kFloat32) {
    sparse_mla_avx512_f32(p);
    return;
  }
  if (path == CpuPath::kAvx2) {
    sparse_mla_avx2(p);  // every dtype
    return;
  }
  if (path == CpuPath::kBlas) {
    TORCH_CHECK(sparse_mla_blas(p), "indexcache: the blas CPU path declined a sparse_mla dtype isa.cpp gives it");
    return;
  }
  const bool bf16 = path == CpuPath::kAvx512Bf16;
  const int64_t hb = bf16 ? p.h_q : std::min<int64_t>(p.h_q, kHeadBlock);
  const int64_t head_blocks = (p.h_q + hb - 1) / hb;
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / head_blocks;
      const int64_t h0 = (task % head_blocks) * hb, nh = std::min(hb, p.h_q - h0);
      slots.clear();
      for (int64_t j = 0; j < p.topk + p.n_extra; ++j) {
        const int32_t s = mla_entry(p, t, j);
        if (s >= 0) slots.push_back(s);
      }
      if (slots.empty()) {  // out 0; lse log(exp(sink)), -inf without sinks
        for (int64_t i = 0; i < nh; ++i) {
          p.lse[t * p.h_q + h0 + i] = mla_sink(p, h0 + i);
          for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h0 + i) * p.d_v + c, 0.f);
        }
        continue;
      }
      if (bf16) {
        // one task per row: hb == h_q on this path
        if (p.d_qk == kMlaDim) {
          row_bf16_heads<kMlaDim>(p, t, slots);
        } else {
          row_bf16_heads<kMlaLatent>(p, t, slots);
        }
      } else {
        row_f32(p, t, h0, nh, slots);
      }
    }
  };
  if (mla_runs_inline(p, MlaKernel::kVector)) {
    body(0, p.s_q * head_blocks);
  } else {
    at::parallel_for(0, p.s_q * head_blocks, 1, body);
  }
}

namespace {

void sparse_mla_op(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices, double sm_scale,
                   int64_t d_v, at::Tensor& out, at::Tensor& lse, const std::optional<at::Tensor>& sinks,
                   const std::optional<at::Tensor>& extra_indices) {
  const SparseMlaParams p = make_sparse_mla_params(q, kv_cache, indices, sm_scale, d_v, out, lse, sinks, extra_indices);
  check_slots_in_range(indices, p.num_slots, "indices");
  if (extra_indices.has_value()) check_slots_in_range(*extra_indices, p.num_slots, "extra_indices");
  sparse_mla_cpu(p);
}

}  // namespace

void register_sparse_mla_cpu(torch::Library& m) {
  m.impl("sparse_mla", &sparse_mla_op);
}

}  // namespace indexcache
