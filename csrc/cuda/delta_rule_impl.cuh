// The gated delta rule on CUDA (indexcache/delta_rule.h; reference.py's delta_rule defines it).
// Torch-free kernels and launch code; the op glue is in delta_rule.cu.
//
// Two kernels, both one CTA per (sequence, value head, tile of kCols value columns), kCols
// threads, one per column: the columns of the state evolve independently (column j's update
// reads only S[:, j], k_t, q_t, the decay and v_t[j]), so a CTA owns its [d_k, kCols] tile of
// the state row in shared memory for the whole sequence.
//
// delta_rule_kernel (recurrent; decode and sequences shorter than min_chunked): walks the
// tokens in order: the token's q, k and decay exp(g) are staged in shared memory (two barriers
// per token), then each thread decays its column and forms pred = S^T k (one fmaf chain over
// d_k), u = beta (v - pred), adds k u and forms o = scale S^T q.
//
// delta_rule_chunk_kernel (prefill: sequences of at least min_chunked tokens): chunks of Lc
// (64, or 32 / 16 where shared memory is short) tokens, the algebra of the CPU kernel
// (csrc/cpu/delta_rule_impl.h; G_t = sum_{j<=t} g_j within the chunk, Gamma_t = exp(G_t)):
//   u_t = beta_t (v_t - S0^T (Gamma_t . k_t)) - sum_{i<t} beta_t P^k_{t,i} u_i   (triangular solve)
//   o_t = scale (S0^T (Gamma_t . q_t) + sum_{i<=t} P^q_{t,i} u_i)
//   S   = diag(Gamma_L) S0 + sum_i (k_i . Gamma_L / Gamma_i) u_i^T
// with P^x_{t,i} = sum_c x_t[c] k_i[c] exp(G_t[c] - G_i[c]). The exps of differences have
// t >= i (<= 1 for decays, never overflowing). A per-head gate multiplies the dot product by
// exp(G_t - G_i). A per-channel gate is factored, per pair of 16-row / 16-key blocks, about
// the token r before the row block: (x_t . exp(G_t - G_r)) . (k_i . exp(G_r - G_i)), a plain
// dot product of two staged rows, when every factor's exponent of the pair lies within
// +-kSafeExp (and neither side can underflow while the other amplifies; the CPU kernel's test);
// otherwise, or with a non-finite exponent, the pair is computed term by term with one exp per
// (t, i, c). The per-column work (S0^T products, the solve, P^q U, the state update) is one
// thread per column with four rows per register block; the P entries are spread over the
// threads. Both kernels: fp32 throughout, fixed orders, no atomics on data, so deterministic.
// Plain FMA code (no tensor cores), so the emulator runs every path.
//
// Invalid values (no host check unless INDEXCACHE_CHECK=1): a sequence whose token range is not
// 0 <= cu_seqlens[b] <= cu_seqlens[b+1] <= T is skipped (by the recurrent kernel, which counts
// it); one whose state row is outside [0, n_slots) or already taken by an earlier sequence of
// the batch writes o = 0 and leaves the state alone (by the kernel its length sends it to).
// Each counts once in the device's error word (kernels.h DeviceEnv::err).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common.cuh"
#include "indexcache/delta_rule.h"
#include "indexcache/fp8.h"
#include "kernels.h"

