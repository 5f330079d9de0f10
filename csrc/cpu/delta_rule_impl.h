// The bodies of the delta-rule CPU kernel (delta_rule.cpp), written once and compiled once per
// ISA path: delta_rule.cpp includes this file inside a namespace, plainly (portable) and under
// `#pragma GCC target` for AVX2+FMA and for AVX-512, with IC_VEC_BYTES the native vector width.
// Lanes are independent and every sum runs in a fixed order, so each path is deterministic.
// No includes: the includer has them.
//
// Layout of the per-(sequence, value head) work (indexcache/delta_rule.h defines the op):
//   S [dkp][dvp] fp32, the state row with columns padded to kPad (zeros in the pad);
//   a chunk of L <= kChunk tokens: K, Q [kChunk][dkp] fp32, V/U [kChunk][dvp], G [kChunk][dkp]
//   the in-chunk cumulative log decay (per channel; one column for a per-head gate).
//
// Chunk algebra (exact rewriting of the recurrence; G_t = Σ_{j<=t} g_j, Γ_t = exp(G_t)):
//   u_t = beta_t (v_t - S0^T (Γ_t ⊙ k_t) - Σ_{i<t} P^k_{t,i} u_i)   (the UT / WY triangular solve)
//   o_t = scale (S0^T (Γ_t ⊙ q_t) + Σ_{i<=t} P^q_{t,i} u_i)
//   S   = diag(Γ_L) S0 + Σ_i (k_i ⊙ Γ_L / Γ_i) u_i^T
// with P^x_{t,i} = Σ_c x_t[c] k_i[c] exp(G_t[c] - G_i[c]). Every exp(.) of a difference here is
// taken with t >= i, so it is <= 1 for g <= 0 (decays), and never overflows. P for a per-channel
// gate is a product of two factors about a reference point r (the token before each block of
// 16 rows): (x_t ⊙ exp(G_t - G_r)) · (k_i ⊙ exp(G_r - G_i)); that is a matmul, and it is safe
// while the block's factors stay within e^±40 (checked per block; else the block is computed
// term by term with one exp per (t, i, c)).

constexpr int64_t kChunk = 64;      // tokens per chunk
constexpr int64_t kSub = 16;        // rows per block of the per-channel P
constexpr int64_t kPad = 32;        // column padding of every fp32 work array (a multiple of kNR)
constexpr float kSafeExp = 40.0f;   // the factored P's exponents stay within +-kSafeExp

typedef float vnf __attribute__((vector_size(IC_VEC_BYTES)));
typedef float vnf_u __attribute__((vector_size(IC_VEC_BYTES), aligned(4), may_alias));
typedef int32_t vni __attribute__((vector_size(IC_VEC_BYTES)));
constexpr int64_t kLanes = IC_VEC_BYTES / 4;
constexpr int64_t kNV = 2;                 // vectors per micro-tile row
constexpr int64_t kNR = kNV * kLanes;      // columns per micro-tile (divides kPad)
constexpr int64_t kMR = 4;                 // rows per micro-tile

inline int64_t pad_cols(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

inline vnf ld(const float* p) { return *reinterpret_cast<const vnf_u*>(p); }
inline void st(float* p, vnf v) { *reinterpret_cast<vnf_u*>(p) = v; }
inline vnf splat(float x) { return vnf{} + x; }

// exp(x) lane-wise for any x: clamped to [-87, 88] (exp(-87) ~ 1.6e-38), 2^n e^r with n the
// nearest integer (floor(x log2 e + 1/2)), r by a two-part ln 2, degree-6 Taylor polynomial
// (relative error ~2e-7). NaN stays NaN.
inline vnf exp_v(vnf x) {
  const vnf lo = splat(-87.0f), hi = splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vnf y = x * 1.44269504088896341f + 0.5f;
  vni ni = __builtin_convertvector(y, vni);  // truncation
  ni += (__builtin_convertvector(ni, vnf) > y);  // -1 where truncation rounded up: floor
  const vnf n = __builtin_convertvector(ni, vnf);
  vnf r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  vnf e = splat(1.0f / 720);
  e = e * r + 1.0f / 120;
  e = e * r + 1.0f / 24;
  e = e * r + 1.0f / 6;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  // 2^n in two halves so that n = 128 (x near 88) stays representable.
  const vni h1 = ni >> 1, h2 = ni - h1;
  const vni b1 = (h1 + 127) << 23, b2 = (h2 + 127) << 23;
  vnf s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  return e * s1 * s2;
}

// Σ lanes of v, pairwise in a fixed order.
inline float hsum(vnf v) {
  float l[kLanes];
  std::memcpy(l, &v, sizeof l);
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t j = 0; j < w; ++j) l[j] += l[j + w];
  return l[0];
}

