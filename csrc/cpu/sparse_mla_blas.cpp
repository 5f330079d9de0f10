// Sparse MLA on the "blas" path (blas.h): per query row, the selected cache rows are taken
// kBlock at a time and
//   S = Q[h, d_qk] · Kᵀ         (fp32 out; d_qk 576, or 512 for DeepSeek-V4)
//   O += P[h, kBlock] · V        (accumulating in fp32: P = P_hi + P_lo, each bf16)
// with an online softmax between them (running max and sum per head, O rescaled when the max
// grows). On a CPU with AMX-BF16 both products run on the tiles themselves (namespace amx below);
// elsewhere (AVX-512 CPUs, where the path is only ever forced) through oneDNN's brgemm, the rows
// packed into the bf16-pair layouts it takes for B.
// P is split into two bf16 parts as the avx512bf16 path does, so P·V carries P to ~16 bits
// (one bf16 P moved a bf16 model's attention 1.7e-3 from the other paths' on an AMX Xeon, and
// prefill, on this path, from decode over an fp32 cache, which runs avx512bf16's kernels).
// Rows with few query rows split their selected keys across threads; the task
// that finishes a row's last split merges the partial (max, sum, O) in split order, so results
// do not depend on timing and the op needs one parallel region (waking the other threads
// twice cost more than the merge on a busy machine).
// Non-finite scores follow docs/ops.md: any NaN / ±inf score of (row, head) makes that
// head's out and lse NaN; a row with no valid index gives 0 and -inf. Attention sinks
// (SparseMlaParams::sinks) join only the final normalisation (store_row, mla_finish).
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

#include "aligned.h"
#include "blas.h"
#include "mla_slots.h"
#include "indexcache/fp8.h"
#include "simd.h"

namespace indexcache {
namespace {

using cpu::exp_ps;

constexpr int64_t kBlock = 128;          // selected keys per brgemm pair (N of S, K of P·V)
constexpr int64_t kMinSplitKeys = 256;   // a key split keeps at least this many selections

struct Work {
  cpu::AlignedVec<uint32_t> qb;   // AMX: the row's q as channel pairs x heads [d_qk / 2][hp]
  cpu::AlignedVec<float> st;      // AMX: Sᵀ [kBlock][hp]
  cpu::AlignedVec<uint16_t> deq;  // fp8 rows dequantized to bf16 [kBlock][576]
  cpu::AlignedVec<uint32_t> kb;   // Kᵀ as pairs [d_qk / 2][kBlock]
  cpu::AlignedVec<uint32_t> vb;   // V as key pairs [kBlock/2][d_v]
  cpu::AlignedVec<float> s;       // [h][kBlock]
  cpu::AlignedVec<uint16_t> pb;   // P's bf16 high part [h][kBlock]
  cpu::AlignedVec<uint16_t> pl;   // P - P_hi rounded to bf16 [h][kBlock]
  cpu::AlignedVec<float> o;       // [h][d_v] unnormalised
  cpu::AlignedVec<float> m, l, z; // per head: running max, sum, NaN once a score is non-finite
};

// Cache row `slot` (D values) as bf16 (fp8 rows, D = 576 only, are dequantized into `tmp`, then
// rounded to bf16).
template <int D>
const uint16_t* kv_row(const SparseMlaParams& p, int64_t slot, uint16_t* tmp) {
  if (D != kMlaDim || p.kv_dtype == DType::kBFloat16) return static_cast<const uint16_t*>(p.kv) + slot * D;
  mla_fp8_row_to_bf16(static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes, tmp);
  return tmp;
}

// One head's block of scores s[0:n) (n <= kBlock): scales them, folds them into the
// running max / sum / NaN flag, writes P = exp(s - m) as bf16 hi + lo parts (0 past n), and returns the
// factor the head's O must be multiplied by (0 on the first block).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) float softmax_block_avx512(float* s, int64_t n, float scale,
                                                                                     float& m, float& l, float& z,
                                                                                     uint16_t* pb, uint16_t* pl) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zz = _mm512_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 16) {
    const int64_t left = n - j;
    const __mmask16 mk = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    const __m512 v = _mm512_maskz_mul_ps(mk, _mm512_loadu_ps(s + j), sc);
    _mm512_storeu_ps(s + j, v);
    mx = _mm512_mask_max_ps(mx, mk, mx, v);
    zz = _mm512_add_ps(zz, _mm512_sub_ps(v, v));
  }
  z += _mm512_reduce_add_ps(zz);
  const float m_new = std::max(m, _mm512_reduce_max_ps(mx));
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 16) {
    const int64_t left = n - j;
    const __mmask16 mk = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
    sum = _mm512_add_ps(sum, e);
    const __m256bh hi = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), (__m256i)hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_cvtpbh_ps(hi))));
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

