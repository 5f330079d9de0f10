// The AVX2 + FMA kernels (avx2.h): sparse MLA and the top-k filter of the avx2 path.
//
// Sparse MLA (absorbed form, DESIGN.md §5; and DeepSeek-V4's 512-wide K=V rows, the kernels being
// templates on the row width D, 576 in the comments below). A task is one query row, one block of up to 64
// heads and one range of its selected keys. It walks its keys in tiles of 48: the tile's cache
// rows are gathered and converted to fp32 once (bf16 by a shift, fp8_ds_mla by exponent
// arithmetic and the group scale), then two register-blocked FMA kernels run on it with heads
// across the lanes (16 heads = two vectors):
//   S^T[key][h] = Σ_c K[key][c] · qT[c][h]          6 keys x 16 heads per block
//   O^T[v][h]  = α[h]·O^T[v][h] + Σ_key K[key][v] · P[key][h]   6 value columns x 16 heads
// A block of 8 heads or fewer (a tensor-parallel rank's share: GLM-5 at TP 8) would fill one
// vector and pay a broadcast per FMA; it runs with channels (scores, 3 keys x 4 heads, lane sums
// added per key) and value columns (P·V, 4 heads x 16 columns, O[h][c]) across the lanes instead,
// so each loaded vector serves several FMAs. An online softmax runs between the two kernels
// (running max and sum per head, α the rescale). Each gathered row is read from the cache once
// per tile for the whole head block. With few query rows the selected keys are split across
// threads and the partial (max, sum, O) merged in split order (by whichever task finishes a row's last split, in the same parallel region); the
// split count depends on the shape alone, so results are bit-identical on any thread count.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "avx2.h"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "mla_slots.h"
#include "select.h"

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

// Heads per register panel: 8 * NV, NV = 2 8-lane vectors, or 1 for 8 heads or fewer (a tensor-
// parallel rank's share, GLM-5 at TP 8), which would otherwise fill half of every FMA.
constexpr int kGroup = 6;          // keys (kernel 1) or value columns (kernel 2) per register block
                                   // with NV = 2; 12 keys / 8 columns with NV = 1
constexpr int64_t kKeyTile = 48;   // gathered keys per tile, a multiple of kGroup
constexpr int64_t kHeadBlock = 64; // heads per task: its qT (147 KB) and O^T (128 KB) stay in L2

// exp(x) for x <= 0: 2^n · e^r, |r| <= ln2/2, degree-6 Taylor polynomial; inputs below -87 give 0
// (as simd.h's exp_ps: a softmax term far under its max, e.g. under a huge sink, is 0, not e^-87;
// NaN lanes come out as garbage; callers flag them separately).
inline __m256 exp256(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 q = _mm256_set1_ps(1.0f / 720);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 120));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 24));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 6));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  // n >= -126 here, so 2^n is a normal float.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(q, _mm256_castsi256_ps(e)));
}

using avx2::bf16_to_f32;  // avx2_convert.h
using avx2::e4m3x8;

// Cache row `slot` as fp32 [D] (D = d_qk: 576, or 512 for DeepSeek-V4, never fp8).
template <int D>
void load_row(const SparseMlaParams& p, int64_t slot, float* dst) {
  if (p.kv_dtype == DType::kBFloat16) {
    bf16_to_f32(static_cast<const uint16_t*>(p.kv) + slot * D, dst, D);
  } else if (D == kMlaDim && p.kv_dtype == DType::kFp8E4M3) {
    const uint8_t* row = static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes;
    float scales[kMlaLatent / kQuantGroup];
    std::memcpy(scales, row + kMlaLatent, sizeof(scales));
    for (int g = 0; g < kMlaLatent / kQuantGroup; ++g) {
      const __m256 sc = _mm256_set1_ps(scales[g]);
      for (int c = g * kQuantGroup; c < (g + 1) * kQuantGroup; c += 8)
        _mm256_storeu_ps(dst + c, _mm256_mul_ps(e4m3x8(row + c), sc));
    }
    uint16_t rope[kMlaRope];
    std::memcpy(rope, row + kMlaLatent + sizeof(scales), sizeof(rope));
    bf16_to_f32(rope, dst + kMlaLatent, kMlaRope);
  } else {
    std::memcpy(dst, static_cast<const float*>(p.kv) + slot * D, D * sizeof(float));
  }
}

