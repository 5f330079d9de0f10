// RMSNorm and rotary embedding over rows on CPU (indexcache/norm_rope.h): a decode step's small
// ops, one pass each. torch's forms (models/blocks/norms.py, rope.py) cast to fp32, then run 4-14
// ops with temporaries; at one row each op costs its dispatch, not its arithmetic.
//
// The AVX-512 and portable paths compute the same roundings in the same order (an RMSNorm row's
// sum of squares in 16 lanes, k ascending per lane, then the lanes in a fixed tree; products and
// rotation's fused products as written in the header; the products are fused explicitly, so no
// compiler contraction can tell the paths apart), so their fp32 results are bit-identical, and so
// are bf16 results but two kinds: the AVX-512 path's bf16 store (vcvtneps2bf16, store16_cvt below)
// writes a subnormal result as zero and keeps a NaN's payload bits, where the portable path (c10's
// rounding) keeps the subnormal and writes 0x7FC0. A row never depends on which thread runs it.
// isa.h's cpu_op_path(CpuOp::kNormRope, x dtype) picks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd.h"
#endif

#include "../checks.h"
#include "elem_io.h"
#include "indexcache/norm_rope.h"
#include "isa.h"
#include "registry.h"

namespace indexcache {
namespace {

constexpr int64_t kSerialWork = int64_t{1} << 16;  // values below which one thread runs a call
constexpr int64_t kChunkValues = int64_t{1} << 14;  // at least this many values per parallel chunk
constexpr int kLanes = 16;

using cpu::elem_ptr;
using cpu::esize;
using cpu::load_f;
using cpu::store_f;

// The 16 lane sums -> one: lanes i and i + w added for w = 8, 4, 2, 1.
inline float lane_tree(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) acc[i] += acc[i + w];
  return acc[0];
}

inline float rms_scale(float sum_sq, const RmsNormParams& p) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(p.D) + p.eps);
}

// ---------------------------------------------------------------------------------- portable

void rms_rows_portable(const RmsNormParams& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const char* x = elem_ptr(p.x, n * p.x_sn, p.x_dtype);
    char* out = const_cast<char*>(elem_ptr(p.out, n * p.o_sn, p.out_dtype));
    float acc[kLanes] = {};
    for (int64_t k = 0; k < p.D; ++k) {
      const float v = load_f(x, k, p.x_dtype);
      acc[k % kLanes] = std::fma(v, v, acc[k % kLanes]);
    }
    const float r = rms_scale(lane_tree(acc), p);
    for (int64_t k = 0; k < p.D; ++k) store_f(out, k, (load_f(x, k, p.x_dtype) * r) * load_f(p.w, k, p.w_dtype),
                                             p.out_dtype);
  }
}

void rope_heads_portable(const RopeParams& p, int64_t t0, int64_t t1) {
  const int64_t m = p.R / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t / p.H, h = t % p.H;
    const char* x = elem_ptr(p.x, n * p.x_sn + h * p.x_sh, p.x_dtype);
    char* out = const_cast<char*>(elem_ptr(p.out, n * p.o_sn + h * p.o_sh, p.out_dtype));
    const float* c = p.cos + n * m;
    const float* s = p.sin + n * m;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t ia = p.interleaved ? 2 * i : i, ib = p.interleaved ? 2 * i + 1 : i + m;
      const float a = load_f(x, ia, p.x_dtype), b = load_f(x, ib, p.x_dtype);
      const float bs = b * s[i], as = a * s[i];
      store_f(out, ia, std::fma(a, c[i], -bs), p.out_dtype);
      store_f(out, ib, std::fma(b, c[i], as), p.out_dtype);
    }
  }
}

// ---------------------------------------------------------------------------------- AVX-512
#if defined(__x86_64__)
#define IC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

using cpu::load16;
using cpu::tail16;

