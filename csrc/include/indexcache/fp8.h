// e4m3 (float8_e4m3fn) and bf16 conversions shared by CPU and CUDA code. Torch-free.
// Rounding is round-to-nearest-even, matching torch's .to(torch.float8_e4m3fn), so a
// kernel and the pure-torch reference produce the same bytes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define IC_HD __host__ __device__ __forceinline__
#else
#define IC_HD inline
#endif

namespace indexcache {

constexpr float kFp8Max = 448.0f;
constexpr int kQuantGroup = 128;        // values per scale
constexpr int kIndexHeadDim = 128;      // DESIGN.md §4
constexpr int kMlaLatent = 512;         // DESIGN.md §5
constexpr int kMlaRope = 64;
constexpr int kMlaDim = kMlaLatent + kMlaRope;             // 576
constexpr int kMlaFp8Bytes = kMlaLatent + 4 * 4 + kMlaRope * 2;  // 656
constexpr float kIndexKEps = 1e-4f;
constexpr float kIndexQEps = 1e-10f;
constexpr float kMlaFp8Eps = 1e-4f;

IC_HD uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
IC_HD float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> e4m3 byte, round to nearest even, saturating finite overflow is not needed
// (callers scale into [-448, 448]); NaN maps to 0x7F as torch does.
IC_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;  // NaN
  const float af = bits_f32(a);
  if (af >= 480.0f) return sign | 0x7F;     // rounds past 448: NaN (e4m3fn has no inf)
  if (af < 0.015625f) {                     // below 2^-6: subnormal range, step 2^-9
    // Round af / 2^-9 to nearest even integer in [0, 8].
    const float scaled = af * 512.0f;
    float r = std::nearbyint(scaled);  // default rounding mode is to-nearest-even
    return sign | static_cast<uint8_t>(r);
  }
  // Normal: keep 3 mantissa bits with RNE on the 20 dropped bits.
  uint32_t exp = (a >> 23) - 127 + 7;  // e4m3 bias 7
  uint32_t mant = a & 0x7FFFFFu;
  uint32_t keep = mant >> 20;
  const uint32_t rest = mant & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) {
    keep += 1;
    if (keep == 8) {
      keep = 0;
      exp += 1;
    }
  }
  return sign | static_cast<uint8_t>((exp << 3) | keep);
}

IC_HD float e4m3_to_float(uint8_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  if (exp == 0xF && mant == 0x7) return bits_f32(sign | 0x7FC00000u);  // NaN
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9
    return (b & 0x80u) ? -v : v;
  }
  return bits_f32(sign | ((exp - 7 + 127) << 23) | (mant << 20));
}

// bf16 <-> float, round to nearest even (NaN kept quiet).
IC_HD uint16_t float_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
IC_HD float bf16_to_float(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Non-finite inputs (docs/ops.md, "Non-finite inputs"): a quantization group whose values
// are not all finite gets a NaN scale and NaN (0x7F) bytes, so the blow-up reaches every
// output that reads the group instead of being clipped to a finite scale.
constexpr uint8_t kE4m3NaN = 0x7F;
IC_HD float quiet_nan() { return bits_f32(0x7FC00000u); }
// False for NaN and +-inf.
IC_HD bool is_finite_f(float x) { return (f32_bits(x) & 0x7FFFFFFFu) < 0x7F800000u; }
// max(a, b) that keeps a NaN of either operand (fmaxf / std::max drop it).
IC_HD float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// 2^ceil(log2(max(amax, eps) / 448)), exact (no log2 rounding at powers of two).
IC_HD float ue8m0_scale(float amax, float eps) {
  const float r = (amax > eps ? amax : eps) / kFp8Max;
  int e;
  const float m = std::frexp(r, &e);  // r = m * 2^e, m in [0.5, 1)
  if (m == 0.5f) e -= 1;
  return std::ldexp(1.0f, e);
}

// In-place orthonormal 128-point Walsh-Hadamard rotation; the operation order matches
// reference.hadamard_128 so results are bit-identical.
IC_HD void hadamard_128_inplace(float* x) {
  for (int h = 1; h < kQuantGroup; h *= 2) {
    for (int i = 0; i < kQuantGroup; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = 0.08838834764831845f;  // 128^-1/2 rounded to fp32
  for (int i = 0; i < kQuantGroup; ++i) x[i] *= s;
}

// One fp8_ds_mla cache row (656 bytes) as the 576 bf16 values the bf16 compute paths use:
// each latent e4m3 value times its group's fp32 scale, rounded to bf16; the RoPE part copied.
// Host code (the CPU ops); the CUDA kernels stage rows their own way.
inline void mla_fp8_row_to_bf16(const uint8_t* row, uint16_t* dst) {
  float scales[4];
  std::memcpy(scales, row + kMlaLatent, 16);
  for (int i = 0; i < kMlaLatent; ++i) dst[i] = float_to_bf16(e4m3_to_float(row[i]) * scales[i / kQuantGroup]);
  std::memcpy(dst + kMlaLatent, row + kMlaLatent + 16, kMlaRope * 2);
}

}  // namespace indexcache