// Kernel 1: st[r][0:16] = scale · Σ_c k[r][c] · qp[c][0:16] for kGroup rows of k (rows of D).
// (Written out for two vectors: GCC 12 keeps an a[6][2] array version's accumulators in
// registers less well, 1.3x slower at 16 and 128 heads.)
template <int D>
inline void qk_block(const float* k, const float* qp, float scale, float* st, int64_t ld) {
  __m256 a0[kGroup], a1[kGroup];
  for (int r = 0; r < kGroup; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int c = 0; c < D; ++c) {
    const __m256 b0 = _mm256_loadu_ps(qp + c * 16), b1 = _mm256_loadu_ps(qp + c * 16 + 8);
    for (int r = 0; r < kGroup; ++r) {
      const __m256 kv = _mm256_broadcast_ss(k + r * D + c);
      a0[r] = _mm256_fmadd_ps(kv, b0, a0[r]);
      a1[r] = _mm256_fmadd_ps(kv, b1, a1[r]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int r = 0; r < kGroup; ++r) {
    _mm256_storeu_ps(st + r * ld, _mm256_mul_ps(a0[r], sc));
    _mm256_storeu_ps(st + r * ld + 8, _mm256_mul_ps(a1[r], sc));
  }
}

// Kernel 1 for 8 heads or fewer: st[r][h0 + i] = scale · Σ_c k[r][c] · q[h0 + i][c] for 3 rows
// k[0:3] and 4 heads (q rows of D, heads padded to 8 with zero rows), channels across the lanes: each
// loaded vector of k serves 4 heads and each of q 3 keys (7 loads per 12 FMAs, where a head-
// across-lanes block of 8 heads pays a broadcast per FMA); the 8 lane sums of each (key, head)
// are added once at the end.
template <int D>
inline void qk_dot(const float* const* k, const float* q, float scale, float* st, int64_t ld) {
  constexpr int R = 3, H = 4;
  __m256 a[R][H];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < H; ++i) a[r][i] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    __m256 kv[R];
    for (int r = 0; r < R; ++r) kv[r] = _mm256_loadu_ps(k[r] + c);
    for (int i = 0; i < H; ++i) {
      const __m256 qv = _mm256_loadu_ps(q + i * D + c);
      for (int r = 0; r < R; ++r) a[r][i] = _mm256_fmadd_ps(kv[r], qv, a[r][i]);
    }
  }
  const __m128 sc = _mm_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    // lanes [s0, s1, s2, s3 | s0', s1', s2', s3']: head i's sums over lanes 0-3 and 4-7
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    _mm_storeu_ps(st + r * ld, _mm_mul_ps(sum, sc));
  }
}

