// The AVX-512 fp32 sparse MLA kernel (csrc/cpu/sparse_mla_avx512.cpp) of the avx512bf16 path: q or
// cache in fp32 (any other cache format with an fp32 q). That translation unit is compiled for
// AVX-512 F/BW by a pragma after its includes, so the library still loads on AVX2-only CPUs; call
// it only where cpu_op_path (isa.h) gives the avx512bf16 path for (sparse_mla, fp32).
#pragma once

#include "indexcache/ops.h"

namespace indexcache {

// Sparse MLA for every q / cache dtype pair whose dispatch dtype is fp32 (sparse_mla_dtype, isa.h),
// 576 and 512 (K=V) rows, sinks and extra_indices; prefill and decode. Bit-identical across thread
// counts: how a row's keys are split among tasks depends on the shape only.
void sparse_mla_avx512_f32(const SparseMlaParams& p);

}  // namespace indexcache
