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

// ob[r][:dp] = Σ_{i < nk} pr[r][i] · vrow[i][:dp] for r < MR (dp a multiple of kNW); pr rows of
// stride lds, ob rows of stride dp; vrow[i] points at value row i (fp32, dp readable floats).
// Keys go in ascending order.
template <int MR>
inline void panel_pv(const float* __restrict pr, int64_t lds, const float* const* vrow, int64_t dp, int64_t nk,
                     float* __restrict ob) {
  for (int64_t c = 0; c < dp; c += kNW) {
    vnf a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vnf{};
    for (int64_t i = 0; i < nk; ++i) {
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
inline void panel_pv_n(int mr, const float* pr, int64_t lds, const float* const* vt, int64_t dp, int64_t nk,
                       float* ob) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_pv_n<MR - 1>(mr, pr, lds, vt, dp, nk, ob);
  }
  panel_pv<MR>(pr, lds, vt, dp, nk, ob);
}

#if defined(IC_BF16_DOT)
// bf16 scores by vdpbf16ps (AVX-512 BF16): the same panel as panel_scores, on bf16 pairs. qp2 is
// a panel [d/2][kMR] of q pairs (q[2c], q[2c+1]) as 32-bit words, kt2 the key tile [d/2][ldk] of
// key pairs; each instruction adds two products per lane to the fp32 accumulator, in a fixed order.
template <int MR>
inline void panel_scores_bf16(const uint32_t* __restrict qp2, int64_t d2, const uint32_t* __restrict kt2, int64_t ldk,
                              int64_t ncols, float* __restrict s, int64_t lds) {
  for (int64_t j = 0; j < ncols; j += kNW) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const uint32_t* k = kt2 + j;
    for (int64_t c = 0; c < d2; ++c, k += ldk) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + kVecLanes);
      const uint32_t* q = qp2 + c * kMR;
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
inline void panel_scores_bf16_n(int mr, const uint32_t* qp2, int64_t d2, const uint32_t* kt2, int64_t ldk,
                                int64_t ncols, float* s, int64_t lds) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_scores_bf16_n<MR - 1>(mr, qp2, d2, kt2, ldk, ncols, s, lds);
  }
  panel_scores_bf16<MR>(qp2, d2, kt2, ldk, ncols, s, lds);
}
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
// group. Up to kGroupVecs query vectors per group bound the scratch (a few hundred KiB, L2);
// groups shrink while there are fewer than two tasks per thread. Grouping never changes a
// result (each query vector's arithmetic is its own), only how often tiles are loaded.
constexpr int64_t kGroupVecs = 512, kAttnMaxRows = 64;

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

