// CPU sparse MLA (absorbed form, DESIGN.md §5): per query row, attention of h_q heads over
// the selected cache slots. Two passes per (row, head block): scores for every selected
// key, an exact softmax, then P·V. With AVX-512 BF16 the scores run on vdpbf16ps (exact
// bf16 products, fp32 sums) and P·V on fp32 FMAs with P kept in fp32; fp32 inputs take a
// portable fp32 path.
// Every path is a template on the row width D = d_qk (576 for DSA, 512 for DeepSeek-V4's K=V
// head, whose value is the whole row), so the 576 loops keep their compile-time bounds; a row's
// keys are the valid entries of indices and then of extra_indices (mla_entry).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"
#include "registry.h"
#include "avx2.h"
#include "blas.h"
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
//   O^T[v][h]   = Σ_kp bcast(V pair (2kp, 2kp+1) at v) · P[kp][h..h+15]
// K rows are read in place from a bf16 cache (fp8 rows are dequantized to bf16 once).

constexpr int kLaneHeads = 32;  // heads per block: two 16-lane vectors

// S^T[j][0:32] for keys j0..j0+KB-1 of one 32-head block (rows of D bf16, D / 2 pairs).
template <int D, int KB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void qk_keys(const uint32_t* qT, int64_t ldq,
                                                                              const uint32_t* const* krows,
                                                                              float scale, float* st) {
  __m512 a0[KB], a1[KB];
  for (int j = 0; j < KB; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qT + p * ldq);
    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qT + p * ldq + 16);
    for (int j = 0; j < KB; ++j) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(krows[j][p]));
      a0[j] = _mm512_dpbf16_ps(a0[j], kb, q0);
      a1[j] = _mm512_dpbf16_ps(a1[j], kb, q1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < KB; ++j) {
    _mm512_storeu_ps(st + j * kLaneHeads, _mm512_mul_ps(a0[j], sc));
    _mm512_storeu_ps(st + j * kLaneHeads + 16, _mm512_mul_ps(a1[j], sc));
  }
}

// O^T[v0..v0+8][0:32] += Σ_k V[k][v] · P[k][0:32] over one chunk of key pairs, in fp32: P stays
// fp32 (rounding the probabilities to bf16 for vdpbf16ps would add ~2e-3 relative error, a
// hundred times what the other paths carry), and each bf16 value of a pair vt[kp][v] =
// (V[2kp][v], V[2kp+1][v]) is exact in fp32 (a shift or a mask of its 32 bits).
__attribute__((target("avx512f,avx512bw"))) inline void pv_cols(const float* pt, const uint32_t* vt, int64_t ldv,
                                                                 int64_t pairs, float* ot) {
  __m512 a0[8], a1[8];
  for (int c = 0; c < 8; ++c) {
    a0[c] = _mm512_loadu_ps(ot + c * kLaneHeads);
    a1[c] = _mm512_loadu_ps(ot + c * kLaneHeads + 16);
  }
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const float* pe = pt + 2 * kp * kLaneHeads;
    const __m512 e0 = _mm512_loadu_ps(pe), e1 = _mm512_loadu_ps(pe + 16);
    const __m512 o0 = _mm512_loadu_ps(pe + kLaneHeads), o1 = _mm512_loadu_ps(pe + kLaneHeads + 16);
    const uint32_t* vr = vt + kp * ldv;
    for (int c = 0; c < 8; ++c) {
      const __m512 ve = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(vr[c] << 16)));
      const __m512 vo = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(vr[c] & 0xFFFF0000u)));
      a0[c] = _mm512_fmadd_ps(vo, o0, _mm512_fmadd_ps(ve, e0, a0[c]));
      a1[c] = _mm512_fmadd_ps(vo, o1, _mm512_fmadd_ps(ve, e1, a1[c]));
    }
  }
  for (int c = 0; c < 8; ++c) {
    _mm512_storeu_ps(ot + c * kLaneHeads, a0[c]);
    _mm512_storeu_ps(ot + c * kLaneHeads + 16, a1[c]);
  }
}

// vt[kp][c] = (a[c], b[c]) as a bf16 pair, for two bf16 rows of d_v values.
__attribute__((target("avx512f,avx512bw"))) void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t d_v,
                                                                   uint32_t* dst) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t c = 0; c < d_v; c += 32) {
    const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, lo, vb));
    _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
  }
}