// Kernel 2: ot[v][0:16] = α · ot[v][0:16] + Σ_j k[j][v] · pt[j][0:16] for R value columns v
// (k rows of D: the value is the row's first d_v).
template <int D, int R>
inline void pv_block(const float* k, const float* pt, int64_t ld, const float* alpha, int64_t nkeys, float* ot,
                     int64_t ldo) {
  __m256 a0[R], a1[R];
  const __m256 al0 = _mm256_loadu_ps(alpha), al1 = _mm256_loadu_ps(alpha + 8);
  for (int r = 0; r < R; ++r) {
    a0[r] = _mm256_mul_ps(_mm256_loadu_ps(ot + r * ldo), al0);
    a1[r] = _mm256_mul_ps(_mm256_loadu_ps(ot + r * ldo + 8), al1);
  }
  for (int64_t j = 0; j < nkeys; ++j) {
    const __m256 b0 = _mm256_loadu_ps(pt + j * ld), b1 = _mm256_loadu_ps(pt + j * ld + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(k + j * D + r);
      a0[r] = _mm256_fmadd_ps(v, b0, a0[r]);
      a1[r] = _mm256_fmadd_ps(v, b1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(ot + r * ldo, a0[r]);
    _mm256_storeu_ps(ot + r * ldo + 8, a1[r]);
  }
}

// Kernel 2 for 8 heads or fewer: o[h0 + i][c0 : c0 + 16] = α[h0 + i] · o[..] + Σ_j pt[j][h0 + i] ·
// k[j][c0 : c0 + 16] for 4 heads (o [8][ldo], value columns across the lanes): each loaded value
// vector serves 4 heads and each broadcast probability 2 vectors (6 loads per 8 FMAs).
inline void pv_rows(const float* const* k, int64_t c0, const float* pt, int64_t ld, const float* alpha, int64_t nkeys,
                    float* o, int64_t ldo) {
  constexpr int H = 4, CB = 2;
  __m256 a[H][CB];
  for (int i = 0; i < H; ++i) {
    const __m256 al = _mm256_set1_ps(alpha[i]);
    for (int c = 0; c < CB; ++c) a[i][c] = _mm256_mul_ps(_mm256_loadu_ps(o + i * ldo + 8 * c), al);
  }
  for (int64_t j = 0; j < nkeys; ++j) {
    __m256 v[CB];
    for (int c = 0; c < CB; ++c) v[c] = _mm256_loadu_ps(k[j] + c0 + 8 * c);
    for (int i = 0; i < H; ++i) {
      const __m256 pb = _mm256_broadcast_ss(pt + j * ld + i);
      for (int c = 0; c < CB; ++c) a[i][c] = _mm256_fmadd_ps(pb, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < H; ++i)
    for (int c = 0; c < CB; ++c) _mm256_storeu_ps(o + i * ldo + 8 * c, a[i][c]);
}

// R = rem value columns.
template <int D>
void pv_cols(const float* k, const float* pt, int64_t ld, const float* alpha, int64_t nkeys, float* ot, int64_t ldo,
             int rem) {
  switch (rem) {
    case 1: pv_block<D, 1>(k, pt, ld, alpha, nkeys, ot, ldo); break;
    case 2: pv_block<D, 2>(k, pt, ld, alpha, nkeys, ot, ldo); break;
    case 3: pv_block<D, 3>(k, pt, ld, alpha, nkeys, ot, ldo); break;
    case 4: pv_block<D, 4>(k, pt, ld, alpha, nkeys, ot, ldo); break;
    case 5: pv_block<D, 5>(k, pt, ld, alpha, nkeys, ot, ldo); break;
    default: pv_block<D, 6>(k, pt, ld, alpha, nkeys, ot, ldo); break;
  }
}

// Heads per panel for a block of nh heads (a multiple of which the block is padded to, hp).
inline int64_t panel_width(int64_t nh) { return nh <= 8 ? 8 : 16; }

// One task's running state for heads [h0, h0 + nh), padded to hp (a multiple of panel_width).
struct MlaState {
  std::vector<float> kbuf;  // [kKeyTile][d_qk] gathered fp32 rows
  std::vector<float> qT;    // [hp / 16][d_qk][16] query, heads across lanes (9+ heads) or [8][d_qk] rows
  std::vector<float> st;    // [kKeyTile][hp] scores, then probabilities
  std::vector<float> ot;    // unnormalised output, O^T [d_v][hp] (9+ heads) or O [8][d_v] (ot_at)
  std::vector<float> m, l, z, alpha;  // [hp] running max, sum, NaN flag (0 or NaN), rescale
};

// Where O[h][c] of a task with nh heads (padded to hp) is in MlaState::ot.
inline int64_t ot_at(int64_t nh, int64_t hp, int64_t d_v, int64_t h, int64_t c) {
  return nh <= 8 ? h * d_v + c : c * hp + h;
}

float q_value(const SparseMlaParams& p, int64_t i) {
  return p.q_dtype == DType::kFloat32 ? static_cast<const float*>(p.q)[i]
                                      : bf16_to_float(static_cast<const uint16_t*>(p.q)[i]);
}

// Runs keys slots[0:n) for row t, heads [h0, h0 + nh) in panels of 8 * NV heads (NV = 1 exactly
// when nh <= 8); leaves m, l, z and ot in `s`. D = d_qk.
template <int D, int NV>
void mla_task(const SparseMlaParams& p, int64_t t, int64_t h0, int64_t nh, const int32_t* slots, int64_t n,
              MlaState& s) {
  constexpr int kPanel = 8 * NV, kKeys = NV == 1 ? 12 : kGroup, kCols = kGroup;
  static_assert(kKeyTile % kKeys == 0, "a tile is whole key groups");
  const int64_t hp = (nh + kPanel - 1) / kPanel * kPanel, panels = hp / kPanel;
  s.kbuf.resize(kKeyTile * D);
  s.qT.resize(hp * D);
  s.st.resize(kKeyTile * hp);
  s.ot.assign(p.d_v * hp, 0.f);
  s.m.assign(hp, -std::numeric_limits<float>::infinity());
  s.l.assign(hp, 0.f);
  s.z.assign(hp, 0.f);
  s.alpha.resize(hp);
  for (int64_t pn = 0; pn < panels; ++pn)
    for (int64_t hh = 0; hh < kPanel; ++hh) {
      const int64_t h = pn * kPanel + hh;
      // 8 heads or fewer: q rows (qk_dot); else heads across the lanes
      float* dst = NV == 1 ? s.qT.data() + h * D : s.qT.data() + pn * D * kPanel + hh;
      const int64_t step = NV == 1 ? 1 : kPanel;
      const int64_t base = (t * p.h_q + h0 + h) * D;
      for (int c = 0; c < D; ++c) dst[c * step] = h < nh ? q_value(p, base + c) : 0.f;
    }
  float* kb = s.kbuf.data();
  float* st = s.st.data();
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const int64_t nk = std::min<int64_t>(kKeyTile, n - j0);
    const int64_t groups = (nk + kKeys - 1) / kKeys;
    // 8 heads or fewer read fp32 rows in place (the rows' fetch, not the FMAs, bounds them);
    // other rows are gathered into kb, converted.
    const bool in_place = NV == 1 && p.kv_dtype == DType::kFloat32;
    const float* kr[kKeyTile];
    for (int64_t j = 0; j < kKeyTile; ++j) kr[j] = kb + j * D;
    for (int64_t j = 0; j < nk; ++j) {
      if (in_place) {
        kr[j] = static_cast<const float*>(p.kv) + static_cast<int64_t>(slots[j0 + j]) * D;
      } else {
        load_row<D>(p, slots[j0 + j], kb + j * D);
      }
    }
    mla_prefetch_rows(p, slots + j0 + nk, std::min<int64_t>(kKeyTile, n - j0 - nk));  // the next tile's rows
    std::fill(kb + nk * D, kb + groups * kKeys * D, 0.f);
    // Scores: each 6-row (NV = 1: 12-row) group of the tile against every head panel.
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t pn = 0; pn < panels; ++pn)
        if constexpr (NV == 1) {
          for (int64_t r = g * kKeys; r < (g + 1) * kKeys; r += 3)
            for (int64_t h = 0; h < 8; h += 4) qk_dot<D>(kr + r, s.qT.data() + h * D, p.sm_scale, st + r * hp + h, hp);
        } else {
          qk_block<D>(kb + g * kKeys * D, s.qT.data() + pn * D * kPanel, p.sm_scale, st + g * kKeys * hp + pn * kPanel,
                      hp);
        }
    // Online softmax, 8 heads at a time: new max, rescale of the old sum, probabilities in place.
    // z: 0 per head, NaN once one of its scores is NaN or +-inf (x - x); such heads get NaN
    // out and lse (docs/ops.md).
    for (int64_t v = 0; v < hp; v += 8) {
      const __m256 m_old = _mm256_loadu_ps(s.m.data() + v);
      __m256 mt = m_old, zt = _mm256_loadu_ps(s.z.data() + v);
      for (int64_t j = 0; j < nk; ++j) {
        const __m256 x = _mm256_loadu_ps(st + j * hp + v);
        mt = _mm256_max_ps(x, mt);
        zt = _mm256_add_ps(zt, _mm256_sub_ps(x, x));
      }
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < nk; ++j) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(st + j * hp + v), mt));
        _mm256_storeu_ps(st + j * hp + v, e);
        sum = _mm256_add_ps(sum, e);
      }
      const __m256 alpha = exp256(_mm256_sub_ps(m_old, mt));
      _mm256_storeu_ps(s.alpha.data() + v, alpha);
      _mm256_storeu_ps(s.l.data() + v, _mm256_fmadd_ps(_mm256_loadu_ps(s.l.data() + v), alpha, sum));
      _mm256_storeu_ps(s.m.data() + v, mt);
      _mm256_storeu_ps(s.z.data() + v, zt);
    }
    // P·V: 6 value columns x 16 heads (NV = 1: 4 heads x 16 columns) per block, over the tile's keys.
    if constexpr (NV == 1) {
      for (int64_t c0 = 0; c0 < p.d_v; c0 += 16)
        for (int64_t h = 0; h < 8; h += 4)
          pv_rows(kr, c0, st + h, hp, s.alpha.data() + h, nk, s.ot.data() + h * p.d_v + c0, p.d_v);
      continue;
    }
    for (int64_t c0 = 0; c0 < p.d_v; c0 += kCols) {
      const int rem = static_cast<int>(std::min<int64_t>(kCols, p.d_v - c0));
      for (int64_t pn = 0; pn < panels; ++pn)
        pv_cols<D>(kb + c0, st + pn * kPanel, hp, s.alpha.data() + pn * kPanel, nk,
                       s.ot.data() + c0 * hp + pn * kPanel, hp, rem);
    }
  }
}

