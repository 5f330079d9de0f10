// Scalar access to fp32 / bf16 elements of untyped row buffers, for the CPU kernels whose
// operands come in either dtype (rows_matmul, norm_rope): size, load as fp32, store with one
// rounding, and the address of element i.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {
namespace cpu {

inline int64_t esize(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

inline float load_f(const void* p, int64_t i, DType dt) {
  return dt == DType::kFloat32 ? static_cast<const float*>(p)[i]
                               : static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
}

inline void store_f(void* p, int64_t i, float v, DType dt) {
  if (dt == DType::kFloat32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v);
}

inline const char* elem_ptr(const void* base, int64_t i, DType dt) {
  return static_cast<const char*>(base) + i * esize(dt);
}

}  // namespace cpu
}  // namespace indexcache