// Rounds to nearest even as c10::BFloat16 does (vcvtneps2bf16), in one instruction; unlike
// simd.h's store16 (c10's rounding lane by lane) it flushes subnormal results to zero and keeps a
// NaN's payload bits where c10 writes 0x7FC0.
IC_AVX512 inline void store16_cvt(char* p, __m512 v, DType dt, __mmask16 mask) {
  if (dt == DType::kFloat32) return _mm512_mask_storeu_ps(p, mask, v);
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

IC_AVX512 void rms_rows_avx512(const RmsNormParams& p, int64_t n0, int64_t n1) {
  const int64_t xe = esize(p.x_dtype), we = esize(p.w_dtype), oe = esize(p.out_dtype);
  for (int64_t n = n0; n < n1; ++n) {
    const char* x = elem_ptr(p.x, n * p.x_sn, p.x_dtype);
    char* out = const_cast<char*>(elem_ptr(p.out, n * p.o_sn, p.out_dtype));
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.D; k += kLanes) {
      const __m512 v = load16(x + k * xe, p.x_dtype, tail16(p.D - k));
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, acc);
    const __m512 r = _mm512_set1_ps(rms_scale(lane_tree(lanes), p));
    for (int64_t k = 0; k < p.D; k += kLanes) {
      const __mmask16 mk = tail16(p.D - k);
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16(x + k * xe, p.x_dtype, mk), r),
                                     load16(static_cast<const char*>(p.w) + k * we, p.w_dtype, mk));
      store16_cvt(out + k * oe, y, p.out_dtype, mk);
    }
  }
}

// Interleaved pairs, 8 at a time: lanes (a0 b0 a1 b1 ..) times (c0 c0 c1 c1 ..), fused with the
// pair-swapped lanes (b0 a0 ..) times (s0 s0 ..): subtracted in the a lanes, added in the b lanes.
IC_AVX512 void rope_interleaved_avx512(const RopeParams& p, const char* x, char* out, const float* c,
                                       const float* s) {
  const int64_t xe = esize(p.x_dtype), oe = esize(p.out_dtype), m = p.R / 2;
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (int64_t i = 0; i < m; i += 8) {
    const int64_t pairs = m - i < 8 ? m - i : 8;
    const __mmask16 mk = tail16(2 * pairs);
    const __mmask8 mc = static_cast<__mmask8>((1u << pairs) - 1);
    const __m512 cc = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(mc, c + i)));
    const __m512 ss = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(mc, s + i)));
    const __m512 v = load16(x + 2 * i * xe, p.x_dtype, mk);
    const __m512 t = _mm512_mul_ps(_mm512_permute_ps(v, 0xB1), ss);
    const __m512 y = _mm512_mask_blend_ps(__mmask16(0x5555), _mm512_fmadd_ps(v, cc, t), _mm512_fmsub_ps(v, cc, t));
    store16_cvt(out + 2 * i * oe, y, p.out_dtype, mk);
  }
}

IC_AVX512 void rope_split_avx512(const RopeParams& p, const char* x, char* out, const float* c, const float* s) {
  const int64_t xe = esize(p.x_dtype), oe = esize(p.out_dtype), m = p.R / 2;
  for (int64_t i = 0; i < m; i += kLanes) {
    const __mmask16 mk = tail16(m - i);
    const __m512 a = load16(x + i * xe, p.x_dtype, mk), b = load16(x + (i + m) * xe, p.x_dtype, mk);
    const __m512 cv = _mm512_maskz_loadu_ps(mk, c + i), sv = _mm512_maskz_loadu_ps(mk, s + i);
    const __m512 ya = _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv));
    const __m512 yb = _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv));
    store16_cvt(out + i * oe, ya, p.out_dtype, mk);
    store16_cvt(out + (i + m) * oe, yb, p.out_dtype, mk);
  }
}

IC_AVX512 void rope_heads_avx512(const RopeParams& p, int64_t t0, int64_t t1) {
  const int64_t m = p.R / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t / p.H, h = t % p.H;
    const char* x = elem_ptr(p.x, n * p.x_sn + h * p.x_sh, p.x_dtype);
    char* out = const_cast<char*>(elem_ptr(p.out, n * p.o_sn + h * p.o_sh, p.out_dtype));
    if (p.interleaved)
      rope_interleaved_avx512(p, x, out, p.cos + n * m, p.sin + n * m);
    else
      rope_split_avx512(p, x, out, p.cos + n * m, p.sin + n * m);
  }
}
#undef IC_AVX512
#endif

// Items [0, items) of `values_each` values: inline below kSerialWork values, else at::parallel_for.
template <typename Body>
void over_items(int64_t items, int64_t values_each, const Body& body) {
  if (items * values_each < kSerialWork) return body(0, items);
  at::parallel_for(0, items, std::max<int64_t>(kChunkValues / std::max<int64_t>(values_each, 1), 1), body);
}

void rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  IC_CHECK_DIM(x, 2, "x");
  IC_CHECK_DIM(w, 1, "w");
  IC_CHECK_SAME_DEVICE(x, w, "x", "w");
  IC_CHECK_SAME_DEVICE(x, out, "x", "out");
  TORCH_CHECK(w.size(0) == x.size(1), "w must have x's last dim ", x.size(1), " values, got shape ", w.sizes());
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", x.sizes(), ", got ", out.sizes());
  IC_CHECK_CONTIG(w, "w");
  check_unit_last(x, "x");
  check_unit_last(out, "out");
  TORCH_CHECK(eps >= 0 && std::isfinite(eps), "eps must be finite and >= 0, got ", eps);
  RmsNormParams p{};
  p.x_dtype = float_dtype(x, "x");
  p.w_dtype = float_dtype(w, "w");
  p.out_dtype = float_dtype(out, "out");
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.out = out.data_ptr();
  p.N = x.size(0);
  p.D = x.size(1);
  p.x_sn = x.stride(0);
  p.o_sn = out.stride(0);
  p.eps = static_cast<float>(eps);
  rms_norm_cpu(p);
}

void rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, at::Tensor& out) {
  IC_CHECK_DIM(x, 3, "x");
  IC_CHECK_DIM(cos, 2, "cos");
  IC_CHECK_DIM(sin, 2, "sin");
  IC_CHECK_SAME_DEVICE(x, cos, "x", "cos");
  IC_CHECK_SAME_DEVICE(x, sin, "x", "sin");
  IC_CHECK_SAME_DEVICE(x, out, "x", "out");
  IC_CHECK_DTYPE(cos, at::kFloat, "cos");
  IC_CHECK_DTYPE(sin, at::kFloat, "sin");
  IC_CHECK_CONTIG(cos, "cos");
  IC_CHECK_CONTIG(sin, "sin");
  TORCH_CHECK(x.size(2) % 2 == 0, "x's last dim (the rotated width) must be even, got ", x.size(2));
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2) && sin.sizes() == cos.sizes(),
              "cos and sin must be [N, R / 2] = [", x.size(0), ", ", x.size(2) / 2, "] for x ", x.sizes(), ", got ",
              cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", x.sizes(), ", got ", out.sizes());
  check_unit_last(x, "x");
  check_unit_last(out, "out");
  const bool same = x.numel() > 0 && out.data_ptr() == x.data_ptr();  // empty tensors share no memory
  TORCH_CHECK(!same || (out.strides() == x.strides() && out.scalar_type() == x.scalar_type()),
              "out may be x itself (same strides and dtype) but not another view of its memory");
  RopeParams p{};
  p.x_dtype = float_dtype(x, "x");
  p.out_dtype = float_dtype(out, "out");
  p.x = x.data_ptr();
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.out = out.data_ptr();
  p.N = x.size(0);
  p.H = x.size(1);
  p.R = x.size(2);
  p.x_sn = x.stride(0);
  p.x_sh = x.stride(1);
  p.o_sn = out.stride(0);
  p.o_sh = out.stride(1);
  p.interleaved = interleaved;
  rope_cpu(p);
}

}  // namespace

void register_norm_rope_cpu(torch::Library& m) {
  m.impl("rms_norm", &rms_norm_op);
  m.impl("rope", &rope_op);
}

void rms_norm_cpu(const RmsNormParams& p) {
  if (p.N == 0 || p.D == 0) return;
  auto body = [&](int64_t n0, int64_t n1) {
#if defined(__x86_64__)
    if (cpu_op_path(CpuOp::kNormRope, p.x_dtype) == CpuPath::kAvx512Bf16) return rms_rows_avx512(p, n0, n1);
#endif
    rms_rows_portable(p, n0, n1);
  };
  over_items(p.N, p.D, body);
}

void rope_cpu(const RopeParams& p) {
  if (p.N == 0 || p.H == 0 || p.R == 0) return;
  auto body = [&](int64_t t0, int64_t t1) {
#if defined(__x86_64__)
    if (cpu_op_path(CpuOp::kNormRope, p.x_dtype) == CpuPath::kAvx512Bf16) return rope_heads_avx512(p, t0, t1);
#endif
    rope_heads_portable(p, t0, t1);
  };
  over_items(p.N * p.H, p.R, body);
}

}  // namespace indexcache