float softmax_block_scalar(float* s, int64_t n, float scale, float& m, float& l, float& z, uint16_t* pb,
                           uint16_t* pl) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    s[j] *= scale;
    mx = std::max(mx, s[j]);
    z += s[j] - s[j];
  }
  const float m_new = std::max(m, mx);
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - m_new);
  float sum = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float e = j < n ? std::exp(s[j] - m_new) : 0.f;
    sum += e;
    pb[j] = float_to_bf16(e);
    pl[j] = float_to_bf16(e - bf16_to_float(pb[j]));
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// The block's rows (kBlock of them, each D bf16 values) packed for the two brgemms: kb [D/2][kBlock],
// row p holding every key's channel pair p (16 x 16 transposes of 32-bit pairs), and vb
// [kBlock/2][dv], key pair kp's values interleaved channel by channel (the even key in the low half).
template <int kPairs>
__attribute__((target("avx512f,avx512bw"))) void pack_block_avx512(const uint16_t* const* rows, int64_t dv,
                                                                  uint32_t* kb, uint32_t* vb) {
  static_assert(kPairs % 16 == 0 && kBlock % 16 == 0, "16 x 16 pair tiles");
  for (int64_t j0 = 0; j0 < kBlock; j0 += 16) {
    const uint32_t* r32[16];
    for (int i = 0; i < 16; ++i) r32[i] = reinterpret_cast<const uint32_t*>(rows[j0 + i]);
    for (int p0 = 0; p0 < kPairs; p0 += 16) cpu::transpose16x16_epi32(r32, p0, kb + p0 * kBlock + j0, kBlock);
  }
  for (int64_t kp = 0; kp < kBlock / 2; ++kp) cpu::interleave_keys(rows[2 * kp], rows[2 * kp + 1], dv, vb + kp * dv);
}