namespace indexcache {
namespace cuda {
namespace dr_detail {

constexpr int kCols = 64;            // value columns (= threads) per CTA
constexpr int64_t kMinChunked = 16;  // sequences of at least this many tokens take the chunked kernel
constexpr int kSub = 16;             // rows / keys per block of the per-channel P
constexpr float kSafeExp = 40.0f;    // the factored P's exponents stay within +-kSafeExp

__device__ __forceinline__ float load_x(const void* base, int64_t i, bool f32) {
  return f32 ? static_cast<const float*>(base)[i] : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

__device__ __forceinline__ void store_o(const DeltaRuleParams& p, int64_t i, float x) {
  if (p.dtype == DType::kFloat32) {
    static_cast<float*>(p.out)[i] = x;
  } else {
    static_cast<uint16_t*>(p.out)[i] = float_to_bf16(x);
  }
}

// Whether sequence b's state row is usable: in [0, n_slots) and named by no earlier sequence
// of the batch. Every thread of the CTA calls it (two barriers); the threads split the scan
// (decode calls have many sequences) and any finder sets the flag (the same value from each).
__device__ __forceinline__ bool slot_usable(const DeltaRuleParams& p, int64_t b, int32_t slot, int* flag, int tid) {
  if (tid == 0) *flag = 0;
  __syncthreads();
  for (int64_t e = tid; e < b; e += kCols)
    if (p.state_indices[e] == slot) *flag = 1;
  __syncthreads();
  return slot >= 0 && slot < p.n_slots && *flag == 0;
}

// o = 0 for tokens [c0, c1) of value head h, column j (a sequence whose state row is unusable).
__device__ __forceinline__ void zero_rows(const DeltaRuleParams& p, int64_t c0, int64_t c1, int64_t h, int64_t j) {
  for (int64_t t = c0; t < c1; ++t) store_o(p, (t * p.h_v + h) * p.d_v + j, 0.f);
}

// The recurrent form. Sequences with a valid range of at least min_chunked tokens are left to
// delta_rule_chunk_kernel (min_chunked = INT64_MAX: this kernel runs every sequence).
__global__ void __launch_bounds__(kCols) delta_rule_kernel(DeltaRuleParams p, int64_t min_chunked, int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  const int64_t dk = p.d_k;
  float* S = reinterpret_cast<float*>(smem_raw);  // [d_k][kCols]
  float* qs = S + dk * kCols;                     // [d_k]
  float* ks = qs + dk;                            // [d_k]
  float* as = ks + dk;                            // [d_k] exp(g_t)
  const int64_t b = blockIdx.x / p.h_v, h = blockIdx.x % p.h_v, hk = h / (p.h_v / p.h_k);
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kCols + tid;
  const bool col = j < p.d_v;
  const bool counter = h == 0 && blockIdx.y == 0 && tid == 0;  // counts the sequence's errors once
  const int64_t c0 = p.cu_seqlens[b], c1 = p.cu_seqlens[b + 1];
  if (!(0 <= c0 && c0 <= c1 && c1 <= p.T)) {
    if (counter) count_error(err);
    return;
  }
  if (c1 - c0 >= min_chunked) return;  // the chunked kernel's sequence
  const int32_t slot = p.state_indices[b];
  __shared__ int taken;
  if (!slot_usable(p, b, slot, &taken, tid)) {
    if (counter) count_error(err);
    if (col) zero_rows(p, c0, c1, h, j);
    return;
  }
  const bool f32 = p.dtype == DType::kFloat32;
  float* srow = p.state + (static_cast<int64_t>(slot) * p.h_v + h) * dk * p.d_v;
  if (col)
    for (int64_t c = 0; c < dk; ++c) S[c * kCols + tid] = srow[c * p.d_v + j];
  const int64_t gw = p.g_per_channel ? dk : 1;
  for (int64_t t = c0; t < c1; ++t) {
    __syncthreads();  // the previous token's vectors are no longer read
    const float* g = p.g + (t * p.h_v + h) * gw;
    for (int64_t c = tid; c < dk; c += kCols) {
      qs[c] = load_x(p.q, t * p.q_stride + hk * dk + c, f32);
      ks[c] = load_x(p.k, t * p.k_stride + hk * dk + c, f32);
      as[c] = expf(g[p.g_per_channel ? c : 0]);
    }
    __syncthreads();
    if (!col) continue;
    float pred = 0.f;
    for (int64_t c = 0; c < dk; ++c) {
      const float x = S[c * kCols + tid] * as[c];
      S[c * kCols + tid] = x;
      pred = fmaf(ks[c], x, pred);
    }
    const float u = (load_x(p.v, t * p.v_stride + h * p.d_v + j, f32) - pred) * p.beta[t * p.h_v + h];
    float o = 0.f;
    for (int64_t c = 0; c < dk; ++c) {
      const float x = fmaf(ks[c], u, S[c * kCols + tid]);
      S[c * kCols + tid] = x;
      o = fmaf(qs[c], x, o);
    }
    store_o(p, (t * p.h_v + h) * p.d_v + j, o * p.scale);
  }
  if (col)
    for (int64_t c = 0; c < dk; ++c) srow[c * p.d_v + j] = S[c * kCols + tid];
}

inline int64_t smem_bytes(const DeltaRuleParams& p) { return 4 * (p.d_k * kCols + 3 * p.d_k); }

// ------------------------------------------------------------------ the chunked form

// The chunked kernel's shared memory (floats), for chunks of lc tokens.
struct ChunkSmem {
  float *S, *K, *Q, *G, *B, *U, *O, *Pk, *Pq, *XB, *YB, *red;
};

__host__ __device__ __forceinline__ int64_t chunk_floats(int64_t dk, bool pc, int64_t lc) {
  return dk * kCols + 2 * lc * dk + lc * (pc ? dk : 1) + lc + 2 * lc * kCols + 2 * lc * lc +
         (pc ? 3 * kSub * dk : 0) + 5 * kCols;
}

__device__ __forceinline__ ChunkSmem chunk_smem(float* base, int64_t dk, bool pc, int64_t lc) {
  ChunkSmem m;
  m.S = base;                     // [dk][kCols] the state tile
  m.K = m.S + dk * kCols;         // [lc][dk] keys
  m.Q = m.K + lc * dk;            // [lc][dk] queries; then Gamma . q, Gamma . k, k . Gamma_L / Gamma_i
  m.G = m.Q + lc * dk;            // [lc][gw] the in-chunk cumulative log decay
  m.B = m.G + lc * (pc ? dk : 1); // [lc] beta
  m.U = m.B + lc;                 // [lc][kCols] v, then w = beta (v - ...), then u
  m.O = m.U + lc * kCols;         // [lc][kCols] the outputs
  m.Pk = m.O + lc * kCols;        // [lc][lc] beta_t P^k, strictly lower
  m.Pq = m.Pk + lc * lc;          // [lc][lc] P^q, lower with the diagonal
  m.XB = m.Pq + lc * lc;          // [2 kSub][dk] a row block's k, q times exp(G_t - G_r) (per channel)
  m.YB = m.XB + (pc ? 2 * kSub * dk : 0);  // [kSub][dk] a key block's k times exp(G_r - G_i)
  m.red = m.YB + (pc ? kSub * dk : 0);     // [5][kCols] the range check's partial extremes
  return m;
}

// Loads tokens [t0, t0 + L) of (sequence, head h / key head hk): K, Q fp32, G cumulative in
// token order (as the CPU), beta, and v's column j (0 past d_v).
__device__ void chunk_load(const DeltaRuleParams& p, const ChunkSmem& m, int64_t t0, int L, int64_t h, int64_t hk,
                           int64_t j, int tid) {
  const int dk = static_cast<int>(p.d_k), gw = p.g_per_channel ? dk : 1;
  const bool f32 = p.dtype == DType::kFloat32;
  for (int e = tid; e < L * dk; e += kCols) {
    const int t = e / dk, c = e % dk;
    m.K[e] = load_x(p.k, (t0 + t) * p.k_stride + hk * dk + c, f32);
    m.Q[e] = load_x(p.q, (t0 + t) * p.q_stride + hk * dk + c, f32);
  }
  for (int c = tid; c < gw; c += kCols) {
    float acc = 0.f;
    for (int t = 0; t < L; ++t) {
      acc += p.g[((t0 + t) * p.h_v + h) * gw + c];
      m.G[t * gw + c] = acc;
    }
  }
  for (int t = tid; t < L; t += kCols) m.B[t] = p.beta[(t0 + t) * p.h_v + h];
  for (int t = 0; t < L; ++t)
    m.U[t * kCols + tid] = j < p.d_v ? load_x(p.v, (t0 + t) * p.v_stride + h * p.d_v + j, f32) : 0.f;
}

// P^k, P^q for a per-head gate: one entry (t, i <= t) per thread at a time.
__device__ void chunk_p_per_head(const ChunkSmem& m, int dk, int L, int lc, int tid) {
  for (int e = tid; e < L * L; e += kCols) {
    const int t = e / L, i = e % L;
    if (i > t) continue;
    float sk = 0.f, sq = 0.f;
    for (int c = 0; c < dk; ++c) {
      sk = fmaf(m.K[t * dk + c], m.K[i * dk + c], sk);
      sq = fmaf(m.Q[t * dk + c], m.K[i * dk + c], sq);
    }
    const float f = expf(m.G[t] - m.G[i]);
    m.Pk[t * lc + i] = sk * f;
    m.Pq[t * lc + i] = sq * f;
  }
}

// Whether the factored form is safe for rows [s0, s1) and keys [k0, k1) about G_r (gr, or 0
// when gr is null): every thread returns the same answer (one barrier, after which red may be
// rewritten only past another barrier).
__device__ bool pair_safe(const ChunkSmem& m, int dk, const float* gr, int s0, int s1, int k0,
                          int k1, int tid) {
  float amax = -INFINITY, amin = INFINITY, bmax = -INFINITY, bmin = INFINITY, bad = 0.f;
  for (int e = tid; e < (s1 - s0) * dk; e += kCols) {
    const int c = e % dk;
    const float a = m.G[(s0 + e / dk) * dk + c] - (gr ? gr[c] : 0.f);
    if (!(fabsf(a) <= 3.0e38f)) bad = 1.f;
    amax = fmaxf(amax, a);
    amin = fminf(amin, a);
  }
  for (int e = tid; e < (k1 - k0) * dk; e += kCols) {
    const int c = e % dk;
    const float b = (gr ? gr[c] : 0.f) - m.G[(k0 + e / dk) * dk + c];
    if (!(fabsf(b) <= 3.0e38f)) bad = 1.f;
    bmax = fmaxf(bmax, b);
    bmin = fminf(bmin, b);
  }
  float* r = m.red;
  r[tid] = amax;
  r[kCols + tid] = amin;
  r[2 * kCols + tid] = bmax;
  r[3 * kCols + tid] = bmin;
  r[4 * kCols + tid] = bad;
  __syncthreads();
  for (int x = 0; x < kCols; ++x) {  // every thread reduces all partials: the same result in each
    amax = fmaxf(amax, r[x]);
    amin = fminf(amin, r[kCols + x]);
    bmax = fmaxf(bmax, r[2 * kCols + x]);
    bmin = fminf(bmin, r[3 * kCols + x]);
    bad = fmaxf(bad, r[4 * kCols + x]);
  }
  return bad == 0.f && amax <= kSafeExp && bmax <= kSafeExp && (bmax <= 0.f || amin >= -kSafeExp) &&
         (amax <= 0.f || bmin >= -kSafeExp);
}

// P^k, P^q for a per-channel gate, by pairs of blocks (rows [s0, s1), keys [k0, k1), k0 <= s0):
// factored about the token before the row block when pair_safe, term by term otherwise.
__device__ void chunk_p_per_channel(const ChunkSmem& m, int dk, int L, int lc, int tid) {
  for (int s0 = 0; s0 < L; s0 += kSub) {
    const int s1 = s0 + kSub < L ? s0 + kSub : L;
    const float* gr = s0 > 0 ? m.G + (s0 - 1) * dk : nullptr;
    for (int k0 = 0; k0 <= s0; k0 += kSub) {
      const int k1 = k0 + kSub < s1 ? k0 + kSub : s1;
      const bool safe = pair_safe(m, dk, gr, s0, s1, k0, k1, tid);
      if (safe) {
        for (int e = tid; e < (s1 - s0) * dk; e += kCols) {
          const int t = s0 + e / dk, c = e % dk;
          const float f = expf(m.G[t * dk + c] - (gr ? gr[c] : 0.f));
          m.XB[e] = m.K[t * dk + c] * f;
          m.XB[kSub * dk + e] = m.Q[t * dk + c] * f;
        }
        for (int e = tid; e < (k1 - k0) * dk; e += kCols) {
          const int i = k0 + e / dk, c = e % dk;
          m.YB[e] = m.K[i * dk + c] * expf((gr ? gr[c] : 0.f) - m.G[i * dk + c]);
        }
      }
      __syncthreads();  // the staged rows are complete (and pair_safe's partials all read)
      for (int e = tid; e < kSub * kSub; e += kCols) {
        const int t = s0 + e / kSub, i = k0 + e % kSub;
        if (t >= s1 || i >= k1 || i > t) continue;
        float sk = 0.f, sq = 0.f;
        if (safe) {
          const float* y = m.YB + (i - k0) * dk;
          const float* xk = m.XB + (t - s0) * dk;
          const float* xq = xk + kSub * dk;
          for (int c = 0; c < dk; ++c) {
            sk = fmaf(xk[c], y[c], sk);
            sq = fmaf(xq[c], y[c], sq);
          }
        } else {
          for (int c = 0; c < dk; ++c) {
            const float ke = m.K[i * dk + c] * expf(m.G[t * dk + c] - m.G[i * dk + c]);
            sk = fmaf(m.K[t * dk + c], ke, sk);
            sq = fmaf(m.Q[t * dk + c], ke, sq);
          }
        }
        m.Pk[t * lc + i] = sk;
        m.Pq[t * lc + i] = sq;
      }
      __syncthreads();  // XB, YB and the partials are free again
    }
  }
}

// out[t][tid] (+)= sum_c X[t][c] S[c][tid] for t < L, four rows per register block; X [L][dk].
// mode 0: O = .; mode 1: U = (U - .) * beta_t.
__device__ void chunk_rows_times_state(const ChunkSmem& m, int dk, int L, int mode, int tid) {
  for (int t = 0; t < L; t += 4) {
    const int nr = L - t < 4 ? L - t : 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c = 0; c < dk; ++c) {
      const float s = m.S[c * kCols + tid];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (r < nr) acc[r] = fmaf(m.Q[(t + r) * dk + c], s, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (r >= nr) break;
      float* u = &m.U[(t + r) * kCols + tid];
      if (mode == 0) {
        m.O[(t + r) * kCols + tid] = acc[r];
      } else {
        *u = (*u - acc[r]) * m.B[t + r];
      }
    }
  }
}

// Q's area <- x . exp(G_t - base) for the L rows: x = Q (base 0), K (base 0), or K with base
// G_{L-1} negated (k_i . Gamma_L / Gamma_i).
__device__ void chunk_scale_rows(const ChunkSmem& m, const float* x, int dk, bool pc, int L, bool to_last,
                                 int tid) {
  const int gw = pc ? dk : 1;
  const float* GL = m.G + (L - 1) * gw;
  for (int e = tid; e < L * dk; e += kCols) {
    const int t = e / dk, c = e % dk, gc = pc ? c : 0;
    const float gt = m.G[t * gw + gc];
    m.Q[e] = x[e] * expf(to_last ? GL[gc] - gt : gt);
  }
}

// One chunk of L tokens: S advanced in shared memory, o written for column j.
__device__ void chunk_step(const DeltaRuleParams& p, const ChunkSmem& m, int64_t t0, int L, int lc, int64_t h,
                           int64_t hk, int64_t j, int tid) {
  const int dk = static_cast<int>(p.d_k), gw = p.g_per_channel ? dk : 1;
  const bool pc = p.g_per_channel;
  chunk_load(p, m, t0, L, h, hk, j, tid);
  __syncthreads();
  if (pc) {
    chunk_p_per_channel(m, dk, L, lc, tid);
  } else {
    chunk_p_per_head(m, dk, L, lc, tid);
    __syncthreads();
  }
  // beta_t on P^k's strictly lower part; zeros above (and on P^k's diagonal) up to L.
  for (int e = tid; e < L * L; e += kCols) {
    const int t = e / L, i = e % L;
    if (i < t) {
      m.Pk[t * lc + i] *= m.B[t];
    } else {
      m.Pk[t * lc + i] = 0.f;
      if (i > t) m.Pq[t * lc + i] = 0.f;
    }
  }
  chunk_scale_rows(m, m.Q, dk, pc, L, false, tid);  // Gamma . q
  __syncthreads();
  chunk_rows_times_state(m, dk, L, 0, tid);  // O = (Gamma . q) S0
  __syncthreads();
  chunk_scale_rows(m, m.K, dk, pc, L, false, tid);  // Gamma . k
  __syncthreads();
  chunk_rows_times_state(m, dk, L, 1, tid);  // W = beta (v - (Gamma . k) S0)
  // The triangular solve (I + beta P^k) U = W by forward substitution, each thread its column.
  for (int t = 1; t < L; ++t) {
    float acc = m.U[t * kCols + tid];
    for (int i = 0; i < t; ++i) acc = fmaf(-m.Pk[t * lc + i], m.U[i * kCols + tid], acc);
    m.U[t * kCols + tid] = acc;
  }
  // O += P^q U, times scale, out.
  for (int t = 0; t < L; ++t) {
    float acc = m.O[t * kCols + tid];
    for (int i = 0; i <= t; ++i) acc = fmaf(m.Pq[t * lc + i], m.U[i * kCols + tid], acc);
    if (j < p.d_v) store_o(p, ((t0 + t) * p.h_v + h) * p.d_v + j, acc * p.scale);
  }
  __syncthreads();  // every thread is past its reads of Q's area
  chunk_scale_rows(m, m.K, dk, pc, L, true, tid);  // k_i . Gamma_L / Gamma_i
  __syncthreads();
  // S = diag(Gamma_L) S0 + (k . Gamma_L / Gamma_i)^T U, four state rows per register block.
  const float* GL = m.G + (L - 1) * gw;
  for (int c = 0; c < dk; c += 4) {
    const int nr = dk - c < 4 ? dk - c : 4;
    float acc[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[r] = r < nr ? m.S[(c + r) * kCols + tid] * expf(GL[pc ? c + r : 0]) : 0.f;
    for (int i = 0; i < L; ++i) {
      const float u = m.U[i * kCols + tid];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (r < nr) acc[r] = fmaf(m.Q[i * dk + c + r], u, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (r < nr) m.S[(c + r) * kCols + tid] = acc[r];
  }
  __syncthreads();  // the next chunk's loads overwrite what every thread read
}

// The chunked form, chunks of lc tokens (a multiple of kSub); runs the sequences with a valid
// range of at least min_chunked tokens (the recurrent kernel counts invalid ranges). One CTA per
// SM at most (its shared memory), so the launch bounds say so: without the 1, ptxas for sm_80
// held the kernel to 96 registers and spilled.
__global__ void __launch_bounds__(kCols, 1) delta_rule_chunk_kernel(DeltaRuleParams p, int64_t lc, int64_t min_chunked,
                                                                 int32_t* err) {
  IC_DYNAMIC_SMEM(smem_raw);
  const int64_t b = blockIdx.x / p.h_v, h = blockIdx.x % p.h_v, hk = h / (p.h_v / p.h_k);
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kCols + tid;
  const int64_t c0 = p.cu_seqlens[b], c1 = p.cu_seqlens[b + 1];
  if (!(0 <= c0 && c0 <= c1 && c1 <= p.T) || c1 - c0 < min_chunked) return;
  const int32_t slot = p.state_indices[b];
  __shared__ int taken;
  if (!slot_usable(p, b, slot, &taken, tid)) {
    if (h == 0 && blockIdx.y == 0 && tid == 0) count_error(err);
    if (j < p.d_v) zero_rows(p, c0, c1, h, j);
    return;
  }
  const int64_t dk = p.d_k;
  const ChunkSmem m = chunk_smem(reinterpret_cast<float*>(smem_raw), dk, p.g_per_channel, lc);
  float* srow = p.state + (static_cast<int64_t>(slot) * p.h_v + h) * dk * p.d_v;
  for (int64_t c = 0; c < dk; ++c) m.S[c * kCols + tid] = j < p.d_v ? srow[c * p.d_v + j] : 0.f;
  const int ilc = static_cast<int>(lc);
  for (int64_t t0 = c0; t0 < c1; t0 += lc)
    chunk_step(p, m, t0, static_cast<int>(c1 - t0 < lc ? c1 - t0 : lc), ilc, h, hk, j, tid);
  if (j < p.d_v)
    for (int64_t c = 0; c < dk; ++c) srow[c * p.d_v + j] = m.S[c * kCols + tid];
}

// Tokens per chunk: the largest of 64, 32, 16 whose CTA fits in `budget` bytes; 0 if none.
inline int64_t chunk_tokens(int64_t dk, bool pc, int64_t budget) {
  for (int64_t lc = 64; lc >= kSub; lc /= 2)
    if (4 * chunk_floats(dk, pc, lc) <= budget) return lc;
  return 0;
}

}  // namespace dr_detail

// min_chunked: sequences of at least this many tokens run chunked (the tests lower it to run
// every length through the chunked kernel); a chunked CTA that cannot fit leaves them all to
// the recurrent kernel.
inline void delta_rule_cuda(const DeltaRuleParams& p, const DeviceEnv& env, int64_t min_chunked = dr_detail::kMinChunked) {
  using namespace dr_detail;
  if (p.batch == 0 || p.T == 0) return;
  const int64_t ctas = p.batch * p.h_v, tiles = (p.d_v + kCols - 1) / kCols;
  TORCH_CHECK(ctas <= INT_MAX && tiles <= 65535, "delta_rule: batch x h_v = ", ctas, " and d_v = ", p.d_v,
              " are too many for one CUDA launch");
  const int64_t bytes = smem_bytes(p), budget = static_cast<int64_t>(env.smem_optin) - 64;
  TORCH_CHECK(bytes <= budget, "delta_rule on CUDA needs ", bytes, " bytes of shared memory for d_k = ", p.d_k,
              "; the device allows ", budget);
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(tiles));
  const int64_t lc = chunk_tokens(p.d_k, p.g_per_channel, budget);
  const bool chunked = lc > 0 && p.T >= min_chunked;
  if (chunked) {
    const int64_t cbytes = 4 * chunk_floats(p.d_k, p.g_per_channel, lc);
    if (cbytes > 48 * 1024)
      C10_CUDA_CHECK(cudaFuncSetAttribute(delta_rule_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(cbytes)));
    IC_LAUNCH(delta_rule_chunk_kernel, grid, kCols, cbytes, env.stream, p, lc, min_chunked, env.err);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(delta_rule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  IC_LAUNCH(delta_rule_kernel, grid, kCols, bytes, env.stream, p, chunked ? min_chunked : INT64_MAX, env.err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace indexcache
