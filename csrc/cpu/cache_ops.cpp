// Element-wise CPU ops: fp8 quantization, the two cache inserts, position -> slot.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "../checks.h"
#include "registry.h"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"
#include "isa.h"

namespace indexcache {
namespace {

inline float load_value(const void* base, DType dt, int64_t i) {
  return dt == DType::kFloat32 ? static_cast<const float*>(base)[i]
                               : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

// e4m3 bytes of 128 values already scaled into [-448, 448], round to nearest even,
// bit-identical to float_to_e4m3.
__attribute__((target("avx512f,avx512bw"))) void to_e4m3_avx512(const float* x, uint8_t* dst) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (int i = 0; i < kQuantGroup; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __m512i a = _mm512_and_si512(u, abs_mask);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    // Normal: round the 20 dropped mantissa bits to even, rebias the exponent 127 -> 7.
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), lsb));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
    // Subnormal (|x| < 2^-6): round |x| * 2^9 to the nearest even integer.
    const __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f));
    const __m512i sub = _mm512_cvtps_epi32(_mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x3C800000));  // 2^-6
    const __m512i mag = _mm512_mask_blend_epi32(is_sub, normal, sub);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(_mm512_or_si512(mag, sign)));
  }
}

// The same bytes from AVX2: 8 values a vector, packed 32 -> 16 -> 8 bits (every value is in
// [0, 255], so the saturating packs never saturate) and put back in order across the 128-bit lanes.
__attribute__((target("avx2"))) void to_e4m3_avx2(const float* x, uint8_t* dst) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < kQuantGroup; i += 32) {
    __m256i mag[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * j));
      const __m256i a = _mm256_and_si256(u, abs_mask);
      const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
      const __m256i rounded = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), lsb));
      const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
      const __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f));
      const __m256i sub = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a);  // below 2^-6
      mag[j] = _mm256_or_si256(_mm256_blendv_epi8(normal, sub, is_sub), sign);
    }
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(mag[0], mag[1]), _mm256_packus_epi32(mag[2], mag[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

// One group of 128 values: optional Hadamard, ue8m0 scale, e4m3 bytes.
inline float quantize_group(const void* src, DType dt, int64_t offset, float eps, bool hadamard,
                            uint8_t* dst) {
  alignas(64) float buf[kQuantGroup];
  if (dt == DType::kFloat32) {
    std::memcpy(buf, static_cast<const float*>(src) + offset, sizeof buf);
  } else {
    for (int i = 0; i < kQuantGroup; ++i) buf[i] = load_value(src, dt, offset + i);
  }
  if (hadamard) hadamard_128_inplace(buf);
  float amax = 0.f;
  for (int i = 0; i < kQuantGroup; ++i) amax = nan_max(amax, std::fabs(buf[i]));
  if (!is_finite_f(amax)) {  // a NaN or inf in the group: NaN scale and values (docs/ops.md)
    std::memset(dst, kE4m3NaN, kQuantGroup);
    return quiet_nan();
  }
  const float scale = ue8m0_scale(amax, eps);
  const float inv = 1.0f / scale;  // exact: scale is a power of two
  const CpuPath path = cpu_op_path(CpuOp::kQuantize, dt);
  if (path == CpuPath::kAvx512Bf16 || path == CpuPath::kAvx2) {
    for (int i = 0; i < kQuantGroup; ++i) buf[i] *= inv;
    (path == CpuPath::kAvx2 ? to_e4m3_avx2 : to_e4m3_avx512)(buf, dst);
  } else {
    for (int i = 0; i < kQuantGroup; ++i) dst[i] = float_to_e4m3(buf[i] * inv);
  }
  return scale;
}

}  // namespace

void quantize_fp8_cpu(const QuantParams& p) {
  const int64_t groups = p.d / kQuantGroup;
  at::parallel_for(0, p.rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      p.scales[g] = quantize_group(p.x, p.x_dtype, g * kQuantGroup, p.eps, p.hadamard,
                                   p.values + g * kQuantGroup);
    }
  });
}

void index_k_insert_cpu(const IndexKInsertParams& p) {
  const int64_t block_bytes = p.block_size * (p.d + 4);
  at::parallel_for(0, p.n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = p.slot_mapping[i];
      if (slot < 0) continue;
      uint8_t* block = p.cache + (slot / p.block_size) * block_bytes;
      const int64_t off = slot % p.block_size;
      float* scales = reinterpret_cast<float*>(block + p.block_size * p.d);
      // d == 128: one scale per token.
      scales[off] = quantize_group(p.k, p.k_dtype, i * p.d, kIndexKEps, p.hadamard, block + off * p.d);
    }
  });
}