// Attention of row t over the selected slots sl[0:n) into w.o / w.m / w.l / w.z; rows of D.
template <int D>
void attend(const SparseMlaParams& p, int64_t t, const int32_t* sl, int64_t n, Work& w) {
  const int64_t h = p.h_q, dv = p.d_v;
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  std::fill(w.z.begin(), w.z.end(), 0.f);
  if (n == 0) return;
  constexpr int kPairs = D / 2;
  const at::BFloat16* q = reinterpret_cast<const at::BFloat16*>(static_cast<const uint16_t*>(p.q) + t * h * D);
  const bool avx512 = cpu_features().avx512bf16;  // AVX-512F/BW/BF16
  static const uint16_t zero_row[kMlaDim] = {};
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    const uint16_t* rows[kBlock];
    for (int64_t j = 0; j < kBlock; ++j)
      rows[j] = j < nb ? kv_row<D>(p, sl[j0 + j], w.deq.data() + j * kMlaDim) : zero_row;
    if (avx512) {
      pack_block_avx512<kPairs>(rows, dv, w.kb.data(), w.vb.data());
    } else {
      for (int pp = 0; pp < kPairs; ++pp) {
        uint32_t* dst = w.kb.data() + pp * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) {
          uint32_t v;
          std::memcpy(&v, rows[j] + 2 * pp, 4);
          dst[j] = v;
        }
      }
      for (int64_t kp = 0; kp < kBlock / 2; ++kp) {
        const uint16_t* a = rows[2 * kp];
        const uint16_t* b = rows[2 * kp + 1];
        uint32_t* dst = w.vb.data() + kp * dv;
        for (int64_t c = 0; c < dv; ++c) dst[c] = static_cast<uint32_t>(a[c]) | (static_cast<uint32_t>(b[c]) << 16);
      }
    }
    at::native::cpublas::brgemm(h, kBlock, D, D, kBlock, kBlock, false, q,
                                reinterpret_cast<const at::BFloat16*>(w.kb.data()), w.s.data(), true);
    const bool first = j0 == 0;
    for (int64_t hh = 0; hh < h; ++hh) {
      float* srow = w.s.data() + hh * kBlock;
      uint16_t* prow = w.pb.data() + hh * kBlock;
      uint16_t* lrow = w.pl.data() + hh * kBlock;
      const float alpha = avx512 ? softmax_block_avx512(srow, nb, p.sm_scale, w.m[hh], w.l[hh], w.z[hh], prow, lrow)
                                 : softmax_block_scalar(srow, nb, p.sm_scale, w.m[hh], w.l[hh], w.z[hh], prow, lrow);
      if (!first && alpha != 1.f) {
        float* orow = w.o.data() + hh * dv;
        for (int64_t c = 0; c < dv; ++c) orow[c] *= alpha;
      }
    }
    at::native::cpublas::brgemm(h, dv, kBlock, kBlock, dv, dv, !first,
                                reinterpret_cast<const at::BFloat16*>(w.pb.data()),
                                reinterpret_cast<const at::BFloat16*>(w.vb.data()), w.o.data(), true);
    at::native::cpublas::brgemm(h, dv, kBlock, kBlock, dv, dv, true,
                                reinterpret_cast<const at::BFloat16*>(w.pl.data()),
                                reinterpret_cast<const at::BFloat16*>(w.vb.data()), w.o.data(), true);
  }
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")
namespace amx {
#include "amx_tiles.h"

// The products on the AMX tiles themselves (cpu_features().amx_bf16), not through oneDNN: its brgemm
// ran these thin shapes (M = heads, K = 128 keys for P·V) at ~670 GFLOP/s where the tiles do 2-3
// TFLOP/s. Tiles are 16 rows x 64 bytes; a step covers 32 keys x 32 heads (four accumulators) or
// 32 x 16 for the last.
//   Sᵀ [keys][hp] = K [keys][D] · Qᵀ: A = 16 key rows x 32 channels, copied as they are (the
//       selected rows lie anywhere in the cache; a copy is a third of the work of transposing them
//       into channel pairs), B = 16 channel pairs x 16 heads of q, packed once per row.
//   O [hp][dv] += P_hi · vb + P_lo · vb: A = 16 heads x 32 keys of P, B = 16 key pairs x 16 channels.
// An accumulator element reads one row of A and one column of B in a fixed order: a head's result
// never depends on the other heads of its tile, nor on the thread count.
// The buffers start on cache lines (aligned.h), so every 64-byte tile row is one line (misaligned
// rows halved the tile rate).

// st [nk32][hp] = kc [nk32][D] · Qᵀ, Qᵀ as qb [D/2][hp] channel pairs.
template <int D>
void scores_t(const uint16_t* kc, const uint32_t* qb, int64_t hp, int64_t nk32, float* st) {
  amx_barrier();
  for (int64_t j = 0; j < nk32; j += 32) {
    const uint16_t* k0 = kc + j * D;
    const uint16_t* k1 = k0 + 16 * D;
    for (int64_t h0 = 0; h0 < hp; h0 += 32) {
      const bool two = h0 + 16 < hp;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < D; c += 32) {
        const uint32_t* b = qb + c / 2 * hp + h0;
        _tile_loadd(4, k0 + c, D * 2);
        _tile_loadd(5, k1 + c, D * 2);
        _tile_loadd(6, b, hp * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, b + 16, hp * 4);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* s0 = st + j * hp + h0;
      _tile_stored(0, s0, hp * 4);
      _tile_stored(1, s0 + 16 * hp, hp * 4);
      if (two) {
        _tile_stored(2, s0 + 16, hp * 4);
        _tile_stored(3, s0 + 16 * hp + 16, hp * 4);
      }
    }
  }
  amx_barrier();
}

// o [hp][dv] += P_hi · V + P_lo · V over the first nk32 keys: pb / pl [hp][kBlock], V as key pairs
// vb [nk32/2][dv].
void pv(const uint16_t* pb, const uint16_t* pl, int64_t hp, const uint32_t* vb, int64_t dv, int64_t nk32, float* o) {
  amx_barrier();
  for (int64_t h0 = 0; h0 < hp; h0 += 32) {
    const bool two = h0 + 16 < hp;
    for (int64_t c = 0; c < dv; c += 32) {
      float* o0 = o + h0 * dv + c;
      float* o1 = o0 + 16 * dv;
      _tile_loadd(0, o0, dv * 4);
      _tile_loadd(1, o0 + 16, dv * 4);
      if (two) {
        _tile_loadd(2, o1, dv * 4);
        _tile_loadd(3, o1 + 16, dv * 4);
      }
      for (int64_t kk = 0; kk < nk32; kk += 32) {
        const uint32_t* v = vb + kk / 2 * dv + c;
        const int64_t a = h0 * kBlock + kk;
        _tile_loadd(6, v, dv * 4);
        _tile_loadd(7, v + 16, dv * 4);
        for (const uint16_t* part : {pb, pl}) {  // P_hi, then P_lo, against the same V tiles
          _tile_loadd(4, part + a, kBlock * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, part + a + 16 * kBlock, kBlock * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
      }
      _tile_stored(0, o0, dv * 4);
      _tile_stored(1, o0 + 16, dv * 4);
      if (two) {
        _tile_stored(2, o1, dv * 4);
        _tile_stored(3, o1 + 16, dv * 4);
      }
    }
  }
  amx_barrier();
}

// vb [nk/2][dv] from the copied rows kc [nk][D]: key pair kp's first dv values interleaved channel
// by channel (the even key in the low half).
template <int D>
void pack_v(const uint16_t* kc, int64_t nk, int64_t dv, uint32_t* vb) {
  for (int64_t kp = 0; kp < nk / 2; ++kp) cpu::interleave_keys(kc + 2 * kp * D, kc + (2 * kp + 1) * D, dv, vb + kp * dv);
}

// attend() on the tiles: the same key blocks and softmax, the two products above; w.o ends as
// attend()'s, [h][dv]. Heads past h (up to hp, a multiple of 16) have zero q and are never
// stored.
template <int D>
void attend(const SparseMlaParams& p, int64_t t, const int32_t* sl, int64_t n, Work& w) {
  const int64_t h = p.h_q, dv = p.d_v, hp = (h + 15) / 16 * 16;
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  std::fill(w.z.begin(), w.z.end(), 0.f);
  if (n == 0) return;
  std::fill(w.o.begin(), w.o.end(), 0.f);
  // Qᵀ as channel pairs x heads (heads past h zero).
  static const uint32_t zero_pairs[kMlaDim / 2] = {};
  const uint16_t* q = static_cast<const uint16_t*>(p.q) + t * h * D;
  for (int64_t h0 = 0; h0 < hp; h0 += 16) {
    const uint32_t* rows[16];
    for (int i = 0; i < 16; ++i)
      rows[i] = h0 + i < h ? reinterpret_cast<const uint32_t*>(q + (h0 + i) * D) : zero_pairs;
    for (int p0 = 0; p0 < D / 2; p0 += 16) cpu::transpose16x16_epi32(rows, p0, w.qb.data() + p0 * hp + h0, hp);
  }
  uint16_t* kc = w.deq.data();  // the block's rows [kBlock][D], bf16
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0), nk32 = (nb + 31) / 32 * 32;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t slot = sl[j0 + j];
      if (D != kMlaDim || p.kv_dtype == DType::kBFloat16) {
        std::memcpy(kc + j * D, static_cast<const uint16_t*>(p.kv) + slot * D, D * 2);
      } else {
        mla_fp8_row_to_bf16(static_cast<const uint8_t*>(p.kv) + slot * kMlaFp8Bytes, kc + j * D);
      }
    }
    std::fill(kc + nb * D, kc + nk32 * D, uint16_t{0});  // P is 0 there, and 0 · NaN would not be
    scores_t<D>(kc, w.qb.data(), hp, nk32, w.st.data());
    pack_v<D>(kc, nk32, dv, w.vb.data());
    // Sᵀ back to S [hp][kBlock], 16 x 16 at a time, for the row-wise softmax.
    for (int64_t j = 0; j < nk32; j += 16)
      for (int64_t h0 = 0; h0 < hp; h0 += 16) {
        const uint32_t* rows[16];
        for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const uint32_t*>(w.st.data() + (j + i) * hp);
        cpu::transpose16x16_epi32(rows, h0, reinterpret_cast<uint32_t*>(w.s.data()) + h0 * kBlock + j, kBlock);
      }
    for (int64_t hh = 0; hh < h; ++hh) {
      const float alpha = softmax_block_avx512(w.s.data() + hh * kBlock, nb, p.sm_scale, w.m[hh], w.l[hh], w.z[hh],
                                               w.pb.data() + hh * kBlock, w.pl.data() + hh * kBlock);
      if (j0 > 0 && alpha != 1.f) {
        float* orow = w.o.data() + hh * dv;
        const __m512 a = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < dv; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), a));
      }
    }
    pv(w.pb.data(), w.pl.data(), hp, w.vb.data(), dv, nk32, w.o.data());
  }
}

