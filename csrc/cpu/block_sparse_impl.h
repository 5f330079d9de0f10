// The bodies of MiniMax-M3's block-sparse CPU kernels (block_sparse.cpp), written once and
// compiled once per ISA path: block_sparse.cpp includes this file inside a namespace, plainly
// (portable) and under `#pragma GCC target` for AVX2+FMA and for AVX-512, and the compiler
// vectorises the lane loops below for each (independent lanes: no fast-math needed, and the
// summation order is fixed, so every path is deterministic). No includes: the includer has them.
//
// Vectors: GCC generic vectors of the ISA's native width (below); axpy loops (the attention's
// P·V) are element-wise and auto-vectorised.

// x [n] (fp32 or bf16) -> fp32 dst [n].
inline void to_float(const void* x, DType dt, int64_t n, float* dst) {
  if (dt == DType::kFloat32) {
    std::memcpy(dst, x, sizeof(float) * n);
    return;
  }
  const uint16_t* b = static_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(b[i]) << 16);
}

// y[i] = y[i] * alpha + p * x[i].
inline void scale_axpy(float* __restrict y, float alpha, float p, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * alpha + p * x[i];
}

inline void axpy(float* __restrict y, float p, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

// Block scores of one query row: bs[h][b] = max over block b's keys i < n of q[h] · key(i).
// key_row(i) gives key i's row; qf [h][d] fp32; tile scratch of block_size + kChunk keys x d.
// The block's keys are converted once into chunks of kChunk keys stored [d][kChunk] (keys across
// the lanes), then up to 4 heads x kChunk keys of scores accumulate in registers over d (one
// key-vector load feeds 4 FMAs): a small GEMM per chunk, max-pooled as soon as it is done.
constexpr int64_t kChunk = 16;

// The ISA's native fp32 vector as a GCC generic vector (the includer sets IC_VEC_BYTES: 64 for
// AVX-512, 32 for AVX2, 16 otherwise); wider generic vectors would live in memory.
typedef float vnf __attribute__((vector_size(IC_VEC_BYTES)));
constexpr int64_t kVecLanes = IC_VEC_BYTES / 4;
constexpr int64_t kChunkVecs = kChunk / kVecLanes;

// Unaligned, aliasing-safe loads and stores of a vnf (plain vector loads; a memcpy through the
// stack would cost store-forwarding stalls).
typedef float vnf_u __attribute__((vector_size(IC_VEC_BYTES), aligned(4), may_alias));

// a * b + c, fused where the ISA has FMA (-std=c++20 turns GCC's contraction off, so a plain
// a * b + c would cost a multiply and an add).
inline vnf fma_v(vnf a, vnf b, vnf c) {
#if IC_VEC_BYTES == 64
  return _mm512_fmadd_ps(a, b, c);
#elif IC_VEC_BYTES == 32
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// Σ a[i] * b[i] for i < n (n a multiple of kChunk, the callers pad): kChunkVecs vector partial
// sums, then the kChunk lanes reduced pairwise, in a fixed order.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  vnf acc[kChunkVecs];
  for (int64_t v = 0; v < kChunkVecs; ++v) acc[v] = vnf{};
  for (int64_t i = 0; i < n; i += kChunk)
    for (int64_t v = 0; v < kChunkVecs; ++v)
      acc[v] += *reinterpret_cast<const vnf_u*>(a + i + v * kVecLanes) *
                *reinterpret_cast<const vnf_u*>(b + i + v * kVecLanes);
  float lanes[kChunk];
  for (int64_t v = 0; v < kChunkVecs; ++v) *reinterpret_cast<vnf_u*>(lanes + v * kVecLanes) = acc[v];
  for (int64_t w = kChunk / 2; w > 0; w /= 2)
    for (int64_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

template <int NH>
inline void chunk_scores(const float* __restrict qf, int64_t d, const float* __restrict tt, float* __restrict s,
                         int64_t ss = kChunk) {
  vnf acc[NH][kChunkVecs];
  for (int hh = 0; hh < NH; ++hh)
    for (int64_t v = 0; v < kChunkVecs; ++v) acc[hh][v] = vnf{};
  for (int64_t c = 0; c < d; ++c) {
    vnf t[kChunkVecs];
    for (int64_t v = 0; v < kChunkVecs; ++v) t[v] = *reinterpret_cast<const vnf_u*>(tt + c * kChunk + v * kVecLanes);
    for (int hh = 0; hh < NH; ++hh) {
      const float qv = qf[hh * d + c];
      for (int64_t v = 0; v < kChunkVecs; ++v) acc[hh][v] += qv * t[v];
    }
  }
  for (int hh = 0; hh < NH; ++hh)
    for (int64_t v = 0; v < kChunkVecs; ++v) *reinterpret_cast<vnf_u*>(s + hh * ss + v * kVecLanes) = acc[hh][v];
}

typedef int32_t vni __attribute__((vector_size(IC_VEC_BYTES)));

// exp(x) for x <= 0 (softmax numerators), lane-wise: 2^n · e^r with |r| <= ln2/2 (n rounded
// half away from zero, r by a two-part ln2), degree-6 Taylor polynomial for e^r (relative error
// ~2e-7); below -87 gives exp(-87) ~ 1.6e-38; NaN stays NaN.
inline vnf exp_v(vnf x) {
  const vnf lo = vnf{} - 87.0f;
  x = x < lo ? lo : x;
  const vni ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vni);  // x <= 0: truncation = ceil
  const vnf n = __builtin_convertvector(ni, vnf);
  vnf r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  vnf q = vnf{} + 1.0f / 720;
  q = q * r + 1.0f / 120;
  q = q * r + 1.0f / 24;
  q = q * r + 1.0f / 6;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r + 1.0f;
  const vni bits = (ni + 127) << 23;
  vnf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return q * scale;
}

// p[i] = exp(s[i] - mx) for i < n (s padded to a multiple of kVecLanes), returns Σ p[i], i < n, in order.
inline float exp_sum(float* s, int64_t n, float mx) {
  for (int64_t i = 0; i < n; i += kVecLanes) {
    vnf v = *reinterpret_cast<const vnf_u*>(s + i);
    *reinterpret_cast<vnf_u*>(s + i) = exp_v(v - mx);
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += s[i];
  return sum;
}

// Transposed key tile: rows i < nk of key_row (d values) into chunks of kChunk keys stored
// [dl][kChunk] (dl >= d; rows d..dl-1 are left as they are: zero).
template <class KeyRow>
inline void load_tile_t(KeyRow key_row, int64_t i0, int64_t nk, int64_t d, int64_t dl, DType dt, float* tile,
                        float* row) {
  for (int64_t i = 0; i < nk; ++i) {
    to_float(key_row(i0 + i), dt, d, row);
    float* t = tile + (i / kChunk) * dl * kChunk + i % kChunk;
    for (int64_t c = 0; c < d; ++c) t[c * kChunk] = row[c];
  }
}

// s[h][i] = qf[h] · key i for the nk keys of a transposed tile (d padded, pad rows zero); s rows
// of stride ss (>= nk rounded up to kChunk).
inline void tile_scores(const float* qf, int64_t h, int64_t d, int64_t nk, const float* tile, float* s, int64_t ss) {
  for (int64_t ch = 0; ch * kChunk < nk; ++ch)
    for (int64_t h0 = 0; h0 < h; h0 += 4) {
      const float* q0 = qf + h0 * d;
      const float* tt = tile + ch * d * kChunk;
      float* so = s + h0 * ss + ch * kChunk;
      switch (std::min<int64_t>(4, h - h0)) {
        case 4: chunk_scores<4>(q0, d, tt, so, ss); break;
        case 3: chunk_scores<3>(q0, d, tt, so, ss); break;
        case 2: chunk_scores<2>(q0, d, tt, so, ss); break;
        default: chunk_scores<1>(q0, d, tt, so, ss); break;
      }
    }
}

// acc[h][:] += Σ_i p[h][i] · v[i][:] over nk value rows v [nk][dp] (dp a multiple of kChunk); the
// accumulator chunk stays in registers across the keys.
inline void tile_pv(float* acc, const float* pr, int64_t ps, int64_t h, int64_t nk, const float* v, int64_t dp) {
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t c = 0; c < dp; c += kChunk) {
      vnf a[kChunkVecs];
      for (int64_t u = 0; u < kChunkVecs; ++u) a[u] = *reinterpret_cast<const vnf_u*>(acc + hh * dp + c + u * kVecLanes);
      for (int64_t i = 0; i < nk; ++i) {
        const float pv = pr[hh * ps + i];
        for (int64_t u = 0; u < kChunkVecs; ++u) a[u] += pv * *reinterpret_cast<const vnf_u*>(v + i * dp + c + u * kVecLanes);
      }
      for (int64_t u = 0; u < kChunkVecs; ++u) *reinterpret_cast<vnf_u*>(acc + hh * dp + c + u * kVecLanes) = a[u];
    }
}

// Query vectors scored together where every row of a group sees a whole block: 8 accumulator
// chains on AVX-512 (one vector per 16-key chunk); AVX2 / SSE already have 8 with 4 heads.
constexpr int64_t kPoolVecs = kChunkVecs == 1 ? 8 : 4;

// Block scores of a group of rows of one request: bs[r][h][b] = max over block b's keys i < n[r]
// of q[r][h] · key(i) (-inf where the block has none). key_row(i) gives key i's row; qf [rows][h][d]
// fp32; tile scratch of (block_size + kChunk) x d floats; row scratch of d; nb blocks per bs row.
// Each key block is converted and transposed once for the whole group.
template <class KeyRow>
void score_blocks(const float* qf, const int64_t* n, int64_t rows, int64_t h, int64_t d, int64_t nb,
                  int64_t block_size, DType dt, KeyRow key_row, float* tile, float* row, float* bs) {
  int64_t n_max = 0;
  for (int64_t r = 0; r < rows; ++r) n_max = std::max(n_max, n[r]);
  float s[4 * kChunk], sp[kPoolVecs * kChunk];
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * block_size, nk = std::max<int64_t>(0, std::min(n_max, i0 + block_size) - i0);
    for (int64_t i = 0; i < nk; ++i) {
      to_float(key_row(i0 + i), dt, d, row);
      float* t = tile + (i / kChunk) * d * kChunk + i % kChunk;
      for (int64_t c = 0; c < d; ++c) t[c * kChunk] = row[c];
    }
    bool full = nk == block_size;
    for (int64_t r = 0; r < rows; ++r) full = full && n[r] >= i0 + block_size;
    if (full && rows * h >= kPoolVecs) {
      // Every row sees the whole block: the rows' query vectors are contiguous ([rows][h][d]), so
      // kPoolVecs of them share each key-vector load (more independent FMA chains than 4 heads).
      for (int64_t m0 = 0; m0 < rows * h; m0 += kPoolVecs) {
        const int64_t nm = std::min<int64_t>(kPoolVecs, rows * h - m0);
        float mp[kPoolVecs];
        bool nanp[kPoolVecs];
        for (int64_t mm = 0; mm < nm; ++mm) mp[mm] = ninf, nanp[mm] = false;
        for (int64_t ch = 0; ch * kChunk < nk; ++ch) {
          const float* tt = tile + ch * d * kChunk;
          if (nm == kPoolVecs) {
            chunk_scores<kPoolVecs>(qf + m0 * d, d, tt, sp);
          } else {
            for (int64_t mm = 0; mm < nm; ++mm) chunk_scores<1>(qf + (m0 + mm) * d, d, tt, sp + mm * kChunk);
          }
          const int64_t valid = std::min(kChunk, nk - ch * kChunk);
          for (int64_t mm = 0; mm < nm; ++mm)
            for (int64_t j = 0; j < valid; ++j) {
              const float v = sp[mm * kChunk + j];
              nanp[mm] = nanp[mm] || std::isnan(v);
              mp[mm] = v > mp[mm] ? v : mp[mm];
            }
        }
        for (int64_t mm = 0; mm < nm; ++mm)
          bs[(m0 + mm) * nb + b] = nanp[mm] ? std::numeric_limits<float>::quiet_NaN() : mp[mm];
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t nr = std::max<int64_t>(0, std::min(n[r], i0 + block_size) - i0);  // this row's keys here
      const int64_t nch = (nr + kChunk - 1) / kChunk;
      for (int64_t h0 = 0; h0 < h; h0 += 4) {
        const int64_t nh = std::min<int64_t>(4, h - h0);
        float m[4] = {ninf, ninf, ninf, ninf};
        bool nan[4] = {false, false, false, false};
        for (int64_t ch = 0; ch < nch; ++ch) {
          const float* tt = tile + ch * d * kChunk;
          const float* q0 = qf + (r * h + h0) * d;
          switch (nh) {
            case 4: chunk_scores<4>(q0, d, tt, s); break;
            case 3: chunk_scores<3>(q0, d, tt, s); break;
            case 2: chunk_scores<2>(q0, d, tt, s); break;
            default: chunk_scores<1>(q0, d, tt, s); break;
          }
          const int64_t valid = std::min(kChunk, nr - ch * kChunk);
          for (int64_t hh = 0; hh < nh; ++hh)
            for (int64_t j = 0; j < valid; ++j) {
              const float v = s[hh * kChunk + j];
              nan[hh] = nan[hh] || std::isnan(v);
              m[hh] = v > m[hh] ? v : m[hh];
            }
        }
        for (int64_t hh = 0; hh < nh; ++hh)  // amax propagates NaN
          bs[(r * h + h0 + hh) * nb + b] = nan[hh] ? std::numeric_limits<float>::quiet_NaN() : m[hh];
      }
    }
  }
}

// ------------------------------------------------------------------ attention: shared K/V tiles
//
// The attention's inner loops are two small GEMMs per selected block: S = Q · Kᵀ over the query
// vectors (row, head) of one KV group that select the block, then O += P · V. Both run as
// register-blocked micro-kernels: kMR query vectors x kNW lanes (two native vectors) of
// accumulators, one broadcast of a q (or p) value feeding two FMAs. Keys lie across the lanes
// in the score kernel (Kᵀ tile [d][keys]), value columns in the P·V kernel (V tile [keys][d]).
// Every (row, head) is reduced in the same order whatever else shares its panel, so the result
// does not depend on how rows are grouped or on the thread count.

constexpr int64_t kNW = 2 * kVecLanes;
// Query vectors per micro-kernel panel: 12 x 2 accumulators + 2 tile vectors fit AVX-512's 32
// registers, 6 x 2 + 2 + 1 the 16 of AVX2 / SSE.
constexpr int kMR = IC_VEC_BYTES == 64 ? 12 : 6;

inline vnf load_v(const float* x) { return *reinterpret_cast<const vnf_u*>(x); }
inline void store_v(float* x, vnf v) { *reinterpret_cast<vnf_u*>(x) = v; }

// s[r][j] = Σ_c qp[c][r] · kt[c][j] for r < MR, j < ncols (a multiple of kNW). qp is one packed
// panel [d][kMR] of query vectors; kt the transposed key tile [d][ldk]; s rows of stride lds.
template <int MR>
inline void panel_scores(const float* __restrict qp, int64_t d, const float* __restrict kt, int64_t ldk,
                         int64_t ncols, float* __restrict s, int64_t lds) {
  for (int64_t j = 0; j < ncols; j += kNW) {
    vnf a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vnf{};
    const float* k = kt + j;
    for (int64_t c = 0; c < d; ++c, k += ldk) {
      const vnf k0 = load_v(k), k1 = load_v(k + kVecLanes);
      const float* q = qp + c * kMR;
      for (int r = 0; r < MR; ++r) {
        const vnf qv = vnf{} + q[r];
        a0[r] = fma_v(qv, k0, a0[r]);
        a1[r] = fma_v(qv, k1, a1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      store_v(s + r * lds + j, a0[r]);
      store_v(s + r * lds + j + kVecLanes, a1[r]);
    }
  }
}

// ob[r][:dp] (+)= Σ_{k0 <= i < nk} pr[r][i] · vrow[i][:dp] for r < MR (dp a multiple of kNW): added
// to ob's values when add, else written; pr rows of stride lds, ob rows of stride dp; vrow[i]
// points at value row i (fp32, dp readable floats). Keys go in ascending order, so keys [0, j)
// then [j, nk) with add give bit for bit what [0, nk) gives.
template <int MR>
inline void panel_pv(const float* __restrict pr, int64_t lds, const float* const* vrow, int64_t dp, int64_t k0,
                     int64_t nk, bool add, float* __restrict ob) {
  for (int64_t c = 0; c < dp; c += kNW) {
    vnf a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) {
      a0[r] = add ? load_v(ob + r * dp + c) : vnf{};
      a1[r] = add ? load_v(ob + r * dp + c + kVecLanes) : vnf{};
    }
    for (int64_t i = k0; i < nk; ++i) {
      const float* v = vrow[i] + c;
      const vnf v0 = load_v(v), v1 = load_v(v + kVecLanes);
      for (int r = 0; r < MR; ++r) {
        const vnf pv = vnf{} + pr[r * lds + i];
        a0[r] = fma_v(pv, v0, a0[r]);
        a1[r] = fma_v(pv, v1, a1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      store_v(ob + r * dp + c, a0[r]);
      store_v(ob + r * dp + c + kVecLanes, a1[r]);
    }
  }
}

template <int MR = kMR>
inline void panel_scores_n(int mr, const float* qp, int64_t d, const float* kt, int64_t ldk, int64_t ncols, float* s,
                           int64_t lds) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_scores_n<MR - 1>(mr, qp, d, kt, ldk, ncols, s, lds);
  }
  panel_scores<MR>(qp, d, kt, ldk, ncols, s, lds);
}

template <int MR = kMR>
inline void panel_pv_n(int mr, const float* pr, int64_t lds, const float* const* vt, int64_t dp, int64_t k0,
                       int64_t nk, bool add, float* ob) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_pv_n<MR - 1>(mr, pr, lds, vt, dp, k0, nk, add, ob);
  }
  panel_pv<MR>(pr, lds, vt, dp, k0, nk, add, ob);
}

#if defined(IC_BF16_DOT)
// bf16 scores by vdpbf16ps (AVX-512 BF16): the same panel as panel_scores, on bf16 pairs. qp2 is
// a panel [d/2][ldq] of q pairs (q[2c], q[2c+1]) as 32-bit words, kt2 the key tile [d/2][ldk] of
// key pairs; each instruction adds two products per lane to the fp32 accumulator, in a fixed order.
template <int MR>
inline void panel_scores_bf16(const uint32_t* __restrict qp2, int64_t ldq, int64_t d2, const uint32_t* __restrict kt2,
                              int64_t ldk, int64_t ncols, float* __restrict s, int64_t lds) {
  for (int64_t j = 0; j < ncols; j += kNW) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const uint32_t* k = kt2 + j;
    for (int64_t c = 0; c < d2; ++c, k += ldk) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + kVecLanes);
      const uint32_t* q = qp2 + c * ldq;
      for (int r = 0; r < MR; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r]));
        a0[r] = _mm512_dpbf16_ps(a0[r], k0, qv);
        a1[r] = _mm512_dpbf16_ps(a1[r], k1, qv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(s + r * lds + j, a0[r]);
      _mm512_storeu_ps(s + r * lds + j + kVecLanes, a1[r]);
    }
  }
}