// Softmax over the scores st[k][0:32] (keys k < n, heads h0..h0+31 across the lanes) in place ->
// probabilities, rows n..rows-1 zeroed; per head its max, sum and NaN flag (bad: NaN when a score
// or its sink is NaN / +inf). sinks [h_q] or nullptr.
__attribute__((target("avx512f,avx512bw"))) void softmax_heads32(float* st, int64_t n, int64_t rows,
                                                                  const float* sinks, int64_t h0, int64_t h_q,
                                                                  float* mx, float* sum, float* bad) {
  // z: 0 per head, NaN once one of its scores is NaN or +-inf (x - x); such heads get NaN
  // out and lse (docs/ops.md), one subtraction per score instead of a pass over the inputs.
  __m512 m0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  __m512 z0 = _mm512_setzero_ps(), z1 = z0;
  for (int64_t k = 0; k < n; ++k) {
    const __m512 v0 = _mm512_loadu_ps(st + k * kLaneHeads);
    const __m512 v1 = _mm512_loadu_ps(st + k * kLaneHeads + 16);
    m0 = _mm512_max_ps(m0, v0);
    m1 = _mm512_max_ps(m1, v1);
    z0 = _mm512_add_ps(z0, _mm512_sub_ps(v0, v0));
    z1 = _mm512_add_ps(z1, _mm512_sub_ps(v1, v1));
  }
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  if (sinks != nullptr) {
    // The sinks join max and sum (exp(-inf) would come out ~1e-38 from exp_ps: masked to 0);
    // a NaN / +inf sink flags its head like a non-finite score.
    alignas(64) float sk[kLaneHeads], skbad[kLaneHeads];
    for (int64_t hh = 0; hh < kLaneHeads; ++hh) {
      const float v = h0 + hh < h_q ? sinks[h0 + hh] : -std::numeric_limits<float>::infinity();
      const bool ok = v < std::numeric_limits<float>::infinity();
      sk[hh] = ok ? v : -std::numeric_limits<float>::infinity();
      skbad[hh] = ok ? 0.f : quiet_nan();
    }
    const __m512 k0 = _mm512_load_ps(sk), k1 = _mm512_load_ps(sk + 16);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    m0 = _mm512_max_ps(m0, k0);
    m1 = _mm512_max_ps(m1, k1);
    z0 = _mm512_add_ps(z0, _mm512_load_ps(skbad));
    z1 = _mm512_add_ps(z1, _mm512_load_ps(skbad + 16));
    s0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(k0, ninf, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(k0, m0)));
    s1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(k1, ninf, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(k1, m1)));
  }
  for (int64_t k = 0; k < n; ++k) {
    const __m512 e0 = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(st + k * kLaneHeads), m0));
    const __m512 e1 = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(st + k * kLaneHeads + 16), m1));
    _mm512_storeu_ps(st + k * kLaneHeads, e0);
    _mm512_storeu_ps(st + k * kLaneHeads + 16, e1);
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
  }
  _mm512_store_ps(bad, z0);
  _mm512_store_ps(bad + 16, z1);
  _mm512_store_ps(mx, m0);
  _mm512_store_ps(mx + 16, m1);
  _mm512_store_ps(sum, s0);
  _mm512_store_ps(sum + 16, s1);
  const __m512 i0 = _mm512_div_ps(_mm512_set1_ps(1.0f), s0), i1 = _mm512_div_ps(_mm512_set1_ps(1.0f), s1);
  // P[k][h] = e[k][h] / sum[h] in place; a missing odd key (row n) contributes 0.
  for (int64_t k = 0; k < n; ++k) {
    float* e = st + k * kLaneHeads;
    _mm512_storeu_ps(e, _mm512_mul_ps(_mm512_loadu_ps(e), i0));
    _mm512_storeu_ps(e + 16, _mm512_mul_ps(_mm512_loadu_ps(e + 16), i1));
  }
  std::fill_n(st + n * kLaneHeads, (rows - n) * kLaneHeads, 0.f);
}