void store_out(const SparseMlaParams& p, int64_t i, float v) {
  if (p.q_dtype == DType::kFloat32) {
    static_cast<float*>(p.out)[i] = v;
  } else {
    static_cast<uint16_t*>(p.out)[i] = float_to_bf16(v);
  }
}

// Merges the splits of (row t, head h) in split order into out and lse.
void merge_splits(const SparseMlaParams& p, int64_t th, int64_t splits, const float* pm, const float* pl,
                  const float* pz, const float* po, float* acc) {
  const int64_t part0 = th * splits;
  bool bad = false;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t sp = 0; sp < splits; ++sp) {
    bad |= pz[part0 + sp] != pz[part0 + sp];
    if (pl[part0 + sp] > 0.f) mx = std::max(mx, pm[part0 + sp]);
  }
  if (bad) {
    p.lse[th] = quiet_nan();
    for (int64_t c = 0; c < p.d_v; ++c) store_out(p, th * p.d_v + c, quiet_nan());
    return;
  }
  float sum = 0.f;  // > 0: the caller merges rows with a valid slot only
  std::fill(acc, acc + p.d_v, 0.f);
  for (int64_t sp = 0; sp < splits; ++sp) {
    const int64_t part = part0 + sp;
    if (!(pl[part] > 0.f)) continue;  // an empty split
    const float w = std::exp(pm[part] - mx);
    sum += pl[part] * w;
    const float* o = po + part * p.d_v;
    for (int64_t c = 0; c < p.d_v; ++c) acc[c] += o[c] * w;
  }
  // The sink joins once, here (not per split).
  const MlaFinish f = mla_finish(mx, sum, false, mla_sink(p, th % p.h_q));
  p.lse[th] = f.lse;
  for (int64_t c = 0; c < p.d_v; ++c) store_out(p, th * p.d_v + c, acc[c] * f.scale);
}

}  // namespace