template <int MR = kMR>
inline void panel_scores_bf16_n(int mr, const uint32_t* qp2, int64_t ldq, int64_t d2, const uint32_t* kt2,
                                int64_t ldk, int64_t ncols, float* s, int64_t lds) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_scores_bf16_n<MR - 1>(mr, qp2, ldq, d2, kt2, ldk, ncols, s, lds);
  }
  panel_scores_bf16<MR>(qp2, ldq, d2, kt2, ldk, ncols, s, lds);
}

#include "block_sparse_bf16.h"
#if defined(IC_AMX)
#include "block_sparse_amx.h"
#endif
#endif

// One query vector's scores of one block, in place: s[j] *= scale, then p[j] = exp(s[j] - m) for
// the nk visible keys (0 for the rest up to ncols, a multiple of kVecLanes), m the running max
// max(*run_max, max_j s[j]). Returns Σ p (fixed order) and sets *run_max = m, *alpha =
// exp(old - m), *bad |= a visible score was NaN or ±inf.
inline float block_softmax(float* s, int64_t nk, int64_t ncols, float scale, float* run_max, float* alpha, bool* bad) {
  vni lane;
  for (int64_t j = 0; j < kVecLanes; ++j) lane[j] = static_cast<int32_t>(j);
  const vnf ninf = vnf{} - std::numeric_limits<float>::infinity();
  vnf vmax = ninf;
  vni vbad = vni{};
  for (int64_t j = 0; j < ncols; j += kVecLanes) {
    const vnf v = load_v(s + j) * scale;
    store_v(s + j, v);
    const vni ok = (lane + static_cast<int32_t>(j)) < static_cast<int32_t>(nk);
    vbad |= ok & ~((v - v) == vnf{});  // v - v is 0 exactly when v is finite
    vmax = (ok & (v > vmax)) ? v : vmax;
  }
  float mx = *run_max;
  bool b = false;
  for (int64_t j = 0; j < kVecLanes; ++j) {
    mx = vmax[j] > mx ? vmax[j] : mx;
    b = b || vbad[j] != 0;
  }
  *bad = *bad || b;
  *alpha = std::exp(*run_max - mx);
  *run_max = mx;
  vnf vsum = vnf{};
  for (int64_t j = 0; j < ncols; j += kVecLanes) {
    const vni ok = (lane + static_cast<int32_t>(j)) < static_cast<int32_t>(nk);
    const vnf e = ok ? exp_v(load_v(s + j) - mx) : vnf{};
    store_v(s + j, e);
    vsum += e;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < kVecLanes; ++j) sum += vsum[j];
  return sum;
}

