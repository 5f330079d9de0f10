// AVX-512 fp32 sparse MLA (sparse_mla_avx512.h; absorbed form, DESIGN.md §5, and DeepSeek-V4's
// 512-wide K=V rows: the kernels are templates on the row width D, 576 below).
//
// A task is one query row, a block of up to 64 heads and one range of its selected keys, walked
// in tiles of 48 keys. fp32 cache rows are read in place; bf16 and fp8_ds_mla rows are converted
// to fp32 once per tile. Two register-blocked FMA kernels run on a tile, with an online softmax
// (running max and sum per head, α the rescale) between them:
//   scores  S[key][h] = Σ_p K[key][2p:2p+2] · Q[h][2p:2p+2]: the 16 lanes are 8 heads x a pair of
//           channels, so 8 heads (a tensor-parallel rank of GLM-5) fill a whole vector: a key's
//           channel pair is one 64-bit broadcast, and the two halves are added once per key
//           at the end. KB keys x NV vectors of 8 heads per block (16 x 1, 12 x 2, 6 x 4).
//   P·V     O[h][c] = α[h]·O[h][c] + Σ_key P[key][h] · V[key][c]: value columns across the lanes,
//           4 heads x 64 columns per block, each value vector loaded once for 4 heads.
// Heads are never padded to 16 or 32 as with heads across the lanes. The keys of a row are split
// among tasks only for few (row, head block) pairs (decode), by a count that depends on the shape
// alone, and the splits merged in order by whichever task finishes last: results do not depend on
// the thread count.
#include "sparse_mla_avx512.h"

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

#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "mla_slots.h"
#include "simd.h"

#if defined(__x86_64__)

// Everything defined below (and nothing from the headers above) is compiled for AVX-512 F + BW.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#endif