void sparse_mla_avx2(const SparseMlaParams& p) {
  if (p.s_q == 0 || p.h_q == 0) return;  // nothing to write (and no split count to divide by)
  const MlaSlots rows(p);
  const int64_t hblock = std::min<int64_t>(p.h_q, kHeadBlock);
  const int64_t hblocks = (p.h_q + hblock - 1) / hblock;
  const int64_t splits = mla_key_splits(p, hblocks);
  // Partial results of split tasks: max, sum, NaN flag per (row, head, split), O [d_v]. The
  // task that finishes the last split of a (row, head block) merges it, in split order, inside
  // the same parallel region.
  std::vector<float> pm, pl, pz, po;
  std::unique_ptr<std::atomic<int>[]> left;
  if (splits > 1) {
    const int64_t parts = p.s_q * p.h_q * splits;
    pm.resize(parts);
    pl.resize(parts);
    pz.resize(parts);
    po.resize(parts * p.d_v);
    left.reset(new std::atomic<int>[p.s_q * hblocks]);
    for (int64_t i = 0; i < p.s_q * hblocks; ++i) left[i].store(static_cast<int>(splits));
  }
  auto body = [&](int64_t begin, int64_t end) {
    static thread_local MlaState s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t sp = task % splits, t = task / splits / hblocks, hb = task / splits % hblocks;
      const int64_t h0 = hb * hblock, nh = std::min(hblock, p.h_q - h0);
      const int64_t n = rows.count[t];
      if (n == 0) {  // a row with no valid slot: zeros and lse = sink or -inf (once, from split 0)
        if (sp == 0)
          for (int64_t h = h0; h < h0 + nh; ++h) {
            p.lse[t * p.h_q + h] = mla_sink(p, h);
            for (int64_t c = 0; c < p.d_v; ++c) store_out(p, (t * p.h_q + h) * p.d_v + c, 0.f);
          }
        continue;
      }
      const int64_t per = (n + splits - 1) / splits;
      const int64_t a = std::min(n, sp * per), e = std::min(n, a + per);
      const int64_t hp = (nh + panel_width(nh) - 1) / panel_width(nh) * panel_width(nh);
      if (e > a) {
        const int32_t* ts = rows.row(t) + a;
        if (p.d_qk == kMlaDim) {
          nh <= 8 ? mla_task<kMlaDim, 1>(p, t, h0, nh, ts, e - a, s) : mla_task<kMlaDim, 2>(p, t, h0, nh, ts, e - a, s);
        } else {
          nh <= 8 ? mla_task<kMlaLatent, 1>(p, t, h0, nh, ts, e - a, s)
                  : mla_task<kMlaLatent, 2>(p, t, h0, nh, ts, e - a, s);
        }
      } else {  // an empty split (fewer keys than splits x per)
        s.m.assign(hp, -std::numeric_limits<float>::infinity());
        s.l.assign(hp, 0.f);
        s.z.assign(hp, 0.f);
        s.ot.assign(p.d_v * hp, 0.f);
      }
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t h = h0 + hh;
        if (splits > 1) {
          const int64_t part = (t * p.h_q + h) * splits + sp;
          pm[part] = s.m[hh];
          pl[part] = s.l[hh];
          pz[part] = s.z[hh];
          for (int64_t c = 0; c < p.d_v; ++c) po[part * p.d_v + c] = s.ot[ot_at(nh, hp, p.d_v, hh, c)];
          continue;
        }
        // The sink only changes this normalisation (mla_finish; bit-identical without one).
        const MlaFinish f = mla_finish(s.m[hh], s.l[hh], s.z[hh] != s.z[hh], mla_sink(p, h));
        p.lse[t * p.h_q + h] = f.lse;
        for (int64_t c = 0; c < p.d_v; ++c)
          store_out(p, (t * p.h_q + h) * p.d_v + c, s.ot[ot_at(nh, hp, p.d_v, hh, c)] * f.scale);
      }
      if (splits > 1 && left[t * hblocks + hb].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        s.alpha.resize(std::max<size_t>(s.alpha.size(), p.d_v));  // scratch for the merge
        for (int64_t h = h0; h < h0 + nh; ++h)
          merge_splits(p, t * p.h_q + h, splits, pm.data(), pl.data(), pz.data(), po.data(), s.alpha.data());
      }
    }
  };
  // Below the serial bound (mla_runs_inline: 2^22 multiply-adds on this kernel, so a decode row of 8
  // heads or more splits its keys over the threads) on the calling thread; the splits depend on the
  // shape only, so where it runs changes no value.
  if (mla_runs_inline(p, MlaKernel::kAvx2)) {
    body(0, p.s_q * hblocks * splits);
  } else {
    at::parallel_for(0, p.s_q * hblocks * splits, 1, body);
  }
}

