// block_sparse_attention's block kernels with the query vectors across the lanes: fp32 attention on
// the avx2 path (8 lanes of __m256) and on the avx512bf16 path (16 lanes of __m512), and bf16 on the
// avx2 path. block_sparse_impl.h includes this in its AVX2+FMA and AVX-512 builds (IC_LANES set); one
// source, the vector type and the micro-kernels' blocking taken from the build's width (LaneVec
// below). No includes: the includer has them.
//
// Why a layout of its own: with keys across the lanes (the panels in block_sparse_impl.h) every
// selected block's keys are transposed into a Kᵀ tile by a scalar scatter (block_size x d values
// per block, a large share of the op while a block feeds only 32-64 query vectors), and the
// softmax reduces each query vector's max and sum across lanes. Here the block's query vectors lie
// across the lanes instead:
//   S[key][m] = Σ_c K[key][c] · Qᵀ[c][m]: key rows broadcast from a contiguous tile, the vectors'
//     q rows packed per block into Qᵀ [d][ldm] by 8 x 8 register transposes (m_n x d values);
//   the online softmax runs lane-wise down the key rows (no horizontal reductions);
//   O[m][:] = O[m][:]·α[m] + Σ_key P[key][m] · V[key][:]: value rows from a contiguous tile, P
//     broadcast, written straight into the o rows.
// Both products are register-blocked micro-kernels of kMR keys or vectors x 2 vectors of lanes:
// AVX2 6 x 16 lanes (12 accumulators of its 16 registers), AVX-512 12 x 32 lanes (24 of its 32;
// the broadcasts are memory operands), 2 loads + kMR broadcasts per 2·kMR FMAs. The tiles of the
// next block are filled while the current one is computed (RowCopy). Each query vector's arithmetic
// is its own and in a fixed order (dot over c ascending, sums over keys ascending), whatever lanes
// or panel it shares: results do not depend on grouping or thread count, nor on the width (the
// 8- and 16-lane builds give the same bits).

constexpr int kLaneMR = kMR;  // keys per score panel, query vectors per P·V panel (panel_starts)

// The build's fp32 vector for the micro-kernels, as intrinsics: GCC kept arrays of generic vectors
// on the stack here (the kernel ran at half its FMA rate), so the accumulators stay named intrinsics.
struct LaneVec {
#if IC_VEC_BYTES == 64
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V from_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
#else
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V from_bf16(const uint16_t* p) { return ::indexcache::avx2::bf16x8(p); }
#endif
};
constexpr int64_t kLaneW = kVecLanes;  // lanes per vector: 8 or 16
using LV = LaneVec;

inline int64_t lanes_up(int64_t m) { return (m + kLaneW - 1) / kLaneW * kLaneW; }

// Qᵀ [d][ldm] of the query vectors qrow[m], m < m_n; lanes m_n .. ldm - 1 (ldm a multiple of 8)
// from zrow, d zeros.
inline void pack_q_lanes(const float* const* qrow, int64_t m_n, int64_t d, const float* zrow, float* qt, int64_t ldm) {
  const float* rows[8];
  for (int64_t m0 = 0; m0 < ldm; m0 += 8) {
    for (int64_t j = 0; j < 8; ++j) rows[j] = m0 + j < m_n ? qrow[m0 + j] : zrow;
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(rows[j] + c);
      ::indexcache::avx2::transpose8_store(r, qt + c * ldm + m0, ldm);
    }
    for (; c < d; ++c)
      for (int64_t j = 0; j < 8; ++j) qt[c * ldm + m0 + j] = rows[j][c];
  }
}

// The next block's key and value rows, copied (fp32) or converted into the idle pair of tiles while
// the current block is computed: in MiniMax-M3's cache a KV head's rows lie h_kv * d * es apart
// (2 KiB), each in few L1 / L2 sets, so rows read in place missed on every pass, a block-wide
// software prefetch stalled as long as the copy it was meant to hide (and its lines fell out of L2's
// few sets before use), and a copy at the block's start waited on DRAM for about a third of the op
// at 8 query heads. The copy keeps pace with the block's work (upto: the rows due so far), each row
// prefetched kAhead rows before it is copied. In the AVX-512 build, where d is a multiple of 16, the
// copy runs inside the micro-kernels' inner loops instead, one key and one value vector per
// iteration (step, each prefetching the same columns kAhead rows on), so its loads and stores
// overlap the FMAs: 2-7 % faster on the AMX Xeon than copying between the micro-kernel calls, where a
// hot block's copy alone (no DRAM miss) cost a quarter of the op at 8 query heads. The AVX2 build
// copies between the calls: its 16 registers leave no room, and step() there cost 10-15 %.

