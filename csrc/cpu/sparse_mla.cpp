// CPU sparse MLA (absorbed form, DESIGN.md §5): per query row, attention of h_q heads over
// the selected cache slots. Two passes per (row, head block): scores for every selected
// key, an exact softmax, then P·V. With AVX-512 BF16 both products run on vdpbf16ps with
// fp32 accumulation over keys packed 32 at a time; fp32 inputs take a portable fp32 path.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"

namespace indexcache {
namespace {

constexpr int kTile = 32;
constexpr int64_t kHeadBlock = 64;
constexpr int kPairs = kMlaDim / 2;  // 288

bool mla_use_bf16(const SparseMlaParams& p) {
  return p.q_dtype == DType::kBFloat16 && p.kv_dtype != DType::kFloat32 && cpu_isa() == 0;
}

// Row s of the cache as fp32 [576].
void load_kv_row(const SparseMlaParams& p, int64_t slot, float* dst) {
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
  } else if (p.kv_dtype == DType::kBFloat16) {
    const uint16_t* row = static_cast<const uint16_t*>(p.kv) + slot * kMlaDim;
    for (int i = 0; i < kMlaDim; ++i) dst[i] = bf16_to_float(row[i]);
  } else {
    std::memcpy(dst, static_cast<const float*>(p.kv) + slot * kMlaDim, kMlaDim * sizeof(float));
  }
}

// Row s of the cache as bf16 [576] (fp8 values are dequantized, then rounded to bf16).
void load_kv_row_bf16(const SparseMlaParams& p, int64_t slot, uint16_t* dst) {
  if (p.kv_dtype == DType::kBFloat16) {
    std::memcpy(dst, static_cast<const uint16_t*>(p.kv) + slot * kMlaDim, kMlaDim * 2);
    return;
  }
  float tmp[kMlaDim];
  load_kv_row(p, slot, tmp);
  for (int i = 0; i < kMlaDim; ++i) dst[i] = float_to_bf16(tmp[i]);
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

// Softmax over scores [nh][n] in place -> probabilities; writes lse per head.
void softmax_rows(float* s, int64_t nh, int64_t n, int64_t ld, float* lse) {
  for (int64_t hh = 0; hh < nh; ++hh) {
    float* row = s + hh * ld;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
    double sum = 0.0;
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

template <int HB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void qk_heads(const uint32_t* qp, const uint32_t* kt,
                                                                               float scale, float* s, int64_t ld) {
  __m512 a0[HB], a1[HB];
  for (int i = 0; i < HB; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * kTile);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + p * kTile + 16);
    for (int i = 0; i < HB; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i * kPairs + p]));
      a0[i] = _mm512_dpbf16_ps(a0[i], qb, k0);
      a1[i] = _mm512_dpbf16_ps(a1[i], qb, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < HB; ++i) {
    _mm512_storeu_ps(s + i * ld, _mm512_mul_ps(a0[i], sc));
    _mm512_storeu_ps(s + i * ld + 16, _mm512_mul_ps(a1[i], sc));
  }
}

// O[h][v0:v0+64] += Σ_pairs P[h][pair] · V[pair][v0:v0+64] for 4 heads.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void pv_block(const uint32_t* pp, int64_t ldp,
                                                                               const uint32_t* vt, int pairs, float* o,
                                                                               int64_t ldo, int64_t d_v) {
  __m512 acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_loadu_ps(o + i * ldo + c * 16);
  for (int p = 0; p < pairs; ++p) {
    const uint32_t* vrow = vt + static_cast<int64_t>(p) * d_v;
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vrow + c * 16);
    for (int i = 0; i < 4; ++i) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * ldp + p]));
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pb, v[c]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + i * ldo + c * 16, acc[i][c]);
}