// Rows grouped per attention task: consecutive rows of one request, so a block that several of
// them select is loaded (converted, transposed) once for all of them and all heads of the KV
// group. Up to kGroupVecs query vectors per group bound the scratch (its o rows 512 KiB; a block
// touches only the rows of the vectors that select it, in L2; 64 rows at 64 heads measured ~5 %
// faster than 32 on Zen 4 / 5, where each block's tiles were packed twice); groups shrink while
// there are fewer than two tasks per thread. Grouping never changes a result (each query vector's
// arithmetic is its own), only how often tiles are loaded.
constexpr int64_t kGroupVecs = 1024, kAttnMaxRows = 64;

inline void attention_groups(const BlockSparseAttnParams& p, std::vector<int64_t>& starts) {
  const int64_t g = p.h_q / p.h_kv;
  int64_t r = std::clamp<int64_t>(kGroupVecs / g, 1, kAttnMaxRows);
  const int64_t threads = at::get_num_threads();
  while (r > 1 && (p.s_q + r - 1) / r * p.h_kv < 2 * threads) r = (r + 1) / 2;
  starts.clear();
  for (int64_t t = 0; t < p.s_q; ++t)
    if (starts.empty() || t - starts.back() >= r || p.req[t] != p.req[starts.back()]) starts.push_back(t);
  starts.push_back(p.s_q);
}