// x [n] (fp32 or bf16) -> fp32 dst [n], kLaneW lanes at a time (no call: rows are 512 bytes).
inline void row_to_float(const void* x, DType dt, int64_t n, float* dst) {
  int64_t i = 0;
  if (dt == DType::kFloat32) {
    const float* f = static_cast<const float*>(x);
    for (; i + kLaneW <= n; i += kLaneW) LV::store(dst + i, LV::load(f + i));
    for (; i < n; ++i) dst[i] = f[i];
    return;
  }
  const uint16_t* b = static_cast<const uint16_t*>(x);
  for (; i + kLaneW <= n; i += kLaneW) LV::store(dst + i, LV::from_bf16(b + i));
  for (; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(b[i]) << 16);
}

constexpr bool kPacedCopy = kLaneW == 16;

struct RowCopy {
  static constexpr int64_t kAhead = 8;  // 4-12 measured alike, 1 and 32 slower (8-lane, bursts)
  static constexpr int64_t kLead = 8;   // rows the paced copy may run ahead of the rows due
  const char* kc = nullptr;
  const char* vc = nullptr;
  DType dt = DType::kFloat32;
  int64_t d = 0, dp = 0, row_bytes = 0, n = 0, done = 0;
  const int64_t* off = nullptr;  // byte offsets of the rows in the caches
  float* kt = nullptr;           // [n][d]
  float* vt = nullptr;           // [n][dp]
  int64_t limit = 0, col = 0;    // rows the paced copy may reach; the next column of row `done`

  bool paced() const { return kPacedCopy && d % kLaneW == 0; }
  void prefetch(int64_t i) const {
    for (int64_t l = 0; l < row_bytes; l += 64) {
      __builtin_prefetch(kc + off[i] + l, 0, 3);
      __builtin_prefetch(vc + off[i] + l, 0, 3);
    }
  }
  void start() {
    for (int64_t i = 0; i < std::min(n, kAhead); ++i) prefetch(i);
    col = 0;
    limit = paced() ? std::min(n, kLead) : 0;
  }
  // One key vector and one value vector of row `done`, while short of limit (the micro-kernels'
  // inner loops call this where kPacedCopy).
  void step() {
    if (done >= limit) return;
    const int64_t es = dt == DType::kFloat32 ? 4 : 2;
    const char* ks = kc + off[done] + col * es;
    const char* vs = vc + off[done] + col * es;
    if (done + kAhead < n) {  // the same columns kAhead rows on
      __builtin_prefetch(kc + off[done + kAhead] + col * es, 0, 3);
      __builtin_prefetch(vc + off[done + kAhead] + col * es, 0, 3);
    }
    if (dt == DType::kFloat32) {
      LV::store(kt + done * d + col, LV::load(reinterpret_cast<const float*>(ks)));
      LV::store(vt + done * dp + col, LV::load(reinterpret_cast<const float*>(vs)));
    } else {
      LV::store(kt + done * d + col, LV::from_bf16(reinterpret_cast<const uint16_t*>(ks)));
      LV::store(vt + done * dp + col, LV::from_bf16(reinterpret_cast<const uint16_t*>(vs)));
    }
    if ((col += kLaneW) == d) ++done, col = 0;
  }
  // Rows [0, m) are due (m clamped to n): left to step() with kLead rows of slack where paced, else
  // (and at the block's end: now) copied here.
  void upto(int64_t m, bool now = false) {
    m = std::min(m, n);
    if (!now && paced()) {
      limit = std::min(n, m + kLead);
      return;
    }
    const int64_t es = dt == DType::kFloat32 ? 4 : 2;
    for (; done < m; ++done, col = 0) {
      if (done + kAhead < n) prefetch(done + kAhead);
      row_to_float(kc + off[done] + col * es, dt, d - col, kt + done * d + col);
      row_to_float(vc + off[done] + col * es, dt, d - col, vt + done * dp + col);
    }
  }
};