// x [n] (fp32 or bf16) -> fp32 dst [n].
inline void to_float(const void* x, DType dt, int64_t n, float* dst) {
  if (dt == DType::kFloat32) {
    std::memcpy(dst, x, sizeof(float) * n);
    return;
  }
  const uint16_t* b = static_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(b[i]) << 16);
}

inline void from_float(const float* x, DType dt, int64_t n, void* dst) {
  if (dt == DType::kFloat32) {
    std::memcpy(dst, x, sizeof(float) * n);
    return;
  }
  at::BFloat16* o = static_cast<at::BFloat16*>(dst);
  for (int64_t i = 0; i < n; ++i) o[i] = at::BFloat16(x[i]);  // round to nearest even, as torch's .to()
}

// C[m][n] (+)= Σ_k A[m][k] B[k][n] for rows m < M, columns n < N (a multiple of kNR), k < K.
// tri_k: A is lower triangular (A[m][k] = 0 for k > m), so row block m0 sums k < m0 + rows only.
// A micro-tile of kMR rows x kNR columns accumulates in registers over k: one load of B's row
// piece feeds kMR FMAs per vector.
template <int MR>
inline void mm_tile(float* __restrict c, int64_t ldc, const float* __restrict a, int64_t lda,
                    const float* __restrict b, int64_t ldb, int64_t K, int64_t N, bool set) {
  for (int64_t n0 = 0; n0 < N; n0 += kNR) {
    vnf acc[MR][kNV];
    for (int m = 0; m < MR; ++m)
      for (int64_t v = 0; v < kNV; ++v) acc[m][v] = set ? vnf{} : ld(c + m * ldc + n0 + v * kLanes);
    for (int64_t k = 0; k < K; ++k) {
      vnf bv[kNV];
      for (int64_t v = 0; v < kNV; ++v) bv[v] = ld(b + k * ldb + n0 + v * kLanes);
      for (int m = 0; m < MR; ++m) {
        const float av = a[m * lda + k];
        for (int64_t v = 0; v < kNV; ++v) acc[m][v] += av * bv[v];
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int64_t v = 0; v < kNV; ++v) st(c + m * ldc + n0 + v * kLanes, acc[m][v]);
  }
}

inline void mm(float* c, int64_t ldc, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t M, int64_t K,
               int64_t N, bool set, bool tri_k = false) {
  for (int64_t m0 = 0; m0 < M; m0 += kMR) {
    const int64_t rows = std::min(kMR, M - m0), kk = tri_k ? std::min(K, m0 + rows) : K;
    float* cc = c + m0 * ldc;
    const float* aa = a + m0 * lda;
    switch (rows) {
      case 4: mm_tile<4>(cc, ldc, aa, lda, b, ldb, kk, N, set); break;
      case 3: mm_tile<3>(cc, ldc, aa, lda, b, ldb, kk, N, set); break;
      case 2: mm_tile<2>(cc, ldc, aa, lda, b, ldb, kk, N, set); break;
      default: mm_tile<1>(cc, ldc, aa, lda, b, ldb, kk, N, set); break;
    }
  }
}

// The work arrays of one task; sized once per thread.
struct Work {
  int64_t dkp = 0, dvp = 0;
  std::vector<float> S, K, Q, V, G, X, M, Pk, Pq, T, XB, tmp;
  std::vector<float> beta;
  void init(int64_t d_k, int64_t d_v) {
    dkp = pad_cols(d_k);
    dvp = pad_cols(d_v);
    S.assign(dkp * dvp, 0.0f);
    K.assign(kChunk * dkp, 0.0f);
    Q.assign(kChunk * dkp, 0.0f);
    V.assign(kChunk * dvp, 0.0f);
    G.assign(kChunk * dkp, 0.0f);
    X.assign(2 * kChunk * dkp, 0.0f);
    M.assign(2 * kChunk * dvp, 0.0f);
    Pk.assign(kChunk * kChunk, 0.0f);
    Pq.assign(kChunk * kChunk, 0.0f);
    T.assign(dkp * kChunk, 0.0f);   // a transposed key block [dkp][kChunk]
    XB.assign(2 * kSub * dkp, 0.0f);
    tmp.assign(std::max(dkp, dvp), 0.0f);
    beta.assign(kChunk, 0.0f);
  }
};

struct TaskRef {
  const char* q;      // the first token's query head row
  const char* k;
  const char* v;
  const float* g;     // the first token's gate row of this value head
  const float* beta;  // the first token's beta of this value head
  char* out;
  int64_t q_step, k_step, v_step, g_step, b_step, o_step;  // bytes / floats between tokens
};

// P^k (times beta, strictly lower) and P^q (lower, diagonal included) of a chunk of L tokens
// into w.Pk, w.Pq [L][kChunk]; entries above the diagonal are zero up to column kChunk.
inline void chunk_p_per_head(Work& w, int64_t L) {
  const int64_t dkp = w.dkp, nc = std::min(kChunk, (L + kPad - 1) / kPad * kPad);
  float* kt = w.T.data();
  for (int64_t c = 0; c < dkp; ++c)
    for (int64_t i = 0; i < nc; ++i) kt[c * kChunk + i] = i < L ? w.K[i * dkp + c] : 0.0f;
  mm(w.Pk.data(), kChunk, w.K.data(), dkp, kt, kChunk, L, dkp, nc, true);
  mm(w.Pq.data(), kChunk, w.Q.data(), dkp, kt, kChunk, L, dkp, nc, true);
  for (int64_t t = 0; t < L; ++t) {
    const float gt = w.G[t * dkp];
    float* pk = &w.Pk[t * kChunk];
    float* pq = &w.Pq[t * kChunk];
    for (int64_t i = 0; i <= t; ++i) {
      const float e = std::exp(gt - w.G[i * dkp]);
      pk[i] = i < t ? pk[i] * e * w.beta[t] : 0.0f;
      pq[i] *= e;
    }
    for (int64_t i = t + 1; i < kChunk; ++i) pk[i] = pq[i] = 0.0f;
  }
}

// The same for a per-channel gate: blocks of kSub rows, factored about the token before the
// block when that is safe, term by term otherwise.
inline void chunk_p_per_channel(Work& w, int64_t L) {
  const int64_t dkp = w.dkp;
  float* kr = w.T.data();
  float* e = w.tmp.data();
  for (int64_t s0 = 0; s0 < L; s0 += kSub) {
    const int64_t s1 = std::min(L, s0 + kSub), nt = s1 - s0, nc = (s1 + kPad - 1) / kPad * kPad;
    const float* gr = s0 > 0 ? &w.G[(s0 - 1) * dkp] : nullptr;  // nullptr: G_r = 0
    // The block's exponents: a = G_t - G_r (rows), b = G_r - G_i (keys i < s1).
    // Lane-wise extremes (a NaN anywhere leaves a comparison false: the block goes term by term).
    vnf vamax = splat(-INFINITY), vamin = splat(INFINITY), vbmax = vamax, vbmin = vamin;
    vnf probe{};  // stays 0 unless some x is NaN or infinite
    for (int64_t i = 0; i < s1; ++i)
      for (int64_t c = 0; c < dkp; c += kLanes) {
        const vnf x = (gr ? ld(gr + c) : vnf{}) - ld(&w.G[i * dkp + c]);  // b = G_r - G_i
        vbmax = x > vbmax ? x : vbmax;
        vbmin = x < vbmin ? x : vbmin;
        if (i >= s0) {
          const vnf a = vnf{} - x;  // a = G_t - G_r
          vamax = a > vamax ? a : vamax;
          vamin = a < vamin ? a : vamin;
        }
        probe += x * 0.0f;
      }
    float amax = -INFINITY, amin = INFINITY, bmax = -INFINITY, bmin = INFINITY;
    for (int64_t l = 0; l < kLanes; ++l) {
      amax = std::fmax(amax, vamax[l]);
      amin = std::fmin(amin, vamin[l]);
      bmax = std::fmax(bmax, vbmax[l]);
      bmin = std::fmin(bmin, vbmin[l]);
    }
    if (hsum(probe) != 0.0f) amax = INFINITY;
    const bool safe = amax <= kSafeExp && bmax <= kSafeExp && (bmax <= 0.0f || amin >= -kSafeExp) &&
                      (amax <= 0.0f || bmin >= -kSafeExp);
    if (safe) {
      for (int64_t t = 0; t < nt; ++t) {
        const float* gt = &w.G[(s0 + t) * dkp];
        for (int64_t c = 0; c < dkp; c += kLanes) {
          const vnf f = exp_v(ld(gt + c) - (gr ? ld(gr + c) : vnf{}));
          st(&w.XB[t * dkp + c], ld(&w.K[(s0 + t) * dkp + c]) * f);
          st(&w.XB[(kSub + t) * dkp + c], ld(&w.Q[(s0 + t) * dkp + c]) * f);
        }
      }
      for (int64_t i = 0; i < nc; ++i) {
        if (i < s1) {
          const float* gi = &w.G[i * dkp];
          for (int64_t c = 0; c < dkp; c += kLanes)
            st(e + c, ld(&w.K[i * dkp + c]) * exp_v((gr ? ld(gr + c) : vnf{}) - ld(gi + c)));
          for (int64_t c = 0; c < dkp; ++c) kr[c * kChunk + i] = e[c];
        } else {
          for (int64_t c = 0; c < dkp; ++c) kr[c * kChunk + i] = 0.0f;
        }
      }
      mm(&w.Pk[s0 * kChunk], kChunk, w.XB.data(), dkp, kr, kChunk, nt, dkp, nc, true);
      mm(&w.Pq[s0 * kChunk], kChunk, &w.XB[kSub * dkp], dkp, kr, kChunk, nt, dkp, nc, true);
    } else {
      for (int64_t t = s0; t < s1; ++t) {
        const float* gt = &w.G[t * dkp];
        for (int64_t i = 0; i <= t; ++i) {
          const float* gi = &w.G[i * dkp];
          vnf sk{}, sq{};
          for (int64_t c = 0; c < dkp; c += kLanes) {
            const vnf ke = ld(&w.K[i * dkp + c]) * exp_v(ld(gt + c) - ld(gi + c));
            sk += ld(&w.K[t * dkp + c]) * ke;
            sq += ld(&w.Q[t * dkp + c]) * ke;
          }
          w.Pk[t * kChunk + i] = hsum(sk);
          w.Pq[t * kChunk + i] = hsum(sq);
        }
      }
    }
  }
  for (int64_t t = 0; t < L; ++t) {
    float* pk = &w.Pk[t * kChunk];
    float* pq = &w.Pq[t * kChunk];
    for (int64_t i = 0; i < t; ++i) pk[i] *= w.beta[t];
    pk[t] = 0.0f;
    for (int64_t i = t + 1; i < kChunk; ++i) pk[i] = pq[i] = 0.0f;
  }
}

// One chunk of L tokens of one (sequence, value head): S (w.S) is read and advanced, o written.
inline void run_chunk(const DeltaRuleParams& p, Work& w, const TaskRef& r, int64_t t0, int64_t L) {
  const int64_t dkp = w.dkp, dvp = w.dvp, dk = p.d_k, dv = p.d_v;
  const bool pc = p.g_per_channel;
  // Load the chunk: fp32 rows, padded columns zero; G cumulative within the chunk.
  for (int64_t t = 0; t < L; ++t) {
    const int64_t tok = t0 + t;
    to_float(r.q + tok * r.q_step, p.dtype, dk, &w.Q[t * dkp]);
    to_float(r.k + tok * r.k_step, p.dtype, dk, &w.K[t * dkp]);
    to_float(r.v + tok * r.v_step, p.dtype, dv, &w.V[t * dvp]);
    w.beta[t] = r.beta[tok * r.b_step];
    const float* g = r.g + tok * r.g_step;
    float* G = &w.G[t * dkp];
    const float* Gp = t > 0 ? &w.G[(t - 1) * dkp] : nullptr;
    if (pc) {
      for (int64_t c = 0; c < dk; ++c) G[c] = (Gp ? Gp[c] : 0.0f) + g[c];
    } else {
      G[0] = (Gp ? Gp[0] : 0.0f) + g[0];
    }
  }
  // X = [Γ ⊙ K; Γ ⊙ Q] (L + L rows), then M = X S0.
  for (int64_t t = 0; t < L; ++t) {
    const float* G = &w.G[t * dkp];
    float* xk = &w.X[t * dkp];
    float* xq = &w.X[(L + t) * dkp];
    if (pc) {
      for (int64_t c = 0; c < dkp; c += kLanes) {
        const vnf f = exp_v(ld(G + c));
        st(xk + c, ld(&w.K[t * dkp + c]) * f);
        st(xq + c, ld(&w.Q[t * dkp + c]) * f);
      }
    } else {
      const float f = std::exp(G[0]);
      for (int64_t c = 0; c < dkp; c += kLanes) {
        st(xk + c, ld(&w.K[t * dkp + c]) * f);
        st(xq + c, ld(&w.Q[t * dkp + c]) * f);
      }
    }
  }
  mm(w.M.data(), dvp, w.X.data(), dkp, w.S.data(), dvp, 2 * L, dk, dvp, true);
  // W = beta (V - Γ K S0), into V.
  for (int64_t t = 0; t < L; ++t)
    for (int64_t j = 0; j < dvp; j += kLanes)
      st(&w.V[t * dvp + j], (ld(&w.V[t * dvp + j]) - ld(&w.M[t * dvp + j])) * w.beta[t]);
  if (pc) {
    chunk_p_per_channel(w, L);
  } else {
    chunk_p_per_head(w, L);
  }
  // The triangular solve (I + beta P^k) U = W by forward substitution, U in V's place.
  for (int64_t t = 1; t < L; ++t) {
    const float* a = &w.Pk[t * kChunk];
    float* u = &w.V[t * dvp];
    for (int64_t j = 0; j < dvp; j += kNR) {
      vnf acc[kNV];
      for (int64_t v = 0; v < kNV; ++v) acc[v] = ld(u + j + v * kLanes);
      for (int64_t i = 0; i < t; ++i) {
        const float ai = a[i];
        for (int64_t v = 0; v < kNV; ++v) acc[v] -= ai * ld(&w.V[i * dvp + j + v * kLanes]);
      }
      for (int64_t v = 0; v < kNV; ++v) st(u + j + v * kLanes, acc[v]);
    }
  }
  // O = scale (Γ Q S0 + P^q U).
  float* oq = &w.M[L * dvp];
  mm(oq, dvp, w.Pq.data(), kChunk, w.V.data(), dvp, L, L, dvp, false, true);
  for (int64_t t = 0; t < L; ++t) {
    float* o = oq + t * dvp;
    for (int64_t j = 0; j < dvp; j += kLanes) st(o + j, ld(o + j) * p.scale);
    from_float(o, p.dtype, dv, r.out + (t0 + t) * r.o_step);
  }
  // S = diag(Γ_L) S0 + (K ⊙ Γ_L / Γ_i)^T U.
  const float* GL = &w.G[(L - 1) * dkp];
  float* kd = w.T.data();
  for (int64_t i = 0; i < L; ++i) {
    const float* gi = &w.G[i * dkp];
    const float* ki = &w.K[i * dkp];
    if (pc) {
      float* e = w.tmp.data();
      for (int64_t c = 0; c < dkp; c += kLanes) st(e + c, ld(ki + c) * exp_v(ld(GL + c) - ld(gi + c)));
      for (int64_t c = 0; c < dk; ++c) kd[c * kChunk + i] = e[c];
    } else {
      const float f = std::exp(GL[0] - gi[0]);
      for (int64_t c = 0; c < dk; ++c) kd[c * kChunk + i] = ki[c] * f;
    }
  }
  for (int64_t c = 0; c < dk; ++c) {
    const float f = std::exp(pc ? GL[c] : GL[0]);
    float* s = &w.S[c * dvp];
    for (int64_t j = 0; j < dvp; j += kLanes) st(s + j, ld(s + j) * f);
  }
  mm(w.S.data(), dvp, kd, kChunk, w.V.data(), dvp, dk, L, dvp, false);
}

// Tokens [t0, t0 + n) of one (sequence, value head) one at a time, straight on the state row
// s [d_k][d_v] in memory (decode: no copy in or out). Columns of S evolve independently, so each
// piece of kNR columns runs all n tokens while it sits in L1: pass 1 decays it and forms
// pred = S^T k, then u = beta (v - pred), pass 2 adds k u^T and forms o = scale S^T q.
inline void run_recurrent(const DeltaRuleParams& p, Work& w, const TaskRef& r, float* s, int64_t t0, int64_t n) {
  const int64_t dk = p.d_k, dv = p.d_v, dkp = w.dkp, dvp = w.dvp;
  const bool pc = p.g_per_channel;
  // Token vectors: q, k, decay a = exp(g) [n][dkp]; v [n][dvp]; outputs accumulate in M.
  float* A = w.G.data();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t tok = t0 + t;
    to_float(r.q + tok * r.q_step, p.dtype, dk, &w.Q[t * dkp]);
    to_float(r.k + tok * r.k_step, p.dtype, dk, &w.K[t * dkp]);
    to_float(r.v + tok * r.v_step, p.dtype, dv, &w.V[t * dvp]);
    w.beta[t] = r.beta[tok * r.b_step];
    const float* g = r.g + tok * r.g_step;
    for (int64_t c = 0; c < dk; ++c) A[t * dkp + c] = std::exp(pc ? g[c] : g[0]);
  }
  const int64_t full = dv / kNR * kNR;
  for (int64_t j = 0; j < full; j += kNR) {
    for (int64_t t = 0; t < n; ++t) {
      const float* a = &A[t * dkp];
      const float* kv = &w.K[t * dkp];
      const float* qv = &w.Q[t * dkp];
      vnf pred[kNV];
      for (int64_t v = 0; v < kNV; ++v) pred[v] = vnf{};
      for (int64_t c = 0; c < dk; ++c) {
        float* row = s + c * dv + j;
        for (int64_t v = 0; v < kNV; ++v) {
          const vnf x = ld(row + v * kLanes) * a[c];
          st(row + v * kLanes, x);
          pred[v] += kv[c] * x;
        }
      }
      vnf u[kNV], o[kNV];
      for (int64_t v = 0; v < kNV; ++v) {
        u[v] = (ld(&w.V[t * dvp + j + v * kLanes]) - pred[v]) * w.beta[t];
        o[v] = vnf{};
      }
      for (int64_t c = 0; c < dk; ++c) {
        float* row = s + c * dv + j;
        for (int64_t v = 0; v < kNV; ++v) {
          const vnf x = ld(row + v * kLanes) + kv[c] * u[v];
          st(row + v * kLanes, x);
          o[v] += qv[c] * x;
        }
      }
      for (int64_t v = 0; v < kNV; ++v) st(&w.M[t * dvp + j + v * kLanes], o[v] * p.scale);
    }
  }
  for (int64_t j = full; j < dv; ++j) {  // the columns past the last whole piece, one at a time
    for (int64_t t = 0; t < n; ++t) {
      const float* a = &A[t * dkp];
      float pred = 0.0f;
      for (int64_t c = 0; c < dk; ++c) {
        float& x = s[c * dv + j];
        x *= a[c];
        pred += w.K[t * dkp + c] * x;
      }
      const float u = (w.V[t * dvp + j] - pred) * w.beta[t];
      float o = 0.0f;
      for (int64_t c = 0; c < dk; ++c) {
        float& x = s[c * dv + j];
        x += w.K[t * dkp + c] * u;
        o += w.Q[t * dkp + c] * x;
      }
      w.M[t * dvp + j] = o * p.scale;
    }
  }
  for (int64_t t = 0; t < n; ++t) from_float(&w.M[t * dvp], p.dtype, dv, r.out + (t0 + t) * r.o_step);
}