// One task per (row group, KV head), KV head major: consecutive tasks read one head's slice of
// the cache, which stays in the last-level cache between them. The group's (block, row) selections are sorted by block;
// each distinct block's visible keys are loaded once (Kᵀ fp32 [d][ss], V fp32 [ss][dp]), the
// query vectors of the rows that select it are packed into kMR-wide panels, scored, softmaxed
// online per query vector (blocks ascending for every row, as before), and P · V is added.
inline void attention(const BlockSparseAttnParams& p) {
  const int64_t es = elem_size(p.dtype), g = p.h_q / p.h_kv, bsz = p.block_size, d = p.d;
  const int64_t dp = (d + kNW - 1) / kNW * kNW, ss = (bsz + kNW - 1) / kNW * kNW;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  const float ninf = -std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> starts;
  attention_groups(p, starts);
  const int64_t ngroups = static_cast<int64_t>(starts.size()) - 1;
  int64_t max_rows = 1;
  for (int64_t gi = 0; gi < ngroups; ++gi) max_rows = std::max(max_rows, starts[gi + 1] - starts[gi]);
  const int64_t mv = max_rows * g, panels = (mv + kMR - 1) / kMR;
#if defined(IC_BF16_DOT)
  const bool dot_bf16 = p.dtype == DType::kBFloat16 && d % 2 == 0;  // bf16 q·k by vdpbf16ps
#else
  const bool dot_bf16 = false;
#endif
  at::parallel_for(0, ngroups * p.h_kv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> qg(mv * d), o(mv * dp), run_max(mv), run_sum(mv), alpha(mv);
    std::vector<float> kt(d * ss, 0.0f), vt(ss * dp, 0.0f), qp(panels * d * kMR), s(mv * ss), ob(mv * dp);
    std::vector<float> kstage(kNW * d);
    std::vector<const float*> krow(kNW), vrow(ss);
    std::vector<uint32_t> kt2(dot_bf16 ? d / 2 * ss : 0), qp2(dot_bf16 ? panels * d / 2 * kMR : 0);
    std::vector<char> bad(mv);
    std::vector<std::pair<int32_t, int32_t>> sel(max_rows * p.topk);  // (block, row in group)
    std::vector<int64_t> nk(mv);
    std::vector<char> has(max_rows);  // the row selected a visible block
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kh = w / ngroups, gi = w % ngroups, t0 = starts[gi], rows = starts[gi + 1] - t0;
      const int32_t* bt = p.block_table + static_cast<int64_t>(p.req[t0]) * p.max_pages;
      int64_t nsel = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < p.topk; ++j) {
          const int32_t blk = p.blocks[((t0 + r) * p.h_kv + kh) * p.topk + j];
          if (blk >= 0 && static_cast<int64_t>(blk) * bsz <= p.pos[t0 + r]) sel[nsel++] = {blk, static_cast<int32_t>(r)};
        }
      std::fill(has.begin(), has.end(), 0);
      for (int64_t i = 0; i < nsel; ++i) has[sel[i].second] = 1;
      std::sort(sel.begin(), sel.begin() + nsel);
      nsel = std::unique(sel.begin(), sel.begin() + nsel) - sel.begin();  // duplicates count once
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t hh = 0; hh < g; ++hh)
          to_float(static_cast<const char*>(p.q) + (((t0 + r) * p.h_q) + kh * g + hh) * d * es, p.dtype, d,
                   &qg[(r * g + hh) * d]);
      std::fill(o.begin(), o.begin() + rows * g * dp, 0.0f);
      std::fill(run_max.begin(), run_max.begin() + rows * g, ninf);
      std::fill(run_sum.begin(), run_sum.begin() + rows * g, 0.0f);
      std::fill(bad.begin(), bad.begin() + rows * g, 0);
      auto slot_of = [&](int64_t i) {
        return static_cast<int64_t>(bt[i / p.page_size]) * p.page_size + i % p.page_size;
      };
      for (int64_t a = 0; a < nsel;) {
        int64_t b = a;
        const int64_t i0 = static_cast<int64_t>(sel[a].first) * bsz;
        int64_t nk_max = 0;
        for (; b < nsel && sel[b].first == sel[a].first; ++b)
          nk_max = std::max(nk_max, std::min<int64_t>(p.pos[t0 + sel[b].second] + 1, i0 + bsz) - i0);
        // Keys past every selecting row's position are never loaded: nothing reads them. Kᵀ is
        // written kNW keys at a time from rows staged in L1 (a whole-tile scatter would touch
        // d lines per key); fp32 value rows are read in place (d == dp), others converted.
        for (int64_t i = 0; i < nk_max; i += kNW) {
          const int64_t nc = std::min<int64_t>(kNW, nk_max - i);
          for (int64_t k = 0; k < nc; ++k) {
            const int64_t off = (slot_of(i0 + i + k) * p.h_kv + kh) * d * es;
            if (p.dtype == DType::kFloat32) {
              krow[k] = reinterpret_cast<const float*>(kc + off);
              if (d == dp) {
                vrow[i + k] = reinterpret_cast<const float*>(vc + off);
              } else {
                std::memcpy(&vt[(i + k) * dp], vc + off, d * sizeof(float));
                vrow[i + k] = &vt[(i + k) * dp];
              }
            } else {
              if (dot_bf16) {  // key pairs as 32-bit words, straight from the cache row
                const uint32_t* kw = reinterpret_cast<const uint32_t*>(kc + off);
                for (int64_t c = 0; c < d / 2; ++c) kt2[c * ss + i + k] = kw[c];
              } else {
                to_float(kc + off, p.dtype, d, &kstage[k * d]);
              }
              krow[k] = &kstage[k * d];
              to_float(vc + off, p.dtype, d, &vt[(i + k) * dp]);
              vrow[i + k] = &vt[(i + k) * dp];
            }
          }
          for (int64_t k = nc; k < kNW; ++k) krow[k] = krow[0];  // lanes masked later
          if (dot_bf16) continue;
          for (int64_t c = 0; c < d; ++c) {
            float* dst = &kt[c * ss + i];
            for (int64_t k = 0; k < kNW; ++k) dst[k] = krow[k][c];
          }
        }
        const int64_t m_n = (b - a) * g, ncols = (nk_max + kNW - 1) / kNW * kNW;
        // Panels of near-equal size (16 vectors: 8 + 8, not 12 + 4): a short last panel would
        // run with few FMA chains per load.
        const int64_t n_pan = (m_n + kMR - 1) / kMR, pan_base = m_n / n_pan, pan_extra = m_n % n_pan;
        auto pan_start = [&](int64_t pn) { return pn * pan_base + std::min(pn, pan_extra); };
        auto pan_of = [&](int64_t m) {
          return m < pan_extra * (pan_base + 1) ? m / (pan_base + 1) : pan_extra + (m - pan_extra * (pan_base + 1)) / pan_base;
        };
        for (int64_t m = 0; m < m_n; ++m) {
          const int64_t pn = pan_of(m), lane_m = m - pan_start(pn);
          const int64_t r = sel[a + m / g].second, gm = r * g + m % g;
          const float* src = &qg[gm * d];
          float* dst = &qp[pn * d * kMR + lane_m];
          if (!dot_bf16)
            for (int64_t c = 0; c < d; ++c) dst[c * kMR] = src[c];
          if (dot_bf16) {
            const uint32_t* qw = reinterpret_cast<const uint32_t*>(static_cast<const char*>(p.q) +
                                                                   (((t0 + r) * p.h_q) + kh * g + m % g) * d * es);
            uint32_t* dw = &qp2[pn * (d / 2) * kMR + lane_m];
            for (int64_t c = 0; c < d / 2; ++c) dw[c * kMR] = qw[c];
          }
          nk[m] = std::min<int64_t>(p.pos[t0 + r] + 1, i0 + bsz) - i0;
        }
#if defined(IC_BF16_DOT)
        if (dot_bf16) {
          for (int64_t pn = 0; pn < n_pan; ++pn)
            panel_scores_bf16_n(static_cast<int>(pan_start(pn + 1) - pan_start(pn)), &qp2[pn * (d / 2) * kMR], d / 2,
                                kt2.data(), ss, ncols, &s[pan_start(pn) * ss], ss);
        } else
#endif
        for (int64_t pn = 0; pn < n_pan; ++pn)
          panel_scores_n(static_cast<int>(pan_start(pn + 1) - pan_start(pn)), &qp[pn * d * kMR], d, kt.data(), ss, ncols,
                         &s[pan_start(pn) * ss], ss);
        for (int64_t m = 0; m < m_n; ++m) {
          const int64_t gm = sel[a + m / g].second * g + m % g;
          bool bm = bad[gm];
          const float sum = block_softmax(&s[m * ss], nk[m], ncols, p.scale, &run_max[gm], &alpha[m], &bm);
          bad[gm] = bm;
          run_sum[gm] = run_sum[gm] * alpha[m] + sum;
        }
        for (int64_t pn = 0; pn < n_pan; ++pn) {
          const int64_t m0 = pan_start(pn), mr = pan_start(pn + 1) - m0;
          bool same = true;
          for (int64_t m = m0 + 1; m < m0 + mr; ++m) same = same && nk[m] == nk[m0];
          if (same) {
            panel_pv_n(static_cast<int>(mr), &s[m0 * ss], ss, vrow.data(), dp, nk[m0], &ob[m0 * dp]);
          } else {  // rows whose position ends inside this block: each reads only its own keys
            for (int64_t m = m0; m < m0 + mr; ++m) panel_pv<1>(&s[m * ss], ss, vrow.data(), dp, nk[m], &ob[m * dp]);
          }
        }
        for (int64_t m = 0; m < m_n; ++m) {
          float* acc = &o[(sel[a + m / g].second * g + m % g) * dp];
          const float* add = &ob[m * dp];
          const vnf al = vnf{} + alpha[m];
          for (int64_t c = 0; c < dp; c += kVecLanes) store_v(acc + c, fma_v(load_v(acc + c), al, load_v(add + c)));
        }
        a = b;
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t hh = 0; hh < g; ++hh) {
          const int64_t gm = r * g + hh, hq = (t0 + r) * p.h_q + kh * g + hh;
          const bool empty = !has[r];
          p.lse[hq] = bad[gm] ? nan : (empty ? ninf : run_max[gm] + std::log(run_sum[gm]));
          const float inv = bad[gm] ? nan : (empty ? 0.0f : 1.0f / run_sum[gm]);
          const float* acc = &o[gm * dp];
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