// s[r][W·v + l] = key r · Qᵀ[:, W·v + l] for r < MR keys (rows of kt, d apart), v < NV vectors of
// W = kLaneW lanes; qt points at the first lane, rows of qt and s ldm apart.
template <int MR, int NV>
inline void lane_scores(const float* kt, const float* __restrict qt, int64_t ldm, int64_t d, float* __restrict s,
                        RowCopy& next) {
  // Named accumulators, loops unrolled by pragma: GCC kept an array of vectors on the stack and
  // stored it every iteration (the kernel ran at half its FMA rate).
  LV::V a0[MR], a1[MR];
  const float* k[MR];
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r) {
    k[r] = kt + r * d;
    a0[r] = LV::zero();
    a1[r] = LV::zero();
  }
  for (int64_t c = 0; c < d; ++c) {
    const LV::V q0 = LV::load(qt + c * ldm);
    const LV::V q1 = NV > 1 ? LV::load(qt + c * ldm + kLaneW) : q0;
    if constexpr (kPacedCopy) next.step();
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      const LV::V kb = LV::bcast(k[r] + c);
      a0[r] = LV::fmadd(kb, q0, a0[r]);
      if (NV > 1) a1[r] = LV::fmadd(kb, q1, a1[r]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r) {
    LV::store(s + r * ldm, a0[r]);
    if (NV > 1) LV::store(s + r * ldm + kLaneW, a1[r]);
  }
}

template <int NV, int MR = kLaneMR>
inline void lane_scores_n(int mr, const float* kt, const float* qt, int64_t ldm, int64_t d, float* s, RowCopy& next) {
  if constexpr (MR > 1) {
    if (mr < MR) return lane_scores_n<NV, MR - 1>(mr, kt, qt, ldm, d, s, next);
  }
  lane_scores<MR, NV>(kt, qt, ldm, d, s, next);
}

// One kLaneW-lane column of a block's scores s [nk_max][ldm] (s points at its first lane) in place
// to P: s *= scale; per lane m, m_new = max(rmax, visible scores) (key i visible while i < nk[m]),
// P = exp(s - m_new) on visible keys, 0 elsewhere; alpha = exp(rmax - m_new) (0 from -inf),
// rsum = rsum·alpha + Σ_i P[i] (keys ascending), rmax = m_new, bad |= a visible score was NaN or ±inf.
// Generic vectors of the build's width (vnf, vni: the same lanes as LV::V).
inline void lane_softmax(float* s, int64_t ldm, int64_t nk_max, const int32_t* nk, float scale, float* rmax,
                         float* rsum, float* alpha, int32_t* bad) {
  typedef int32_t vni_u __attribute__((vector_size(IC_VEC_BYTES), aligned(4), may_alias));
  const vni nkv = *reinterpret_cast<const vni_u*>(nk);
  const vnf ninf = vnf{} - std::numeric_limits<float>::infinity();
  vnf vmax = ninf;
  vni vbad = vni{};
  for (int64_t i = 0; i < nk_max; ++i) {
    const vnf v = load_v(s + i * ldm) * scale;
    store_v(s + i * ldm, v);
    const vni ok = nkv > static_cast<int32_t>(i);
    vbad |= ok & ~((v - v) == vnf{});  // v - v is 0 exactly when v is finite
    vmax = (ok & (v > vmax)) ? v : vmax;
  }
  const vnf old = load_v(rmax);
  const vnf mx = vmax > old ? vmax : old;
  const vnf al = old == ninf ? vnf{} : exp_v(old - mx);
  vnf vsum = vnf{};
  for (int64_t i = 0; i < nk_max; ++i) {
    const vnf e = nkv > static_cast<int32_t>(i) ? exp_v(load_v(s + i * ldm) - mx) : vnf{};
    store_v(s + i * ldm, e);
    vsum += e;
  }
  store_v(rmax, mx);
  store_v(alpha, al);
  store_v(rsum, load_v(rsum) * al + vsum);
  *reinterpret_cast<vni_u*>(bad) = *reinterpret_cast<const vni_u*>(bad) | vbad;
}

