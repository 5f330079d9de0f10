// The bodies of MiniMax-M3's block-sparse CPU kernels (block_sparse.cpp), written once and
// compiled once per ISA path: block_sparse.cpp includes this file inside a namespace, plainly
// (portable) and under `#pragma GCC target` for AVX2+FMA and for AVX-512, and the compiler
// vectorises the lane loops below for each (independent lanes: no fast-math needed, and the
// summation order is fixed, so every path is deterministic). No includes: the includer has them.
//
// Vector lanes: dot products keep kLanes partial sums (lane j sums elements j, j + kLanes, ...),
// reduced pairwise at the end; axpy loops (the attention's P·V) are element-wise.

constexpr int64_t kLanes = 16;

// x [n] (fp32 or bf16) -> fp32 dst [n].
inline void to_float(const void* x, DType dt, int64_t n, float* dst) {
  if (dt == DType::kFloat32) {
    std::memcpy(dst, x, sizeof(float) * n);
    return;
  }
  const uint16_t* b = static_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(b[i]) << 16);
}

// Σ a[i] * b[i] for i < n (n a multiple of kLanes, the callers pad), fixed order.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {0};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// y[i] = y[i] * alpha + p * x[i].
inline void scale_axpy(float* __restrict y, float alpha, float p, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * alpha + p * x[i];
}

inline void axpy(float* __restrict y, float p, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

// Block scores of one query row: bs[h][b] = max over block b's keys i < n of q[h] · key(i).
// key_row(i) gives key i's row; qf [h][dp] fp32 (zero padded to dp), tile [block_size][dp] scratch.
template <class KeyRow>
void score_blocks(const float* qf, int64_t h, int64_t d, int64_t dp, int64_t n, int64_t block_size, DType dt,
                  KeyRow key_row, float* tile, float* bs) {
  const int64_t nb = (n + block_size - 1) / block_size;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * block_size, i1 = std::min(n, i0 + block_size);
    for (int64_t i = i0; i < i1; ++i) to_float(key_row(i), dt, d, tile + (i - i0) * dp);
    for (int64_t hh = 0; hh < h; ++hh) {
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t i = 0; i < i1 - i0; ++i) {
        const float s = dot(qf + hh * dp, tile + i * dp, dp);
        nan |= std::isnan(s);
        m = s > m ? s : m;
      }
      bs[hh * nb + b] = nan ? std::numeric_limits<float>::quiet_NaN() : m;  // amax propagates NaN
    }
  }
}