template <int D>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void row_bf16(const SparseMlaParams& p, int64_t t,
                                                                        const std::vector<int32_t>& slots) {
  constexpr int kPairs = D / 2;
  const int64_t n = static_cast<int64_t>(slots.size());
  const int64_t pairs = (n + 1) / 2;
  static thread_local std::vector<uint16_t> deq;  // fp8 rows dequantized to bf16 [n][576]
  static thread_local std::vector<const uint32_t*> krows;
  static const uint16_t zero_row[kMlaDim] = {};
  krows.resize(pairs * 2);
  if (p.kv_dtype == DType::kBFloat16) {
    for (int64_t j = 0; j < n; ++j)
      krows[j] = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.kv) + slots[j] * D);
  } else {
    deq.resize(n * D);
    for (int64_t j = 0; j < n; ++j) {
      load_kv_row_bf16<D>(p, slots[j], deq.data() + j * D);
      krows[j] = reinterpret_cast<const uint32_t*>(deq.data() + j * D);
    }
  }
  if (n % 2) krows[n] = reinterpret_cast<const uint32_t*>(zero_row);
  // V as key pairs [pairs][d_v] (shared by all head blocks).
  static thread_local std::vector<uint32_t> vt;
  vt.resize(pairs * p.d_v);
  for (int64_t kp = 0; kp < pairs; ++kp)
    interleave_rows(reinterpret_cast<const uint16_t*>(krows[2 * kp]), reinterpret_cast<const uint16_t*>(krows[2 * kp + 1]),
                    p.d_v, vt.data() + kp * p.d_v);
  // q as pairs with heads across lanes: qT[p][h], heads padded to a multiple of 32.
  const int64_t h_pad = (p.h_q + kLaneHeads - 1) / kLaneHeads * kLaneHeads;
  static thread_local std::vector<uint32_t> qT;
  qT.assign(kPairs * h_pad, 0);
  const uint32_t* qsrc = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.q) + t * p.h_q * D);
  for (int64_t h = 0; h < p.h_q; ++h)
    for (int pp = 0; pp < kPairs; ++pp) qT[pp * h_pad + h] = qsrc[h * kPairs + pp];
  static thread_local std::vector<float> st, ot;
  st.resize(pairs * 2 * kLaneHeads);
  ot.resize(p.d_v * kLaneHeads);
  for (int64_t h0 = 0; h0 < p.h_q; h0 += kLaneHeads) {
    const uint32_t* qb = qT.data() + h0;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) qk_keys<D, 8>(qb, h_pad, krows.data() + j, p.sm_scale, st.data() + j * kLaneHeads);
    for (; j < n; ++j) qk_keys<D, 1>(qb, h_pad, krows.data() + j, p.sm_scale, st.data() + j * kLaneHeads);
    alignas(64) float mx[kLaneHeads], sum[kLaneHeads], bad[kLaneHeads];
    softmax_heads32(st.data(), n, 2 * pairs, p.sinks, h0, p.h_q, mx, sum, bad);
    // Chunks of 64 key pairs keep their P (16 KB) in L1 while every value column sweeps it.
    std::fill(ot.begin(), ot.end(), 0.f);
    for (int64_t c0 = 0; c0 < pairs; c0 += 64) {
      const int64_t cn = std::min<int64_t>(64, pairs - c0);
      for (int64_t v0 = 0; v0 < p.d_v; v0 += 8)
        pv_cols(st.data() + 2 * c0 * kLaneHeads, vt.data() + c0 * p.d_v + v0, p.d_v, cn, ot.data() + v0 * kLaneHeads);
    }
    const int64_t nh = std::min<int64_t>(kLaneHeads, p.h_q - h0);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = h0 + hh;
      if (bad[hh] != bad[hh]) {
        p.lse[t * p.h_q + h] = quiet_nan();
        for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h) * p.d_v + c, quiet_nan());
        continue;
      }
      p.lse[t * p.h_q + h] = mx[hh] + std::log(sum[hh]);
      for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h) * p.d_v + c, ot[c * kLaneHeads + hh]);
    }
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

void sparse_mla_cpu(const SparseMlaParams& p) {
  if (p.s_q == 0 || p.h_q == 0) return;  // nothing to write (zero heads once divided by zero below)
  // isa.h: bf16 / fp8 on blas or avx512bf16 where the CPU has them, fp32 (and everything on AVX2-only
  // CPUs) on avx2; portable only where it is the path requested or the only one.
  const CpuPath path = cpu_op_path(CpuOp::kSparseMla, sparse_mla_dtype(p.q_dtype, p.kv_dtype));
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
  at::parallel_for(0, p.s_q * head_blocks, 1, [&](int64_t begin, int64_t end) {
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
          row_bf16<kMlaDim>(p, t, slots);
        } else {
          row_bf16<kMlaLatent>(p, t, slots);
        }
      } else {
        row_f32(p, t, h0, nh, slots);
      }
    }
  });
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