namespace indexcache {
namespace {

constexpr int kKeyTile = 48;         // keys per tile: a multiple of every score block (16, 12, 6)
constexpr int64_t kHeadBlock = 64;   // heads per task: its Q (147 KB) and O (128 KB) stay in L2
constexpr int kPvCols = 4;           // value vectors per P·V block (64 columns; d_v % 64 == 0)

alignas(64) const float kZeroRow[kMlaDim] = {};  // pads a tile to whole score blocks

// n bf16 values (n a multiple of 16) -> fp32, exact.
inline void bf16_to_f32(const uint16_t* src, float* dst, int n) {
  for (int c = 0; c < n; c += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
}

// Cache row `slot` (bf16, or fp8_ds_mla for D = 576) as fp32 [D].
template <int D>
void convert_row(const SparseMlaParams& p, int64_t slot, float* dst) {
  if (p.kv_dtype == DType::kBFloat16) {
    bf16_to_f32(static_cast<const uint16_t*>(p.kv) + slot * D, dst, D);
    return;
  }
  if constexpr (D == kMlaDim) {
    const uint8_t* row = static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes;
    float scales[kMlaLatent / kQuantGroup];
    std::memcpy(scales, row + kMlaLatent, sizeof(scales));
    for (int g = 0; g < kMlaLatent / kQuantGroup; ++g) {
      const __m512 sc = _mm512_set1_ps(scales[g]);
      for (int c = g * kQuantGroup; c < (g + 1) * kQuantGroup; c += 16)
        _mm512_storeu_ps(dst + c, _mm512_mul_ps(cpu::e4m3x16(row + c), sc));
    }
    uint16_t rope[kMlaRope];
    std::memcpy(rope, row + kMlaLatent + sizeof(scales), sizeof(rope));
    bf16_to_f32(rope, dst + kMlaLatent, kMlaRope);
  }
}

// The 64-bit channel pair at k, broadcast to all 8 pairs of lanes.
inline __m512 pair_bcast(const float* k) {
  int64_t bits;
  std::memcpy(&bits, k, sizeof(bits));
  return _mm512_castsi512_ps(_mm512_set1_epi64(bits));
}

// Scores of keys kr[0:KB) against NV panels of 8 heads (qp: panel v at qp + v * D * 8, pair p of
// head i at lanes 2i, 2i + 1 of vector p): st[j][8v + i] = scale · Σ_c K[j][c] · Q[i][c].
template <int D, int KB, int NV>
inline void qk_block(const float* const* kr, const float* qp, float scale, float* st, int64_t ld) {
  constexpr int kPairs = D / 2;
  __m512 a[KB][NV];
  for (int j = 0; j < KB; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_setzero_ps();
  for (int pp = 0; pp < kPairs; ++pp) {
    __m512 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qp + (v * kPairs + pp) * 16);
    for (int j = 0; j < KB; ++j) {
      const __m512 k = pair_bcast(kr[j] + 2 * pp);
      for (int v = 0; v < NV; ++v) a[j][v] = _mm512_fmadd_ps(k, q[v], a[j][v]);
    }
  }
  // Lane 2i + lane 2i + 1 -> head i, the 8 even lanes moved to the low half.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m256 sc = _mm256_set1_ps(scale);
  for (int j = 0; j < KB; ++j)
    for (int v = 0; v < NV; ++v) {
      const __m512 s = _mm512_add_ps(a[j][v], _mm512_permute_ps(a[j][v], 0xB1));
      _mm256_storeu_ps(st + j * ld + 8 * v,
                       _mm256_mul_ps(_mm512_castps512_ps256(_mm512_permutexvar_ps(even, s)), sc));
    }
}

// Scores of the tile's keys kr[0:keys) (keys a multiple of KB; rows past the tile are kZeroRow)
// for panels [g, g + NV).
template <int D, int KB, int NV>
void qk_panels(const float* const* kr, int64_t keys, const float* qP, int64_t g, float scale, float* st, int64_t ld) {
  for (int64_t j = 0; j < keys; j += KB) qk_block<D, KB, NV>(kr + j, qP + g * D * 8, scale, st + j * ld + 8 * g, ld);
}

// O[h + i][c0 : c0 + 64] = α[h + i] · O[h + i][c0 : c0 + 64] + Σ_{j < nk} P[j][h + i] · V[j][c0 : c0 + 64]
// for HB heads from h.
template <int HB>
inline void pv_block(const float* const* kr, const float* st, int64_t ld, int64_t h, int64_t nk, int64_t c0,
                     const float* alpha, float* o, int64_t ldo) {
  __m512 a[HB][kPvCols];
  for (int i = 0; i < HB; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[h + i]);
    for (int c = 0; c < kPvCols; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (h + i) * ldo + c0 + 16 * c), al);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const float* vr = kr[j] + c0;
    __m512 v[kPvCols];
    for (int c = 0; c < kPvCols; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
    const float* pr = st + j * ld + h;
    for (int i = 0; i < HB; ++i) {
      const __m512 pb = _mm512_set1_ps(pr[i]);
      for (int c = 0; c < kPvCols; ++c) a[i][c] = _mm512_fmadd_ps(pb, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < HB; ++i)
    for (int c = 0; c < kPvCols; ++c) _mm512_storeu_ps(o + (h + i) * ldo + c0 + 16 * c, a[i][c]);
}

// One task's state for heads [h0, h0 + nh): hs = nh rounded up to 16 (the softmax's vectors).
struct MlaState {
  std::vector<float> kb;              // [kKeyTile][D] converted rows (bf16 / fp8 caches)
  std::vector<float> qP;              // [panels][D / 2][16] query pairs, 8 heads per panel
  std::vector<float> st;              // [kKeyTile][hs] scores, then probabilities
  std::vector<float> o;               // [nh][d_v] unnormalised output
  std::vector<float> m, l, z, alpha;  // [hs] running max, sum, NaN flag (0 or NaN), rescale
};

float q_value(const SparseMlaParams& p, int64_t i) {
  return p.q_dtype == DType::kFloat32 ? static_cast<const float*>(p.q)[i]
                                      : bf16_to_float(static_cast<const uint16_t*>(p.q)[i]);
}

// Online softmax of one tile (keys j < nk of st) into probabilities in place, 16 heads at a time:
// the new max, α = exp(old max - new max), the rescaled sum; z turns NaN for a head once one of its
// scores is NaN or ±inf (x - x), and such heads get NaN out and lse (docs/ops.md).
void softmax_tile(float* st, int64_t ld, int64_t nk, MlaState& s) {
  for (int64_t v = 0; v < ld; v += 16) {
    const __m512 m_old = _mm512_loadu_ps(s.m.data() + v);
    __m512 mt = m_old, zt = _mm512_loadu_ps(s.z.data() + v);
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 x = _mm512_loadu_ps(st + j * ld + v);
      mt = _mm512_max_ps(x, mt);
      zt = _mm512_add_ps(zt, _mm512_sub_ps(x, x));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 e = cpu::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(st + j * ld + v), mt));
      _mm512_storeu_ps(st + j * ld + v, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 alpha = cpu::exp_ps(_mm512_sub_ps(m_old, mt));
    _mm512_storeu_ps(s.alpha.data() + v, alpha);
    _mm512_storeu_ps(s.l.data() + v, _mm512_fmadd_ps(_mm512_loadu_ps(s.l.data() + v), alpha, sum));
    _mm512_storeu_ps(s.m.data() + v, mt);
    _mm512_storeu_ps(s.z.data() + v, zt);
  }
}

// Runs keys slots[0:n) of row t for heads [h0, h0 + nh); leaves m, l, z and o in `s`.
template <int D>
void mla_task(const SparseMlaParams& p, int64_t t, int64_t h0, int64_t nh, const int32_t* slots, int64_t n,
              MlaState& s) {
  constexpr int kPairs = D / 2;
  const int64_t panels = (nh + 7) / 8, hs = (nh + 15) / 16 * 16;
  s.qP.resize(panels * D * 8);
  for (int64_t g = 0; g < panels; ++g)
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t h = g * 8 + i;
      float* dst = s.qP.data() + g * D * 8 + 2 * i;
      const int64_t base = (t * p.h_q + h0 + h) * D;
      for (int pp = 0; pp < kPairs; ++pp) {
        dst[pp * 16] = h < nh ? q_value(p, base + 2 * pp) : 0.f;
        dst[pp * 16 + 1] = h < nh ? q_value(p, base + 2 * pp + 1) : 0.f;
      }
    }
  s.st.assign(kKeyTile * hs, 0.f);
  s.o.assign(nh * p.d_v, 0.f);
  s.m.assign(hs, -std::numeric_limits<float>::infinity());
  s.l.assign(hs, 0.f);
  s.z.assign(hs, 0.f);
  s.alpha.resize(hs);
  const bool in_place = p.kv_dtype == DType::kFloat32;
  if (!in_place) s.kb.resize(kKeyTile * D);
  const float* kr[kKeyTile];
  float* st = s.st.data();
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const int64_t nk = std::min<int64_t>(kKeyTile, n - j0);
    for (int64_t j = 0; j < nk; ++j) {
      if (in_place) {
        kr[j] = static_cast<const float*>(p.kv) + static_cast<int64_t>(slots[j0 + j]) * D;
      } else {
        convert_row<D>(p, slots[j0 + j], s.kb.data() + j * D);
        kr[j] = s.kb.data() + j * D;
      }
    }
    for (int64_t j = nk; j < kKeyTile; ++j) kr[j] = kZeroRow;
    // Scores: panels in groups of 4, then 2, then 1, each block over the tile's keys rounded up.
    int64_t g = 0;
    for (; g + 4 <= panels; g += 4) qk_panels<D, 6, 4>(kr, (nk + 5) / 6 * 6, s.qP.data(), g, p.sm_scale, st, hs);
    for (; g + 2 <= panels; g += 2) qk_panels<D, 12, 2>(kr, (nk + 11) / 12 * 12, s.qP.data(), g, p.sm_scale, st, hs);
    for (; g < panels; ++g) qk_panels<D, 16, 1>(kr, (nk + 15) / 16 * 16, s.qP.data(), g, p.sm_scale, st, hs);
    softmax_tile(st, hs, nk, s);
    for (int64_t c0 = 0; c0 < p.d_v; c0 += 16 * kPvCols) {
      int64_t h = 0;
      for (; h + 4 <= nh; h += 4) pv_block<4>(kr, st, hs, h, nk, c0, s.alpha.data(), s.o.data(), p.d_v);
      switch (nh - h) {
        case 3: pv_block<3>(kr, st, hs, h, nk, c0, s.alpha.data(), s.o.data(), p.d_v); break;
        case 2: pv_block<2>(kr, st, hs, h, nk, c0, s.alpha.data(), s.o.data(), p.d_v); break;
        case 1: pv_block<1>(kr, st, hs, h, nk, c0, s.alpha.data(), s.o.data(), p.d_v); break;
        default: break;
      }
    }
  }
}

// out[i : i + d_v] = src · scale in q's dtype.
void store_row(const SparseMlaParams& p, int64_t i, const float* src, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  if (p.q_dtype == DType::kFloat32) {
    float* dst = static_cast<float*>(p.out) + i;
    for (int64_t c = 0; c < p.d_v; c += 16) _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_loadu_ps(src + c), sc));
  } else {
    uint16_t* dst = static_cast<uint16_t*>(p.out) + i;
    for (int64_t c = 0; c < p.d_v; ++c) dst[c] = float_to_bf16(src[c] * scale);
  }
}