// orow[r][:dp] = orow[r][:dp]·alpha[r] (alpha null: as they are) + Σ_{k0 <= i < nk} P[i][r] · V[i][:dp]
// for r < MR query vectors (dp a multiple of 2·kLaneW); pc points at the panel's first lane of P,
// rows ldm apart; vt the value tile [keys][dp].
template <int MR>
inline void lane_pv(const float* __restrict pc, int64_t ldm, const float* __restrict vt, int64_t k0, int64_t nk,
                    int64_t dp, const float* alpha, float* const* orow, RowCopy& next) {
  for (int64_t c = 0; c < dp; c += 2 * kLaneW) {
    LV::V a0[MR], a1[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      a0[r] = LV::load(orow[r] + c);
      a1[r] = LV::load(orow[r] + c + kLaneW);
      if (alpha != nullptr) {
        const LV::V al = LV::set1(alpha[r]);
        a0[r] = LV::mul(a0[r], al);
        a1[r] = LV::mul(a1[r], al);
      }
    }
    for (int64_t i = k0; i < nk; ++i) {
      const LV::V v0 = LV::load(vt + i * dp + c), v1 = LV::load(vt + i * dp + c + kLaneW);
      const float* p = pc + i * ldm;
      if constexpr (kPacedCopy) next.step();
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const LV::V pb = LV::bcast(p + r);
        a0[r] = LV::fmadd(pb, v0, a0[r]);
        a1[r] = LV::fmadd(pb, v1, a1[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      LV::store(orow[r] + c, a0[r]);
      LV::store(orow[r] + c + kLaneW, a1[r]);
    }
  }
}

template <int MR = kLaneMR>
inline void lane_pv_n(int mr, const float* pc, int64_t ldm, const float* vt, int64_t k0, int64_t nk, int64_t dp,
                      const float* alpha, float* const* orow, RowCopy& next) {
  if constexpr (MR > 1) {
    if (mr < MR) return lane_pv_n<MR - 1>(mr, pc, ldm, vt, k0, nk, dp, alpha, orow, next);
  }
  lane_pv<MR>(pc, ldm, vt, k0, nk, dp, alpha, orow, next);
}

// A task's lane scratch, sized for mv query vectors (a block's are at most the group's); two pairs
// of K / V tiles, the current block's and the next one's.
struct LaneScratch {
  int64_t ldm_max;
  std::vector<float> qt, s, rmax, rsum, alpha, zrow, kt[2], vt[2];  // kt [ss][d], vt [ss][dp] (zero past d)
  std::vector<int32_t> nk, bad;
  std::vector<int64_t> pst, off;
  std::vector<const float*> qrow;
  std::vector<float*> orow;
  LaneScratch(int64_t mv, int64_t d, int64_t dp, int64_t ss)
      : ldm_max(lanes_up(mv)), qt(d * ldm_max), s(ss * ldm_max), rmax(ldm_max), rsum(ldm_max), alpha(ldm_max),
        zrow(d, 0.0f), kt{std::vector<float>(ss * d), std::vector<float>(ss * d)},
        vt{std::vector<float>(ss * dp, 0.0f), std::vector<float>(ss * dp, 0.0f)}, nk(ldm_max), bad(ldm_max),
        off(ss), qrow(mv), orow(mv) {}
};

// One block for m_n query vectors: ls.qrow[m] their fp32 q rows (d), ls.nk[m] their visible keys
// (<= nk_max), ls.orow[m] their o rows (dp), ls.rmax / rsum / bad[m] their running softmax state
// (lanes m_n .. up to a multiple of kLaneW: nk 0); kt / vt the block's nk_max key rows [nk_max][d] and
// value rows [nk_max][dp] (zero past d). next: the next block's rows, copied along the way.
inline void lanes_block(int64_t m_n, int64_t nk_max, int64_t d, int64_t dp, float scale, const float* kt,
                        const float* vt, LaneScratch& ls, RowCopy& next) {
  const int64_t ldm = lanes_up(m_n);
  // Work units (lane-keys of the scores, vector-keys of P·V) done, of total: next gets its share.
  const int64_t total = nk_max * (ldm + m_n);
  int64_t work = 0;
  pack_q_lanes(ls.qrow.data(), m_n, d, ls.zrow.data(), ls.qt.data(), ldm);
  for (int64_t m0 = 0; m0 < ldm; m0 += 2 * kLaneW) {
    // Two vectors of lanes: kLaneMR keys x 2 vectors; a one-vector tail: 2·kLaneMR keys x 1 vector
    // (kLaneMR chains would leave the FMA pipes waiting on their latency).
    const int64_t nl = std::min<int64_t>(2 * kLaneW, ldm - m0), step = nl == 2 * kLaneW ? kLaneMR : 2 * kLaneMR;
    for (int64_t i = 0; i < nk_max; i += step) {
      const int mr = static_cast<int>(std::min<int64_t>(step, nk_max - i));
      if (nl == 2 * kLaneW)
        lane_scores_n<2>(mr, kt + i * d, &ls.qt[m0], ldm, d, &ls.s[i * ldm + m0], next);
      else
        lane_scores_n<1, 2 * kLaneMR>(mr, kt + i * d, &ls.qt[m0], ldm, d, &ls.s[i * ldm + m0], next);
      work += mr * nl;
      next.upto(next.n * work / total);
    }
  }
  for (int64_t m0 = 0; m0 < ldm; m0 += kLaneW)
    lane_softmax(&ls.s[m0], ldm, nk_max, &ls.nk[m0], scale, &ls.rmax[m0], &ls.rsum[m0], &ls.alpha[m0], &ls.bad[m0]);
  panel_starts(m_n, m_n, ls.pst);  // near-equal panels of <= kLaneMR vectors
  for (size_t pn = 0; pn + 1 < ls.pst.size(); ++pn) {
    const int64_t m0 = ls.pst[pn];
    const int mr = static_cast<int>(ls.pst[pn + 1] - m0);
    int64_t nk_min = ls.nk[m0];
    for (int r = 1; r < mr; ++r) nk_min = std::min<int64_t>(nk_min, ls.nk[m0 + r]);
    // Keys every vector of the panel sees go through the panel; a vector whose row ends further
    // inside this block adds its own keys past those alone, in the same order.
    lane_pv_n(mr, &ls.s[m0], ldm, vt, 0, nk_min, dp, &ls.alpha[m0], &ls.orow[m0], next);
    for (int r = 0; r < mr; ++r)
      if (ls.nk[m0 + r] > nk_min)
        lane_pv<1>(&ls.s[m0 + r], ldm, vt, nk_min, ls.nk[m0 + r], dp, nullptr, &ls.orow[m0 + r], next);
    work += mr * nk_max;
    next.upto(next.n * work / total);
  }
  next.upto(next.n, true);
}

// One attention task's blocks on the lanes: the group's selections sel[0, nsel) of KV head kh
// (sorted by block, rows t0 ..), the query vectors' fp32 q rows in w.qg, their o rows and softmax
// state in w; block_run / each_row as attention() defines them. Each block's K / V tiles are
// copied while the block before it is computed (RowCopy), the first one up front.
template <class BlockRun, class EachRow>
inline void lanes_task(const BlockSparseAttnParams& p, int64_t t0, int64_t nsel, BlockRun&& block_run,
                       EachRow&& each_row, AttnScratch& w, LaneScratch& ls) {
  const int64_t g = p.h_q / p.h_kv, bsz = p.block_size, d = p.d;
  const int64_t dp = (d + kNW - 1) / kNW * kNW;  // as attention(): o rows and value tiles
  const float ninf = -std::numeric_limits<float>::infinity();
  RowCopy next;
  next.kc = static_cast<const char*>(p.k_cache), next.vc = static_cast<const char*>(p.v_cache);
  next.dt = p.dtype, next.d = d, next.dp = dp, next.row_bytes = d * elem_size(p.dtype), next.off = ls.off.data();
  auto copy_of = [&](int64_t a, int cur) {  // next: block sel[a]'s rows into tiles cur
    next.n = next.done = 0;
    if (a >= nsel) return;
    int64_t b;
    next.n = block_run(a, &b);
    each_row(static_cast<int64_t>(w.sel[a].first) * bsz, next.n, [&](int64_t i, int64_t off) { ls.off[i] = off; });
    next.kt = ls.kt[cur].data(), next.vt = ls.vt[cur].data();
    next.start();
  };
  copy_of(0, 0);
  next.upto(next.n, true);
  for (int64_t a = 0, cur = 0; a < nsel; cur ^= 1) {
    int64_t b;
    const int64_t i0 = static_cast<int64_t>(w.sel[a].first) * bsz, nk_max = block_run(a, &b);
    const int64_t m_n = (b - a) * g, ldm = lanes_up(m_n);
    for (int64_t j = 0, m = 0; j < b - a; ++j) {
      const int64_t r = w.sel[a + j].second, nkr = std::min<int64_t>(p.pos[t0 + r] + 1, i0 + bsz) - i0;
      for (int64_t hh = 0; hh < g; ++hh, ++m) w.nk[m] = nkr, w.vg[m] = r * g + hh;
    }
    for (int64_t m = 0; m < ldm; ++m) {
      const bool real = m < m_n;
      const int64_t gm = real ? w.vg[m] : 0;
      if (real) ls.qrow[m] = &w.qg[gm * d], ls.orow[m] = &w.o[gm * dp];
      ls.nk[m] = real ? static_cast<int32_t>(w.nk[m]) : 0;
      ls.rmax[m] = real ? w.run_max[gm] : ninf;
      ls.rsum[m] = real ? w.run_sum[gm] : 0.0f;
      ls.bad[m] = real ? w.bad[gm] : 0;
    }
    copy_of(b, static_cast<int>(cur ^ 1));
    lanes_block(m_n, nk_max, d, dp, p.scale, ls.kt[cur].data(), ls.vt[cur].data(), ls, next);
    for (int64_t m = 0; m < m_n; ++m) {
      const int64_t gm = w.vg[m];
      w.run_max[gm] = ls.rmax[m], w.run_sum[gm] = ls.rsum[m], w.bad[gm] = ls.bad[m] != 0;
    }
    a = b;
  }
}