void row_bf16(const SparseMlaParams& p, int64_t t, int64_t h0, int64_t nh, const std::vector<int32_t>& slots) {
  const int64_t n = static_cast<int64_t>(slots.size());
  const int64_t n_pad = (n + kTile - 1) / kTile * kTile;
  // Query pairs [nh][288].
  std::vector<uint32_t> qp(nh * kPairs);
  const uint16_t* qsrc = static_cast<const uint16_t*>(p.q) + (t * p.h_q + h0) * kMlaDim;
  std::memcpy(qp.data(), qsrc, nh * kMlaDim * 2);
  std::vector<float> s(nh * n_pad);
  alignas(64) static thread_local uint32_t kt[kPairs * kTile];
  static thread_local std::vector<uint16_t> rows;  // [n_pad][576] bf16 rows of the selected keys
  rows.assign(n_pad * kMlaDim, 0);
  for (int64_t j = 0; j < n; ++j) load_kv_row_bf16(p, slots[j], rows.data() + j * kMlaDim);
  // Scores.
  for (int64_t j0 = 0; j0 < n_pad; j0 += kTile) {
    for (int jj = 0; jj < kTile; ++jj) {
      const uint32_t* r = reinterpret_cast<const uint32_t*>(rows.data() + (j0 + jj) * kMlaDim);
      for (int pp = 0; pp < kPairs; ++pp) kt[pp * kTile + jj] = r[pp];
    }
    int64_t hh = 0;
    for (; hh + 8 <= nh; hh += 8) qk_heads<8>(qp.data() + hh * kPairs, kt, p.sm_scale, s.data() + hh * n_pad + j0, n_pad);
    for (; hh < nh; ++hh) qk_heads<1>(qp.data() + hh * kPairs, kt, p.sm_scale, s.data() + hh * n_pad + j0, n_pad);
  }
  std::vector<float> lse(nh);
  softmax_rows(s.data(), nh, n, n_pad, lse.data());
  // Probabilities as bf16 pairs [nh][n_pad / 2] (padding keys get 0).
  const int64_t pairs = n_pad / 2;
  std::vector<uint32_t> pp(nh * pairs);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t k = 0; k < pairs; ++k) {
      const float a = 2 * k < n ? s[hh * n_pad + 2 * k] : 0.f;
      const float b = 2 * k + 1 < n ? s[hh * n_pad + 2 * k + 1] : 0.f;
      pp[hh * pairs + k] = static_cast<uint32_t>(float_to_bf16(a)) | (static_cast<uint32_t>(float_to_bf16(b)) << 16);
    }
  // V pairs [pairs][d_v]: (v[2k][c], v[2k+1][c]).
  std::vector<uint32_t> vt(pairs * p.d_v);
  for (int64_t k = 0; k < pairs; ++k) {
    const uint16_t* a = rows.data() + (2 * k) * kMlaDim;
    const uint16_t* b = rows.data() + (2 * k + 1) * kMlaDim;
    for (int64_t c = 0; c < p.d_v; ++c)
      vt[k * p.d_v + c] = static_cast<uint32_t>(a[c]) | (static_cast<uint32_t>(b[c]) << 16);
  }
  std::vector<float> o(nh * p.d_v, 0.f);
  int64_t hh = 0;
  for (; hh + 4 <= nh; hh += 4)
    for (int64_t c = 0; c < p.d_v; c += 64)
      pv_block(pp.data() + hh * pairs, pairs, vt.data() + c, static_cast<int>(pairs), o.data() + hh * p.d_v + c,
               p.d_v, p.d_v);
  for (; hh < nh; ++hh)
    for (int64_t k = 0; k < n; ++k) {
      const float w = bf16_to_float(static_cast<uint16_t>(k % 2 ? pp[hh * pairs + k / 2] >> 16 : pp[hh * pairs + k / 2]));
      for (int64_t c = 0; c < p.d_v; ++c) o[hh * p.d_v + c] += w * bf16_to_float(rows[k * kMlaDim + c]);
    }
  for (int64_t i = 0; i < nh; ++i) {
    p.lse[t * p.h_q + h0 + i] = lse[i];
    for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h0 + i) * p.d_v + c, o[i * p.d_v + c]);
  }
}

// ------------------------------------------------------------------ portable fp32 path

__attribute__((target_clones("avx512f", "avx2", "default"))) void row_f32(const SparseMlaParams& p, int64_t t,
                                                                          int64_t h0, int64_t nh,
                                                                          const std::vector<int32_t>& slots) {
  const int64_t n = static_cast<int64_t>(slots.size());
  std::vector<float> kv(n * kMlaDim);
  for (int64_t j = 0; j < n; ++j) load_kv_row(p, slots[j], kv.data() + j * kMlaDim);
  std::vector<float> q(nh * kMlaDim), s(nh * n), o(nh * p.d_v, 0.f), lse(nh);
  for (int64_t i = 0; i < nh * kMlaDim; ++i) q[i] = q_elem(p, (t * p.h_q + h0) * kMlaDim + i);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      const float* kr = kv.data() + j * kMlaDim;
      const float* qr = q.data() + hh * kMlaDim;
      for (int c = 0; c < kMlaDim; ++c) acc += qr[c] * kr[c];
      s[hh * n + j] = acc * p.sm_scale;
    }
  softmax_rows(s.data(), nh, n, n, lse.data());
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t j = 0; j < n; ++j) {
      const float w = s[hh * n + j];
      const float* vr = kv.data() + j * kMlaDim;
      float* orow = o.data() + hh * p.d_v;
      for (int64_t c = 0; c < p.d_v; ++c) orow[c] += w * vr[c];
    }
  for (int64_t i = 0; i < nh; ++i) {
    p.lse[t * p.h_q + h0 + i] = lse[i];
    for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h0 + i) * p.d_v + c, o[i * p.d_v + c]);
  }
}

}  // namespace

void sparse_mla_cpu(const SparseMlaParams& p) {
  const bool bf16 = mla_use_bf16(p);
  const int64_t hb = std::min<int64_t>(p.h_q, kHeadBlock);
  const int64_t head_blocks = (p.h_q + hb - 1) / hb;
  at::parallel_for(0, p.s_q * head_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / head_blocks;
      const int64_t h0 = (task % head_blocks) * hb, nh = std::min(hb, p.h_q - h0);
      slots.clear();
      for (int64_t j = 0; j < p.topk; ++j) {
        const int32_t s = p.indices[t * p.topk + j];
        if (s >= 0) slots.push_back(s);
      }
      if (slots.empty()) {
        for (int64_t i = 0; i < nh; ++i) {
          p.lse[t * p.h_q + h0 + i] = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h0 + i) * p.d_v + c, 0.f);
        }
        continue;
      }
      if (bf16) {
        row_bf16(p, t, h0, nh, slots);
      } else {
        row_f32(p, t, h0, nh, slots);
      }
    }
  });
}

namespace {

void sparse_mla_op(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices, double sm_scale,
                   int64_t d_v, at::Tensor& out, at::Tensor& lse) {
  const SparseMlaParams p = make_sparse_mla_params(q, kv_cache, indices, sm_scale, d_v, out, lse);
  check_slots_in_range(indices, p.num_slots, "indices");
  sparse_mla_cpu(p);
}

}  // namespace

TORCH_LIBRARY_IMPL(indexcache, CPU, m) { m.impl("sparse_mla", &sparse_mla_op); }

}  // namespace indexcache