namespace {

// Lane permutations that move the selected lanes of an 8-bit mask to the front, as bytes.
struct CompressTable {
  uint64_t idx[256];
  CompressTable() {
    for (int mask = 0; mask < 256; ++mask) {
      uint64_t v = 0;
      int w = 0;
      for (int lane = 0; lane < 8; ++lane)
        if (mask & (1 << lane)) v |= static_cast<uint64_t>(lane) << (8 * w++);
      idx[mask] = v;
    }
  }
};

// Order keys of the lanes of xf (select.h's order_key, 8 at a time).
inline __m256i order_keys8(__m256 xf) {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i u = _mm256_castps_si256(xf);
  // negative -> ~u, else u | sign; -0 is +0; every NaN is the largest key.
  __m256i key = _mm256_xor_si256(_mm256_or_si256(u, sign), _mm256_srai_epi32(u, 31));
  key = _mm256_blendv_epi8(key, sign, _mm256_cmpeq_epi32(u, sign));
  return _mm256_or_si256(key, _mm256_castps_si256(_mm256_cmp_ps(xf, xf, _CMP_UNORD_Q)));
}

// Appends the lanes of x[i:i+8) selected by `mask` (keys and positions) at keys/pos + w.
inline int64_t compress8(__m256 xf, int mask, int64_t i, uint32_t* keys, int32_t* pos, int64_t w) {
  static const CompressTable table;
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(table.idx[mask])));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + w), _mm256_permutevar8x32_epi32(order_keys8(xf), perm));
  const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(i)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + w), _mm256_permutevar8x32_epi32(at, perm));
  return w + __builtin_popcount(static_cast<unsigned>(mask));
}

}  // namespace