// Buffer sizes of attend() on the tiles for heads padded to hp.
void size_work(Work& w, int64_t d, int64_t hp, int64_t dv) {
  w.qb.resize(d / 2 * hp);
  w.st.resize(kBlock * hp);
  w.deq.resize(kBlock * d);
  w.vb.resize(kBlock / 2 * dv);
  w.s.resize(hp * kBlock);
  w.pb.assign(hp * kBlock, 0);
  w.pl.assign(hp * kBlock, 0);
  w.o.resize(hp * dv);
}

// The tile configuration for a parallel chunk's attend() calls, the tile state released after.
struct Tiles {
  Tiles() { amx_configure(); }
  ~Tiles() { _tile_release(); }
};
}  // namespace amx
#pragma GCC pop_options
#endif

void attend_tiles(const SparseMlaParams& p, int64_t t, const int32_t* sl, int64_t n, Work& w) {
  if (p.d_qk == kMlaDim) {
    amx::attend<kMlaDim>(p, t, sl, n, w);
  } else {
    amx::attend<kMlaLatent>(p, t, sl, n, w);
  }
}

// out[c] = float_to_bf16(o[c] · scale) for c < n (a multiple of 16), 16 at a time and to the bit:
// nearest even on the integer bits (subnormals kept), a NaN quieted with its payload.
__attribute__((target("avx512f"))) void scaled_to_bf16_avx512(const float* o, float scale, int64_t n,
                                                                uint16_t* out) {
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512i one = _mm512_set1_epi32(1), round = _mm512_set1_epi32(0x7FFF);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  for (int64_t c = 0; c < n; c += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(o + c), sc));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
}

