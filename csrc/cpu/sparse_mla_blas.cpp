// Sparse MLA on the "blas" path (blas.h): per query row, the selected cache rows are
// gathered kBlock at a time into the layouts oneDNN's brgemm takes for B (bf16 pairs), and
//   S = Q[h, d_qk] · Kᵀ         (one brgemm, fp32 out; d_qk 576, or 512 for DeepSeek-V4)
//   O += P[h, kBlock] · V        (two brgemms, accumulating in fp32: P = P_hi + P_lo, each bf16)
// P is split into two bf16 parts as the avx512bf16 path does, so P·V carries P to ~16 bits
// (one bf16 P moved a bf16 model's attention 1.7e-3 from the other paths' on an AMX Xeon, and
// prefill, on this path, from decode over an fp32 cache, which runs avx512bf16's kernels).
// with an online softmax between them (running max and sum per head, O rescaled when the
// max grows). Rows with few query rows split their selected keys across threads; the task
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
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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
  std::vector<uint16_t> deq;  // fp8 rows dequantized to bf16 [kBlock][576]
  std::vector<uint32_t> kb;   // Kᵀ as pairs [d_qk / 2][kBlock]
  std::vector<uint32_t> vb;   // V as key pairs [kBlock/2][d_v]
  std::vector<float> s;       // [h][kBlock]
  std::vector<uint16_t> pb;   // P's bf16 high part [h][kBlock]
  std::vector<uint16_t> pl;   // P - P_hi rounded to bf16 [h][kBlock]
  std::vector<float> o;       // [h][d_v] unnormalised
  std::vector<float> m, l, z; // per head: running max, sum, NaN once a score is non-finite
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
    w.deq.resize(kBlock * kMlaDim);
    w.kb.resize(kMlaDim / 2 * kBlock);
    w.vb.resize(kBlock / 2 * dv);
    w.s.resize(h * kBlock);
    w.pb.resize(h * kBlock);
    w.pl.resize(h * kBlock);
    w.o.resize(h * dv);
    w.m.resize(h);
    w.l.resize(h);
    w.z.resize(h);
    std::vector<int32_t> slots;
    std::vector<float> merged;
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
      if (p.d_qk == kMlaDim) {
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
      if (b > a) std::copy(w.o.begin(), w.o.end(), dst);
      std::copy(w.m.begin(), w.m.end(), dst + h * dv);
      std::copy(w.l.begin(), w.l.end(), dst + h * dv + h);
      std::copy(w.z.begin(), w.z.end(), dst + h * dv + 2 * h);
      if (done[t].fetch_add(1, std::memory_order_acq_rel) + 1 == splits) merge_row(t, merged);
    }
  };
  if (mla_runs_inline(p, /*tiles=*/true)) {
    body(0, p.s_q * splits);
  } else {
    at::parallel_for(0, p.s_q * splits, 1, body);
  }
  return true;
}

}  // namespace indexcache
