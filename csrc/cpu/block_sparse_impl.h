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

// Block scores of a group of rows of one request: bs[r][h][b] = max over block b's keys i < n[r]
// of q[r][h] · key(i) (-inf where the block has none). key_row(i) gives key i's row; qf [rows][h][d]
// fp32; tile scratch of (block_size + kChunk) x d floats; row scratch of d; nb blocks per bs row.
// Each key block is converted and transposed once for the whole group.
template <class KeyRow>
void score_blocks(const float* qf, const int64_t* n, int64_t rows, int64_t h, int64_t d, int64_t nb,
                  int64_t block_size, DType dt, KeyRow key_row, float* tile, float* row, float* bs) {
  int64_t n_max = 0;
  for (int64_t r = 0; r < rows; ++r) n_max = std::max(n_max, n[r]);
  float s[4 * kChunk];
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * block_size, nk = std::max<int64_t>(0, std::min(n_max, i0 + block_size) - i0);
    for (int64_t i = 0; i < nk; ++i) {
      to_float(key_row(i0 + i), dt, d, row);
      float* t = tile + (i / kChunk) * d * kChunk + i % kChunk;
      for (int64_t c = 0; c < d; ++c) t[c * kChunk] = row[c];
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