void store_fill(const SparseMlaParams& p, int64_t i, float v) {
  if (p.q_dtype == DType::kFloat32) {
    std::fill_n(static_cast<float*>(p.out) + i, p.d_v, v);
  } else {
    std::fill_n(static_cast<uint16_t*>(p.out) + i, p.d_v, float_to_bf16(v));
  }
}

// Partial results of split tasks: max, sum, NaN flag per (row, head, split) and O [d_v].
struct Splits {
  int64_t n = 1;
  std::vector<float> m, l, z, o;
  std::unique_ptr<std::atomic<int>[]> left;  // splits still running per (row, head block)
};

// Merges the splits of (row t, head h) = th in split order into out and lse; the sink joins once.
void merge_splits(const SparseMlaParams& p, int64_t th, const Splits& sp, float* acc) {
  const int64_t part0 = th * sp.n;
  bool bad = false;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < sp.n; ++k) {
    bad |= sp.z[part0 + k] != sp.z[part0 + k];
    if (sp.l[part0 + k] > 0.f) mx = std::max(mx, sp.m[part0 + k]);
  }
  if (bad) {
    p.lse[th] = quiet_nan();
    store_fill(p, th * p.d_v, quiet_nan());
    return;
  }
  float sum = 0.f;  // > 0: rows without a valid slot never get here
  std::fill_n(acc, p.d_v, 0.f);
  for (int64_t k = 0; k < sp.n; ++k) {
    const int64_t part = part0 + k;
    if (!(sp.l[part] > 0.f)) continue;  // an empty split
    const float w = std::exp(sp.m[part] - mx);
    sum += sp.l[part] * w;
    const __m512 wv = _mm512_set1_ps(w);
    const float* o = sp.o.data() + part * p.d_v;
    for (int64_t c = 0; c < p.d_v; c += 16)
      _mm512_storeu_ps(acc + c, _mm512_fmadd_ps(_mm512_loadu_ps(o + c), wv, _mm512_loadu_ps(acc + c)));
  }
  const MlaFinish f = mla_finish(mx, sum, false, mla_sink(p, th % p.h_q));
  p.lse[th] = f.lse;
  store_row(p, th * p.d_v, acc, f.scale);
}

}  // namespace

