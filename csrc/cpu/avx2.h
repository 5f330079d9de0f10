// The AVX2 + FMA kernels (csrc/cpu/avx2.cpp; the indexer's in indexer_avx2.cpp), for x86 CPUs without AVX-512 BF16 (Zen 2/3,
// Haswell to Cascade Lake). That translation unit is compiled for avx2,fma,f16c by a pragma after
// its includes, so the library still loads on older CPUs; call these only where use_avx2()
// (isa.h) says the avx2 path is taken.
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

// Sparse MLA on the avx2 path: every q / cache dtype (bf16, fp32, fp8_ds_mla), prefill and decode.
void sparse_mla_avx2(const SparseMlaParams& p);

// Order keys (select.h) of x[0:n) that are >= floor, with their positions, in position order;
// returns how many it wrote to keys/pos (each must hold n + 8).
int64_t filter_at_least_avx2(const float* x, int64_t n, uint32_t floor, uint32_t* keys, int32_t* pos);

// The k largest of c >= k filtered keys (with their positions, in position order): writes their
// positions, ascending, to out[0:k) and returns k. Order: value desc, position asc (select.h).
// scratch must hold c.
int64_t select_survivors_avx2(const uint32_t* keys, const int32_t* pos, int64_t c, int64_t k, int32_t* out,
                              uint32_t* scratch);

// The indexer's key tile on the avx2 path: rows[j] (j < n <= 32: d elements of dt, fp32, bf16 or
// e4m3, d a multiple of 8) widened to fp32 and transposed to tile [d][32]; key lanes j >= n are 0.
void indexer_pack_tile_avx2(const void* const* rows, int n, DType dt, int64_t d, float* tile);
// out[j] = scale[j] · Σ_h w[h] · max(0, Σ_c q[h][c] · tile[c][j]) for the 32 keys of a tile (q fp32
// [h][d]; a NaN dot stays NaN), heads summed in order.
void indexer_score_tile_avx2(const float* q, const float* w, int64_t h, int64_t d, const float* tile,
                             const float* scale, float* out);

}  // namespace indexcache