void store_row(const SparseMlaParams& p, int64_t t, int64_t hh, const float* o, float m, float l, bool bad) {
  uint16_t* out = static_cast<uint16_t*>(p.out) + (t * p.h_q + hh) * p.d_v;
  float& lse = p.lse[t * p.h_q + hh];
  // The sink only changes this normalisation (mla_finish; bit-identical without one).
  const MlaFinish f = mla_finish(m, l, bad, mla_sink(p, hh));
  lse = f.lse;
  if (f.scale != f.scale) {
    std::fill_n(out, p.d_v, float_to_bf16(quiet_nan()));
  } else if (f.scale == 0.f) {  // no valid slot (o was not written)
    std::fill_n(out, p.d_v, uint16_t{0});
  } else if (cpu_features().avx512) {
    scaled_to_bf16_avx512(o, f.scale, p.d_v, out);
  } else {
    for (int64_t c = 0; c < p.d_v; ++c) out[c] = float_to_bf16(o[c] * f.scale);
  }
}

}  // namespace

bool sparse_mla_blas(const SparseMlaParams& p) {
  if (p.q_dtype != DType::kBFloat16 || p.kv_dtype == DType::kFloat32) return false;
  const int64_t h = p.h_q, dv = p.d_v;
  const int64_t entries = p.topk + p.n_extra;  // indices, then extra_indices
  const int64_t threads = at::get_num_threads();
  // Our own AMX products where the CPU has the tiles (and AVX-512 BF16 for the softmax and
  // packing); oneDNN's brgemm elsewhere (AVX-512 CPUs, where the path is only ever forced).
  const bool tiles = cpu_features().amx_bf16 && cpu_features().avx512bf16;
  int64_t splits = 1;
  if (p.s_q < 2 * threads)
    splits = std::max<int64_t>(1, std::min<int64_t>((2 * threads + p.s_q - 1) / std::max<int64_t>(1, p.s_q),
                                                    entries / kMinSplitKeys));
  // Partials of split rows: O [h][dv], then m, l, z [h] per (row, split).
  const int64_t part_len = h * (dv + 3);
  std::vector<float> part(splits > 1 ? p.s_q * splits * part_len : 0);
  std::unique_ptr<std::atomic<int>[]> done(new std::atomic<int>[splits > 1 ? p.s_q : 0]);
  for (int64_t t = 0; t < (splits > 1 ? p.s_q : 0); ++t) done[t].store(0);
  // Row t's splits, combined in split order into out / lse.
  auto merge_row = [&](int64_t t, std::vector<float>& o) {
    o.resize(dv);
    for (int64_t hh = 0; hh < h; ++hh) {
      float m = -std::numeric_limits<float>::infinity();
      bool bad = false;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* src = part.data() + (t * splits + sp) * part_len;
        const float z = src[h * dv + 2 * h + hh];
        bad |= z != z;
        if (src[h * dv + h + hh] > 0.f) m = std::max(m, src[h * dv + hh]);
      }
      float l = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      if (!bad) {
        for (int64_t sp = 0; sp < splits; ++sp) {
          const float* src = part.data() + (t * splits + sp) * part_len;
          const float ls = src[h * dv + h + hh];
          if (!(ls > 0.f)) continue;
          const float f = std::exp(src[h * dv + hh] - m);
          l += ls * f;
          const float* os = src + hh * dv;
          for (int64_t c = 0; c < dv; ++c) o[c] += os[c] * f;
        }
      }
      store_row(p, t, hh, o.data(), m, l, bad);
    }
  };
  auto body = [&](int64_t begin, int64_t end) {
    TileRelease release;
    static thread_local Work w;
    if (tiles) {
      amx::size_work(w, p.d_qk, (h + 15) / 16 * 16, dv);
    } else {
      w.deq.resize(kBlock * kMlaDim);
      w.kb.resize(kMlaDim / 2 * kBlock);
      w.vb.resize(kBlock / 2 * dv);
      w.s.resize(h * kBlock);
      w.pb.resize(h * kBlock);
      w.pl.resize(h * kBlock);
      w.o.resize(h * dv);
    }
    w.m.resize(h);
    w.l.resize(h);
    w.z.resize(h);
    std::vector<int32_t> slots;
    std::vector<float> merged;
    std::optional<amx::Tiles> tile_state;
    if (tiles) tile_state.emplace();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / splits, sp = task % splits;
      slots.clear();
      for (int64_t j = 0; j < entries; ++j) {
        const int32_t s = mla_entry(p, t, j);
        if (s >= 0) slots.push_back(s);
      }
      const int64_t n = static_cast<int64_t>(slots.size());
      const int64_t per = ((n + splits - 1) / splits + kBlock - 1) / kBlock * kBlock;
      const int64_t a = std::min(n, sp * per), b = std::min(n, a + per);
      if (tiles) {
        attend_tiles(p, t, slots.data() + a, b - a, w);
      } else if (p.d_qk == kMlaDim) {
        attend<kMlaDim>(p, t, slots.data() + a, b - a, w);
      } else {
        attend<kMlaLatent>(p, t, slots.data() + a, b - a, w);
      }
      if (splits == 1) {
        for (int64_t hh = 0; hh < h; ++hh)
          store_row(p, t, hh, w.o.data() + hh * dv, w.m[hh], w.l[hh], w.z[hh] != w.z[hh]);
        continue;
      }
      float* dst = part.data() + task * part_len;
      if (b > a) std::copy_n(w.o.begin(), h * dv, dst);  // w.o may hold padded heads past h
      std::copy(w.m.begin(), w.m.end(), dst + h * dv);
      std::copy(w.l.begin(), w.l.end(), dst + h * dv + h);
      std::copy(w.z.begin(), w.z.end(), dst + h * dv + 2 * h);
      if (done[t].fetch_add(1, std::memory_order_acq_rel) + 1 == splits) merge_row(t, merged);
    }
  };
  if (mla_runs_inline(p, MlaKernel::kTiles)) {
    body(0, p.s_q * splits);
  } else {
    at::parallel_for(0, p.s_q * splits, 1, body);
  }
  return true;
}

}  // namespace indexcache