// Panel starts of m_n query vectors, then m_n: near-equal panels of at most kMR vectors (16:
// 8 + 8, not 12 + 4: a short last panel would run with few FMA chains per load), none crossing
// a multiple of chunk (the bf16 query panels are packed kQChunk vectors at a time).
inline void panel_starts(int64_t m_n, int64_t chunk, std::vector<int64_t>& pst) {
  pst.clear();
  for (int64_t c0 = 0; c0 < m_n; c0 += chunk) {
    const int64_t n = std::min(chunk, m_n - c0), n_pan = (n + kMR - 1) / kMR, base = n / n_pan, extra = n % n_pan;
    for (int64_t pn = 0; pn < n_pan; ++pn) pst.push_back(c0 + pn * base + std::min(pn, extra));
  }
  pst.push_back(m_n);
}

// sel[0, n) sorted by block, stably (counting sort: O(n + blocks), where a std::sort of the
// (block, row) pairs took 2-4 % of the op at 8-16 heads). Pairs enter row by row, so the order is
// (block, row) ascending, as std::sort gives.
inline void sort_by_block(std::vector<std::pair<int32_t, int32_t>>& sel, int64_t n, std::vector<int64_t>& cnt,
                          std::vector<std::pair<int32_t, int32_t>>& tmp) {
  int64_t nb = 0;
  for (int64_t i = 0; i < n; ++i) nb = std::max<int64_t>(nb, sel[i].first + 1);
  cnt.assign(nb + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++cnt[sel[i].first + 1];
  for (int64_t b = 0; b < nb; ++b) cnt[b + 1] += cnt[b];
  for (int64_t i = 0; i < n; ++i) tmp[cnt[sel[i].first]++] = sel[i];
  std::copy(tmp.begin(), tmp.begin() + n, sel.begin());
}

// Scratch of one attention task (per thread): sized for the largest group.
struct AttnScratch {
  std::vector<float> qg, o, run_max, run_sum, alpha, kt, vt, qp, s, ob, kstage;
  std::vector<const float*> krow, vrow;
  std::vector<const char*> kr, vr, qv;  // the current block's key / value rows (bf16 path), vectors' q
  std::vector<uint32_t> kt2, vt2, qp2, zero;  // bf16 pairs (avx512bf16 path)
  std::vector<uint16_t> ph, pl;               // P_hi, P_lo (avx512bf16 path)
  std::vector<char> bad, has;
  std::vector<std::pair<int32_t, int32_t>> sel, sel2;  // (block, row in group); sort scratch
  std::vector<int64_t> cnt;                           // sort scratch: a count per block
  std::vector<int64_t> nk, vg, pst;  // per block vector: keys seen, index in the group's [rows][g]
  // fused: P·V writes the o rows itself (block_sparse_attention's fused path), so no ob rows.
  AttnScratch(int64_t mv, int64_t max_rows, int64_t topk, int64_t d, int64_t dp, int64_t ss, bool bf16, bool fused)
      : qg(bf16 ? 0 : mv * d), o(mv * dp), run_max(mv), run_sum(mv), alpha(mv), kt(bf16 ? 0 : d * ss, 0.0f),
        vt(bf16 ? 0 : ss * dp, 0.0f), qp(bf16 ? 0 : (mv + kMR - 1) / kMR * d * kMR), s(mv * ss), ob(fused ? 0 : mv * dp),
        kstage(bf16 ? 0 : kNW * d), krow(kNW), vrow(ss), kr(ss), vr(ss), qv(mv), kt2(bf16 ? d / 2 * ss : 0, 0u),
        vt2(bf16 ? ss / 2 * dp : 0, 0u), qp2(bf16 ? (mv + 15) / 16 * 16 * (d / 2) : 0, 0u)  /* kQChunk-vector chunks */, zero(d / 2 + 16, 0u),
        ph(bf16 ? mv * ss : 0), pl(bf16 ? mv * ss : 0), bad(mv), has(max_rows), sel(max_rows * topk), sel2(max_rows * topk), nk(mv), vg(mv) {}
};

#if defined(IC_LANES)
#include "block_sparse_lanes.h"
#endif

// One block's fp32 tiles: Kᵀ [d][ss] written kNW keys at a time from rows staged in L1 (a
// whole-tile scatter would touch d lines per key); fp32 value rows are read in place (d == dp),
// others converted into vt [ss][dp]. Keys past nk_max are never loaded: nothing reads them.
template <class Slot>
inline void load_block_f32(const BlockSparseAttnParams& p, int64_t kh, int64_t i0, int64_t nk_max, int64_t dp,
                           int64_t ss, Slot slot_of, AttnScratch& w) {
  const int64_t d = p.d, es = elem_size(p.dtype);
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  for (int64_t i = 0; i < nk_max; i += kNW) {
    const int64_t nc = std::min<int64_t>(kNW, nk_max - i);
    for (int64_t k = 0; k < nc; ++k) {
      const int64_t off = (slot_of(i0 + i + k) * p.h_kv + kh) * d * es;
      if (p.dtype == DType::kFloat32) {
        w.krow[k] = reinterpret_cast<const float*>(kc + off);
        if (d == dp) {
          w.vrow[i + k] = reinterpret_cast<const float*>(vc + off);
        } else {
          std::memcpy(&w.vt[(i + k) * dp], vc + off, d * sizeof(float));
          w.vrow[i + k] = &w.vt[(i + k) * dp];
        }
      } else {
        to_float(kc + off, p.dtype, d, &w.kstage[k * d]);
        w.krow[k] = &w.kstage[k * d];
        to_float(vc + off, p.dtype, d, &w.vt[(i + k) * dp]);
        w.vrow[i + k] = &w.vt[(i + k) * dp];
      }
    }
    for (int64_t k = nc; k < kNW; ++k) w.krow[k] = w.krow[0];  // lanes masked later
    for (int64_t c = 0; c < d; ++c) {
      float* dst = &w.kt[c * ss + i];
      for (int64_t k = 0; k < kNW; ++k) dst[k] = w.krow[k][c];
    }
  }
}

// One task per (row group, KV head), KV head major: consecutive tasks read one head's slice of
// the cache, which stays in the last-level cache between them. The group's (block, row)
// selections are sorted by block; each distinct block's visible keys are loaded once (fp32: Kᵀ
// [d][ss], V [ss][dp]; bf16 on the avx512bf16 path: key-channel pairs [d/2][ss], value key
// pairs [ss/2][dp]), the query vectors of the rows that select it are packed into panels,
// scored, softmaxed online per query vector (blocks ascending for every row), and P · V is added.
inline void attention(const BlockSparseAttnParams& p) {
  const int64_t es = elem_size(p.dtype), g = p.h_q / p.h_kv, bsz = p.block_size, d = p.d;
  const int64_t dp = (d + kNW - 1) / kNW * kNW, ss = (bsz + kNW - 1) / kNW * kNW;
  const float ninf = -std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> starts;
  attention_groups(p, starts);
  const int64_t ngroups = static_cast<int64_t>(starts.size()) - 1;
  int64_t max_rows = 1;
  for (int64_t gi = 0; gi < ngroups; ++gi) max_rows = std::max(max_rows, starts[gi + 1] - starts[gi]);
  const int64_t mv = max_rows * g;
#if defined(IC_BF16_DOT)
  const bool dot_bf16 = p.dtype == DType::kBFloat16 && d % 2 == 0;  // both products by vdpbf16ps
#else
  const bool dot_bf16 = false;
#endif
#if defined(IC_BF16_DOT) && !defined(IC_AMX)
  const bool fused = dot_bf16;  // softmax + P split in one pass, P·V writes o = o·alpha + P·V
#else
  const bool fused = false;
#endif
  at::parallel_for(0, ngroups * p.h_kv, 1, [&](int64_t w0, int64_t w1) {
    AttnScratch w(mv, max_rows, p.topk, d, dp, ss, dot_bf16, fused);
#if defined(IC_LANES)
    LaneScratch ls(dot_bf16 ? 0 : mv, d, dp, dot_bf16 ? 0 : ss);  // bf16 on vdpbf16ps: not used
#endif
#if defined(IC_AMX)
    // The blas path: AMX tiles for both products (block_sparse_amx.h). Tiles read whole 16-row,
    // 32-column panels: channel pairs up to d32 / 2 (zero past d / 2), score and P rows up to a
    // multiple of 16 vectors.
    const int64_t d32 = (d + 31) / 32 * 32, mv16 = (mv + kAmxRows - 1) / kAmxRows * kAmxRows;
    std::vector<uint16_t> qa(dot_bf16 ? kAmxRows * d32 : 0, 0);
    std::vector<int64_t> tk(mv16), rank(mv16);
    alignas(64) float tmp[kAmxRows * 32];
    if (dot_bf16) {
      w.kt2.assign(d32 / 2 * ss, 0u);
      w.s.resize(mv16 * ss);
      w.ph.resize(mv16 * ss);
      w.pl.resize(mv16 * ss);
      amx_configure();
    }
    TileRelease release_tiles;
#endif
    for (int64_t task = w0; task < w1; ++task) {
      const int64_t kh = task / ngroups, gi = task % ngroups, t0 = starts[gi], rows = starts[gi + 1] - t0;
      const int32_t* bt = p.block_table + static_cast<int64_t>(p.req[t0]) * p.max_pages;
      int64_t nsel = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < p.topk; ++j) {
          const int32_t blk = p.blocks[((t0 + r) * p.h_kv + kh) * p.topk + j];
          if (blk >= 0 && static_cast<int64_t>(blk) * bsz <= p.pos[t0 + r])
            w.sel[nsel++] = {blk, static_cast<int32_t>(r)};
        }
      std::fill(w.has.begin(), w.has.end(), 0);
      for (int64_t i = 0; i < nsel; ++i) w.has[w.sel[i].second] = 1;
      sort_by_block(w.sel, nsel, w.cnt, w.sel2);
      nsel = std::unique(w.sel.begin(), w.sel.begin() + nsel) - w.sel.begin();  // duplicates count once
      auto q_of = [&](int64_t r, int64_t hh) {
        return static_cast<const char*>(p.q) + (((t0 + r) * p.h_q) + kh * g + hh) * d * es;
      };
      if (!dot_bf16)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t hh = 0; hh < g; ++hh) to_float(q_of(r, hh), p.dtype, d, &w.qg[(r * g + hh) * d]);
      std::fill(w.o.begin(), w.o.begin() + rows * g * dp, 0.0f);
      std::fill(w.run_max.begin(), w.run_max.begin() + rows * g, ninf);
      std::fill(w.run_sum.begin(), w.run_sum.begin() + rows * g, 0.0f);
      std::fill(w.bad.begin(), w.bad.begin() + rows * g, 0);
      auto slot_of = [&](int64_t i) {
        return static_cast<int64_t>(bt[i / p.page_size]) * p.page_size + i % p.page_size;
      };
      // ob[m..m+mr) (+)= P · V over keys [k0, nk) of the current block (k0 even on the bf16 path).
      // Fused (bf16 without AMX): straight into the vectors' o rows, o·alpha first unless add. (The
      // AMX build's bf16 P·V is its tiles' loop below: the panels never run there.)
      auto pv_keys = [&](int mr, int64_t m, int64_t k0, int64_t nk, bool add) {
#if defined(IC_BF16_DOT) && !defined(IC_AMX)
        if (fused) {
          float* orow[kMR];
          for (int r = 0; r < mr; ++r) orow[r] = &w.o[w.vg[m + r] * dp];
          return panel_pv_bf16_n(mr, reinterpret_cast<const uint32_t*>(&w.ph[m * ss]),
                                 reinterpret_cast<const uint32_t*>(&w.pl[m * ss]), ss / 2, &w.s[m * ss], ss,
                                 w.vt2.data(), dp, k0 / 2, nk, add ? PvInit::kLoad : PvInit::kScale, &w.alpha[m], orow);
        }
#endif
        panel_pv_n(mr, &w.s[m * ss], ss, w.vrow.data(), dp, k0, nk, add, &w.ob[m * dp]);
      };
      // The selections [a, *b) of block sel[a]: *b and the keys the furthest row reads there.
      auto block_run = [&](int64_t a, int64_t* b) {
        const int64_t i0 = static_cast<int64_t>(w.sel[a].first) * bsz;
        int64_t nk = 0;
        for (*b = a; *b < nsel && w.sel[*b].first == w.sel[a].first; ++*b)
          nk = std::max(nk, std::min<int64_t>(p.pos[t0 + w.sel[*b].second] + 1, i0 + bsz) - i0);
        return nk;
      };
      // f(i, byte offset of key i0 + i's row of KV head kh in the caches) for i < nk: a walk over
      // the pages, no division per row.
      auto each_row = [&](int64_t i0, int64_t nk, auto&& f) {
        int64_t pg = i0 / p.page_size, in = i0 % p.page_size;
        for (int64_t i = 0; i < nk; ++i) {
          f(i, ((static_cast<int64_t>(bt[pg]) * p.page_size + in) * p.h_kv + kh) * d * es);
          if (++in == p.page_size) in = 0, ++pg;
        }
      };
      // The next block's key and value rows into L2 while this one is computed: a KV head's rows
      // lie h_kv * d apart in pages spread over the cache, which the hardware prefetch misses.
      auto prefetch_block = [&](int64_t a) {
        if (a >= nsel) return;
        int64_t b;
        const int64_t nk = block_run(a, &b), i0 = static_cast<int64_t>(w.sel[a].first) * bsz;
        for (int64_t i = 0; i < nk; ++i) {
          const int64_t off = (slot_of(i0 + i) * p.h_kv + kh) * d * es;
          for (int64_t l = 0; l < d * es; l += 64) {
            __builtin_prefetch(static_cast<const char*>(p.k_cache) + off + l, 0, 2);
            __builtin_prefetch(static_cast<const char*>(p.v_cache) + off + l, 0, 2);
          }
        }
      };
#if defined(IC_LANES)
      // fp32 (and bf16 where vdpbf16ps does not run): query vectors across the lanes
      // (block_sparse_lanes.h); in this build the panels below run only for vdpbf16ps.
      const bool lanes = !dot_bf16;
      if (lanes) lanes_task(p, t0, nsel, block_run, each_row, w, ls);
#else
      const bool lanes = false;
#endif
      for (int64_t a = 0; a < (lanes ? 0 : nsel);) {
        int64_t b;
        const int64_t i0 = static_cast<int64_t>(w.sel[a].first) * bsz, nk_max = block_run(a, &b);
        const int64_t m_n = (b - a) * g, ncols = (nk_max + kNW - 1) / kNW * kNW;
        for (int64_t j = 0, m = 0; j < b - a; ++j) {
          const int64_t r = w.sel[a + j].second, nkr = std::min<int64_t>(p.pos[t0 + r] + 1, i0 + bsz) - i0;
          for (int64_t hh = 0; hh < g; ++hh, ++m) w.nk[m] = nkr, w.vg[m] = r * g + hh, w.qv[m] = q_of(r, hh);
        }
        panel_starts(m_n, dot_bf16 ? 16 : std::max<int64_t>(m_n, 1), w.pst);  // bf16: kQChunk
        const int64_t n_pan = static_cast<int64_t>(w.pst.size()) - 1;
#if defined(IC_BF16_DOT)
        if (dot_bf16) {
          const int64_t d2 = d / 2;
          const char* kc = static_cast<const char*>(p.k_cache);
          const char* vc = static_cast<const char*>(p.v_cache);
          each_row(i0, nk_max, [&](int64_t i, int64_t off) { w.kr[i] = kc + off, w.vr[i] = vc + off; });
          pack_keys_bf16([&](int64_t i) { return w.kr[i]; }, nk_max, d2, w.zero.data(), w.kt2.data(), ss);
          pack_values_bf16([&](int64_t i) { return w.vr[i]; }, nk_max, d, dp, w.vt2.data());
          prefetch_block(b);
#if defined(IC_AMX)
          for (int64_t m0 = 0; m0 < m_n; m0 += kAmxRows) {
            for (int64_t j = 0; j < kAmxRows && m0 + j < m_n; ++j)  // rows past m_n: never read
              std::memcpy(&qa[j * d32], w.qv[m0 + j], d * es);
            amx_scores(qa.data(), d32, w.kt2.data(), ss, ncols, &w.s[m0 * ss], ss);
          }
#else
          const uint32_t* qrows[kQChunk];
          for (int64_t c0 = 0; c0 < m_n; c0 += kQChunk) {
            for (int64_t j = 0; j < kQChunk; ++j)
              qrows[j] = c0 + j < m_n ? reinterpret_cast<const uint32_t*>(w.qv[c0 + j])
                                      : w.zero.data();
            pack_t16(qrows, d2, &w.qp2[c0 * d2], kQChunk);
          }
          for (int64_t pn = 0; pn < n_pan; ++pn) {
            const int64_t m0 = w.pst[pn];
            panel_scores_bf16_n(static_cast<int>(w.pst[pn + 1] - m0), &w.qp2[m0 / kQChunk * kQChunk * d2 + m0 % kQChunk],
                                kQChunk, d2, w.kt2.data(), ss, ncols, &w.s[m0 * ss], ss);
          }
#endif
        } else
#endif
        {
          load_block_f32(p, kh, i0, nk_max, dp, ss, slot_of, w);
          prefetch_block(b);
          for (int64_t pn = 0; pn < n_pan; ++pn) {
            const int64_t m0 = w.pst[pn];
            for (int64_t m = m0; m < w.pst[pn + 1]; ++m) {
              const float* src = &w.qg[w.vg[m] * d];
              float* dst = &w.qp[pn * d * kMR + m - m0];
              for (int64_t c = 0; c < d; ++c) dst[c * kMR] = src[c];
            }
            panel_scores_n(static_cast<int>(w.pst[pn + 1] - m0), &w.qp[pn * d * kMR], d, w.kt.data(), ss, ncols,
                           &w.s[m0 * ss], ss);
          }
        }
#if defined(IC_AMX)
        // Each 16-vector tile's P rows go in the order of their tile key counts, descending (ties:
        // vector order): rank[m] is vector m's P row.
        if (dot_bf16)
          for (int64_t m0 = 0; m0 < m_n; m0 += kAmxRows) {
            const int64_t m1 = std::min(m_n, m0 + kAmxRows);
            for (int64_t m = m0; m < m1; ++m) tk[m] = w.nk[m] / 32 * 32;
            for (int64_t m = m0; m < m1; ++m) {
              rank[m] = m0;
              for (int64_t o = m0; o < m1; ++o) rank[m] += tk[o] > tk[m] || (tk[o] == tk[m] && o < m);
            }
          }
#endif
        for (int64_t m = 0; m < m_n; ++m) {
          const int64_t gm = w.vg[m];
          bool bm = w.bad[gm];
#if defined(IC_BF16_DOT)
          const float sum = fused ? block_softmax_split_bf16(&w.s[m * ss], w.nk[m], ncols, p.scale, &w.run_max[gm],
                                                             &w.alpha[m], &bm, &w.ph[m * ss], &w.pl[m * ss])
                                  : block_softmax(&w.s[m * ss], w.nk[m], ncols, p.scale, &w.run_max[gm], &w.alpha[m], &bm);
#else
          const float sum = block_softmax(&w.s[m * ss], w.nk[m], ncols, p.scale, &w.run_max[gm], &w.alpha[m], &bm);
#endif
          w.bad[gm] = bm;
          w.run_sum[gm] = w.run_sum[gm] * w.alpha[m] + sum;
#if defined(IC_BF16_DOT)
#if defined(IC_AMX)
          if (dot_bf16) split_p_bf16(&w.s[m * ss], ncols, &w.ph[rank[m] * ss], &w.pl[rank[m] * ss]);
#endif
#endif
        }
#if defined(IC_AMX)
        // P·V on the tiles over each vector's first tk keys, the rest of its keys alone (vdpbf16ps).
        if (dot_bf16)
          for (int64_t m0 = 0; m0 < m_n; m0 += kAmxRows) {
            const int64_t m1 = std::min(m_n, m0 + kAmxRows);
            int64_t tks[kAmxRows] = {}, nat[kAmxRows] = {};
            for (int64_t m = m0; m < m1; ++m) tks[rank[m] - m0] = tk[m], nat[rank[m] - m0] = m;
            amx_pv(&w.ph[m0 * ss], &w.pl[m0 * ss], ss, tks, nat, w.vt2.data(), dp, w.ob.data(), tmp);
            for (int64_t m = m0; m < m1; ++m) {
              float* obm = &w.ob[m * dp];
              if (tk[m] < w.nk[m])
                panel_pv_bf16<1>(reinterpret_cast<const uint32_t*>(&w.ph[rank[m] * ss]),
                                 reinterpret_cast<const uint32_t*>(&w.pl[rank[m] * ss]), ss / 2, &w.s[m * ss], ss,
                                 w.vt2.data(), dp, tk[m] / 2, w.nk[m], tk[m] > 0 ? PvInit::kLoad : PvInit::kZero,
                                 nullptr, &obm);
            }
          }
        for (int64_t pn = 0; pn < (dot_bf16 ? 0 : n_pan); ++pn) {
#else
        for (int64_t pn = 0; pn < n_pan; ++pn) {
#endif
          const int64_t m0 = w.pst[pn], mr = w.pst[pn + 1] - m0;
          int64_t nk_min = w.nk[m0], nk_top = w.nk[m0];
          for (int64_t m = m0 + 1; m < m0 + mr; ++m) {
            nk_min = std::min(nk_min, w.nk[m]);
            nk_top = std::max(nk_top, w.nk[m]);
          }
          // Keys every vector of the panel reads go through the panel; the keys a vector reads past
          // those (a row whose position ends inside this block) it adds alone, in the same order.
          const int64_t k_common = nk_min == nk_top ? nk_min : (dot_bf16 ? nk_min & ~int64_t{1} : nk_min);
          pv_keys(static_cast<int>(mr), m0, 0, k_common, false);
          if (k_common < nk_top)
            for (int64_t m = m0; m < m0 + mr; ++m) pv_keys(1, m, k_common, w.nk[m], true);
        }
        for (int64_t m = 0; m < (fused ? 0 : m_n); ++m) {  // fused: P·V wrote o
          float* acc = &w.o[w.vg[m] * dp];
          const float* add = &w.ob[m * dp];
          const vnf al = vnf{} + w.alpha[m];
          for (int64_t c = 0; c < dp; c += kVecLanes) store_v(acc + c, fma_v(load_v(acc + c), al, load_v(add + c)));
        }
        a = b;
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t hh = 0; hh < g; ++hh) {
          const int64_t gm = r * g + hh, hq = (t0 + r) * p.h_q + kh * g + hh;
          const bool empty = !w.has[r];
          p.lse[hq] = w.bad[gm] ? nan : (empty ? ninf : w.run_max[gm] + std::log(w.run_sum[gm]));
          const float inv = w.bad[gm] ? nan : (empty ? 0.0f : 1.0f / w.run_sum[gm]);
          const float* acc = &w.o[gm * dp];
          if (p.dtype == DType::kFloat32) {
            float* out = static_cast<float*>(p.out) + hq * d;
            for (int64_t c = 0; c < d; ++c) out[c] = acc[c] * inv;
          } else {
            at::BFloat16* out = static_cast<at::BFloat16*>(p.out) + hq * d;
            for (int64_t c = 0; c < d; ++c) out[c] = at::BFloat16(acc[c] * inv);
          }
        }
      }
    }
  });
}