void sparse_mla_avx512_f32(const SparseMlaParams& p) {
  if (p.s_q == 0 || p.h_q == 0) return;
  const MlaSlots rows(p);
  const int64_t hblock = std::min<int64_t>(p.h_q, kHeadBlock);
  const int64_t hblocks = (p.h_q + hblock - 1) / hblock;
  Splits sp;
  sp.n = mla_key_splits(p, hblocks);  // shape only: the same results on any number of threads
  if (sp.n > 1) {
    const int64_t parts = p.s_q * p.h_q * sp.n;
    sp.m.resize(parts);
    sp.l.resize(parts);
    sp.z.resize(parts);
    sp.o.resize(parts * p.d_v);
    sp.left.reset(new std::atomic<int>[p.s_q * hblocks]);
    for (int64_t i = 0; i < p.s_q * hblocks; ++i) sp.left[i].store(static_cast<int>(sp.n));
  }
  auto body = [&](int64_t begin, int64_t end) {
    static thread_local MlaState s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task % sp.n, t = task / sp.n / hblocks, hb = task / sp.n % hblocks;
      const int64_t h0 = hb * hblock, nh = std::min(hblock, p.h_q - h0);
      const int64_t n = rows.count[t];
      if (n == 0) {  // no valid slot: zeros and lse = sink or -inf (written once, by split 0)
        if (k == 0)
          for (int64_t h = h0; h < h0 + nh; ++h) {
            p.lse[t * p.h_q + h] = mla_sink(p, h);
            store_fill(p, (t * p.h_q + h) * p.d_v, 0.f);
          }
        continue;
      }
      const int64_t per = (n + sp.n - 1) / sp.n;
      const int64_t a = std::min(n, k * per), e = std::min(n, a + per);
      if (e > a) {
        if (p.d_qk == kMlaDim) {
          mla_task<kMlaDim>(p, t, h0, nh, rows.row(t) + a, e - a, s);
        } else {
          mla_task<kMlaLatent>(p, t, h0, nh, rows.row(t) + a, e - a, s);
        }
      } else {  // an empty split (fewer keys than splits x per)
        s.m.assign(nh, -std::numeric_limits<float>::infinity());
        s.l.assign(nh, 0.f);
        s.z.assign(nh, 0.f);
        s.o.assign(nh * p.d_v, 0.f);
      }
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t th = t * p.h_q + h0 + hh;
        if (sp.n > 1) {
          const int64_t part = th * sp.n + k;
          sp.m[part] = s.m[hh];
          sp.l[part] = s.l[hh];
          sp.z[part] = s.z[hh];
          std::memcpy(sp.o.data() + part * p.d_v, s.o.data() + hh * p.d_v, p.d_v * sizeof(float));
          continue;
        }
        const MlaFinish f = mla_finish(s.m[hh], s.l[hh], s.z[hh] != s.z[hh], mla_sink(p, h0 + hh));
        p.lse[th] = f.lse;
        store_row(p, th * p.d_v, s.o.data() + hh * p.d_v, f.scale);
      }
      if (sp.n > 1 && sp.left[t * hblocks + hb].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        s.alpha.resize(std::max<size_t>(s.alpha.size(), p.d_v));  // scratch for the merge
        for (int64_t h = h0; h < h0 + nh; ++h) merge_splits(p, t * p.h_q + h, sp, s.alpha.data());
      }
    }
  };
  if (mla_runs_inline(p, MlaKernel::kVector)) {
    body(0, p.s_q * hblocks * sp.n);
  } else {
    at::parallel_for(0, p.s_q * hblocks * sp.n, 1, body);
  }
}

}  // namespace indexcache

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: the avx512bf16 path is never available (isa.cpp), so this is never called.

namespace indexcache {
void sparse_mla_avx512_f32(const SparseMlaParams&) { TORCH_CHECK(false, "the avx512bf16 CPU path needs an x86-64 CPU"); }
}  // namespace indexcache

#endif