int64_t filter_at_least_avx2(const float* x, int64_t n, uint32_t floor, uint32_t* keys, int32_t* pos) {
  // order_key is monotone, so key(x) >= floor is a float compare against the floor's value
  // (ordered: false for NaN), or x is NaN (the largest key). A floor that is itself the NaN key
  // keeps only NaNs (the compare against a NaN value is always false).
  const uint32_t fb = (floor & 0x80000000u) ? (floor & 0x7FFFFFFFu) : ~floor;
  float fv;
  std::memcpy(&fv, &fb, 4);
  const __m256 lim = _mm256_set1_ps(fv);
  int64_t w = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const int ma = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, lim, _CMP_GE_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    const int mb = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(b, lim, _CMP_GE_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    if ((ma | mb) == 0) continue;
    // Survivors moved to the front of a vector, stored whole (the buffers have 8 spare slots).
    if (ma) w = compress8(a, ma, i, keys, pos, w);
    if (mb) w = compress8(b, mb, i + 8, keys, pos, w);
  }
  return cpu::keep_at_least(x, i, n, floor, keys, pos, w);
}

int64_t select_survivors_avx2(const uint32_t* keys, const int32_t* pos, int64_t c, int64_t k, int32_t* out,
                              uint32_t* scratch) {
  // The threshold: select.h's three radix levels (11, 11, 10 bits), with the narrowing passes
  // branch-free (a survivor set's keys are close together, so "in the chosen bin" is a coin toss).
  uint32_t hist[2048];
  uint32_t prefix = 0, mask = 0;
  int64_t need = k, cnt = c;
  const uint32_t* src = keys;
  for (int level = 0; level < 3; ++level) {
    const uint32_t bins = cpu::kRadixBins[level];
    const int shift = cpu::kRadixShift[level];
    std::memset(hist, 0, sizeof(uint32_t) * bins);
    for (int64_t i = 0; i < cnt; ++i) ++hist[(src[i] >> shift) & (bins - 1)];
    const uint32_t b = cpu::pick_bin(hist, bins, need);
    prefix |= b << shift;
    mask |= (bins - 1) << shift;
    if (level == 2) break;
    int64_t w = 0;
    for (int64_t i = 0; i < cnt; ++i) {
      const uint32_t kk = src[i];
      scratch[w] = kk;
      w += (kk & mask) == prefix;
    }
    src = scratch;
    cnt = w;
  }
  // Emit: keys above the threshold, and the first `need` equal to it (lowest positions), in
  // position order. Whole-vector stores only while 8 more slots remain below k.
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i tk = _mm256_set1_epi32(static_cast<int>(prefix));
  const __m256i tks = _mm256_xor_si256(tk, sign);
  int64_t j = 0, i = 0, eq_left = need;
  for (; i + 8 <= c && j + 8 <= k; i += 8) {
    const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    const int gt = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_xor_si256(kv, sign), tks)));
    const int eq = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(kv, tk)));
    if (eq) {
      for (int lane = 0; lane < 8; ++lane)
        if (((gt >> lane) & 1) || (((eq >> lane) & 1) && eq_left-- > 0)) out[j++] = pos[i + lane];
    } else if (gt) {
      static const CompressTable table;
      const __m256i perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(table.idx[gt])));
      const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(pv, perm));
      j += __builtin_popcount(static_cast<unsigned>(gt));
    }
  }
  for (; i < c; ++i) {
    const uint32_t kk = keys[i];
    if (kk > prefix || (kk == prefix && eq_left-- > 0)) out[j++] = pos[i];
  }
  return j;
}

}  // namespace indexcache

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: the avx2 path is never available (isa.cpp), so these are never called.

namespace indexcache {
void sparse_mla_avx2(const SparseMlaParams&) { TORCH_CHECK(false, "the avx2 CPU path needs an x86-64 CPU"); }
int64_t filter_at_least_avx2(const float*, int64_t, uint32_t, uint32_t*, int32_t*) {
  TORCH_CHECK(false, "the avx2 CPU path needs an x86-64 CPU");
}
int64_t select_survivors_avx2(const uint32_t*, const int32_t*, int64_t, int64_t, int32_t*, uint32_t*) {
  TORCH_CHECK(false, "the avx2 CPU path needs an x86-64 CPU");
}
}  // namespace indexcache

#endif