void mla_insert_cpu(const MlaInsertParams& p) {
  at::parallel_for(0, p.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = p.slot_mapping[i];
      if (slot < 0) continue;
      if (p.cache_dtype == DType::kFp8E4M3) {
        uint8_t* row = static_cast<uint8_t*>(p.cache) + slot * kMlaFp8Bytes;
        float* scales = reinterpret_cast<float*>(row + kMlaLatent);
        for (int g = 0; g < kMlaLatent / kQuantGroup; ++g) {
          float amax = 0.f;
          for (int j = 0; j < kQuantGroup; ++j)
            amax = nan_max(amax, std::fabs(load_value(p.kv_c, p.src_dtype, i * kMlaLatent + g * kQuantGroup + j)));
          if (!is_finite_f(amax)) {  // NaN scale and values, as quantize_fp8 (docs/ops.md)
            scales[g] = quiet_nan();
            std::memset(row + g * kQuantGroup, kE4m3NaN, kQuantGroup);
            continue;
          }
          const float scale = std::max(amax, kMlaFp8Eps) / kFp8Max;
          scales[g] = scale;
          for (int j = 0; j < kQuantGroup; ++j) {
            const float v = load_value(p.kv_c, p.src_dtype, i * kMlaLatent + g * kQuantGroup + j);
            row[g * kQuantGroup + j] = float_to_e4m3(v / scale);
          }
        }
        uint16_t* rope = reinterpret_cast<uint16_t*>(row + kMlaLatent + 16);
        for (int j = 0; j < kMlaRope; ++j) rope[j] = float_to_bf16(load_value(p.k_pe, p.src_dtype, i * kMlaRope + j));
      } else {
        const int64_t lat = p.d_latent, width = lat + kMlaRope;  // 576, or 512 for DeepSeek-V4
        for (int64_t j = 0; j < width; ++j) {
          const float v = j < lat ? load_value(p.kv_c, p.src_dtype, i * lat + j)
                                  : load_value(p.k_pe, p.src_dtype, i * kMlaRope + j - lat);
          if (p.cache_dtype == DType::kFloat32) {
            static_cast<float*>(p.cache)[slot * width + j] = v;
          } else {
            static_cast<uint16_t*>(p.cache)[slot * width + j] = float_to_bf16(v);
          }
        }
      }
    }
  });
}

void positions_to_slots_cpu(const SlotParams& p) {
  at::parallel_for(0, p.n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* table = p.block_table + static_cast<int64_t>(p.req_of_row[r]) * p.max_blocks;
      for (int64_t j = 0; j < p.k; ++j) {
        const int32_t pos = p.positions[r * p.k + j];
        p.slots[r * p.k + j] =
            pos < 0 ? -1 : static_cast<int32_t>(table[pos / p.block_size] * p.block_size + pos % p.block_size);
      }
    }
  });
}

namespace {

std::tuple<at::Tensor, at::Tensor> quantize_fp8_op(const at::Tensor& x, double eps, bool hadamard) {
  auto [values, scales] = make_quant_outputs(x);
  quantize_fp8_cpu(make_quant_params(x, values, scales, eps, hadamard));
  return {values, scales};
}

void index_k_cache_insert_op(const at::Tensor& k, const at::Tensor& slot_mapping, at::Tensor& cache, bool hadamard) {
  const auto p = make_index_k_insert_params(k, slot_mapping, cache, hadamard);
  check_slots_in_range(slot_mapping, p.num_blocks * p.block_size, "slot_mapping");
  index_k_insert_cpu(p);
}

void mla_kv_cache_insert_op(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& slot_mapping,
                            at::Tensor& cache) {
  const auto p = make_mla_insert_params(kv_c, k_pe, slot_mapping, cache);
  check_slots_in_range(slot_mapping, p.num_slots, "slot_mapping");
  mla_insert_cpu(p);
}

void positions_to_slots_op(const at::Tensor& positions, const at::Tensor& req_of_row, const at::Tensor& block_table,
                           int64_t block_size, int64_t num_blocks, at::Tensor& slots) {
  const auto p = make_slot_params(positions, req_of_row, block_table, block_size, num_blocks, slots);
  check_positions_cpu(p);
  positions_to_slots_cpu(p);
}

}  // namespace

// Host-side validation of positions and block ids (the CUDA op validates through the
// same code on a host copy only in debug; see csrc/cuda).
void check_positions_cpu(const SlotParams& p) {
  for (int64_t r = 0; r < p.n; ++r) {
    const int32_t req = p.req_of_row[r];
    TORCH_CHECK(req >= 0 && req < p.batch, "req_of_row[", r, "]=", req, " is outside the block table's ", p.batch,
                " requests");
    for (int64_t j = 0; j < p.k; ++j) {
      const int32_t pos = p.positions[r * p.k + j];
      if (pos < 0) {
        TORCH_CHECK(pos == -1, "positions[", r, ", ", j, "]=", pos, ": only -1 may mark an empty entry");
        continue;
      }
      const int64_t blk = pos / p.block_size;
      TORCH_CHECK(blk < p.max_blocks, "positions[", r, ", ", j, "]=", pos, " needs block ", blk,
                  " but the block table has ", p.max_blocks, " columns");
      const int32_t id = p.block_table[req * p.max_blocks + blk];
      TORCH_CHECK(id >= 0 && id < p.num_blocks, "block_table[", req, ", ", blk, "]=", id,
                  " is outside the cache's ", p.num_blocks, " blocks (position ", pos, ")");
    }
  }
}

void register_cache_ops_cpu(torch::Library& m) {
  m.impl("quantize_fp8", &quantize_fp8_op);
  m.impl("index_k_cache_insert", &index_k_cache_insert_op);
  m.impl("mla_kv_cache_insert", &mla_kv_cache_insert_op);
  m.impl("positions_to_slots", &positions_to_slots_op);
}

}  // namespace indexcache
