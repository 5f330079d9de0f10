// The CUDA launchers of csrc/cuda/*_impl.cuh built for the CPU through cuda_emu.h, with a
// flat C interface for ctypes (test_emu.py). "Device" pointers are host pointers here.
//   g++ -std=c++20 -O1 -shared -fPIC -include cuda_emu.h -I../../include -I../../cuda \
//       emu_ops.cpp -o libicemu.so -lpthread
#include "cache_impl.cuh"
#include "indexer_impl.cuh"
#include "sparse_mla_impl.cuh"
#include "topk_impl.cuh"

#include <cstdio>
#include <cstdlib>
#include <random>

#include "emu_harness.h"

using namespace indexcache;
using namespace indexcache::cuda;

namespace {

// One warp: four 8x8 16-bit matrices (src, row-major) staged in shared memory with a row stride
// of 24 elements, read back by ldmatrix (variant 1, 2, 4: .x1/.x2/.x4; 5: .x4.trans) with lane i
// passing the row i % 8 of matrix i / 8; out[lane][j] = register j.
__global__ void ldmatrix_probe_kernel(int variant, const uint16_t* src, uint32_t* out) {
  IC_DYNAMIC_SMEM(smem);
  uint16_t* sm = reinterpret_cast<uint16_t*>(smem);
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < 4 * 64; i += 32) sm[(i / 8) * 24 + i % 8] = src[i];
  __syncthreads();
  const uint16_t* row = sm + lane * 24;  // matrix lane / 8, row lane % 8
  uint32_t r[4] = {0, 0, 0, 0};
  if (variant == 1) {
    ::emu::ldmatrix<1>(r, row, false);
  } else if (variant == 2) {
    uint32_t q[2];
    ldmatrix_x2(q, row);
    r[0] = q[0];
    r[1] = q[1];
  } else if (variant == 4) {
    ldmatrix_x4(r, row);
  } else {
    ldmatrix_x4_trans(r, row);
  }
  for (int j = 0; j < 4; ++j) out[lane * 4 + j] = r[j];
}

// The emulator's own barriers (test_emu.py test_emulator_barriers). Thread i writes i + 1 to shared
// word i and reads word (i + 1) % n into out[i]: mode 0 with __syncthreads between, mode 1 without
// (a missing barrier: some reads must see the garbage the block started with), mode 2 with the
// first half of each warp in a shuffle the second half never joins (a divergent warp collective,
// which must end in the emulator's deadlock error, not a hang).
__global__ void barrier_probe_kernel(int mode, int* out) {
  IC_DYNAMIC_SMEM(smem);
  int* sm = reinterpret_cast<int*>(smem);
  const int i = static_cast<int>(threadIdx.x), n = static_cast<int>(blockDim.x);
  sm[i] = i + 1;
  if (mode == 0) __syncthreads();
  if (mode == 2 && (i & 31) < 16) sm[i] = __shfl_xor_sync(kFullMask, sm[i], 1);
  if (mode == 2) __syncthreads();
  out[i] = sm[(i + 1) % n];
}

}  // namespace

extern "C" {

const char* emu_last_error() { return g_error.c_str(); }
int32_t emu_error_count() { return g_err_word; }
void emu_reset_error_count() { g_err_word = 0; }
void emu_set_device(int sms, int smem_optin) {
  g_sms = sms;
  g_smem_optin = smem_optin;
}
// 1: fp8 inputs take the sm_89+ path (hardware e4m3x2 -> f16x2 conversion, f16 mma); 0: the
// software e4m3 -> bf16 path of older archs. Returns the previous setting.
int emu_set_fp8_f16(int on) {
  const int was = ::emu::g_fp8_f16 ? 1 : 0;
  ::emu::g_fp8_f16 = on != 0;
  return was;
}
// 1: the fp8 indexer may take the sm_90a wgmma kernels (aligned inputs, h % 64 == 0), as on an
// H100/H200 with INDEXCACHE_WGMMA=1; 0 (the default): the mma.sync ones. Returns the previous
// setting.
int emu_set_wgmma(int on) {
  const int was = ::emu::g_wgmma ? 1 : 0;
  ::emu::g_wgmma = on != 0;
  return was;
}
// The indexer's key-ring depth: 2..4 forces it, 0 restores the launcher's choice. Returns the
// previous setting.
int emu_set_indexer_stages(int stages) {
  const int was = ::emu::g_idx_stages;
  ::emu::g_idx_stages = stages;
  return was;
}
// The emulator's cvt.rn.f16x2.e4m3x2 (checked against torch's e4m3 -> f16 conversion).
uint32_t emu_cvt_f16x2_e4m3x2(uint32_t v) { return ::emu::cvt_f16x2_e4m3x2(static_cast<uint16_t>(v)); }

// The emulator's ldmatrix (ldmatrix_probe_kernel), checked against the PTX ISA layout.
int emu_ldmatrix(int variant, const uint16_t* src, uint32_t* out) {
  return guarded([&] { IC_LAUNCH(ldmatrix_probe_kernel, dim3(1), 32, 32 * 24 * 2, nullptr, variant, src, out); });
}

int emu_barrier_probe(int mode, int threads, int* out) {
  return guarded([&] {
    IC_LAUNCH(barrier_probe_kernel, dim3(1), threads, static_cast<size_t>(threads) * 4, nullptr, mode, out);
  });
}

int emu_quantize(const void* x, int dtype, uint8_t* values, float* scales, int64_t rows, int64_t d, float eps,
                 int hadamard) {
  return guarded([&] {
    Scratch s;
    quantize_fp8_cuda(QuantParams{x, values, scales, rows, d, eps, hadamard != 0, static_cast<DType>(dtype)}, env(s));
  });
}

int emu_index_k_insert(const void* k, const int64_t* slots, uint8_t* cache, int64_t n, int64_t d, int64_t block_size,
                       int64_t num_blocks, int hadamard, int dtype) {
  return guarded([&] {
    Scratch s;
    index_k_insert_cuda(
        IndexKInsertParams{k, slots, cache, n, d, block_size, num_blocks, hadamard != 0, static_cast<DType>(dtype)},
        env(s));
  });
}

int emu_mla_insert(const void* kv_c, const void* k_pe, const int64_t* slots, void* cache, int64_t n, int64_t num_slots,
                   int src_dtype, int cache_dtype) {
  return guarded([&] {
    Scratch s;
    mla_insert_cuda(MlaInsertParams{kv_c, k_pe, slots, cache, n, num_slots, static_cast<DType>(src_dtype),
                                    static_cast<DType>(cache_dtype)},
                    env(s));
  });
}

int emu_positions_to_slots(const int32_t* pos, const int32_t* req, const int32_t* table, int32_t* slots, int64_t n,
                           int64_t k, int64_t batch, int64_t max_blocks, int64_t block_size, int64_t num_blocks) {
  return guarded([&] {
    Scratch s;
    positions_to_slots_cuda(SlotParams{pos, req, table, slots, n, k, batch, max_blocks, block_size, num_blocks}, env(s));
  });
}

int emu_indexer_logits(const void* q, const void* k, const float* k_scale, const float* w, const int32_t* ks,
                       const int32_t* ke, int64_t s_q, int64_t s_kv, int64_t h, int dtype, float* logits,
                       int64_t stride, int64_t cols) {
  return guarded([&] {
    Scratch s;
    indexer_logits_cuda(IndexerParams{q, k, k_scale, w, ks, ke, s_q, s_kv, h, 128, static_cast<DType>(dtype)},
                        LogitsOut{logits, stride, cols}, env(s));
  });
}

int emu_indexer_topk(const void* q, const void* k, const float* k_scale, const float* w, const int32_t* ks,
                     const int32_t* ke, int64_t s_q, int64_t s_kv, int64_t h, int dtype, int32_t* out,
                     int64_t out_stride, int64_t width, int64_t topk) {
  return guarded([&] {
    Scratch s;
    indexer_topk_cuda(IndexerParams{q, k, k_scale, w, ks, ke, s_q, s_kv, h, 128, static_cast<DType>(dtype)},
                      TopkOut{out, out_stride, width, topk}, env(s));
  });
}

// The dense indexer ops at any head width d (even, <= 256; d != 128 runs indexer_any_impl.cuh).
int emu_indexer_logits_d(const void* q, const void* k, const float* k_scale, const float* w, const int32_t* ks,
                         const int32_t* ke, int64_t s_q, int64_t s_kv, int64_t h, int64_t d, int dtype, float* logits,
                         int64_t stride, int64_t cols) {
  return guarded([&] {
    Scratch s;
    indexer_logits_cuda(IndexerParams{q, k, k_scale, w, ks, ke, s_q, s_kv, h, d, static_cast<DType>(dtype)},
                        LogitsOut{logits, stride, cols}, env(s));
  });
}

int emu_indexer_topk_d(const void* q, const void* k, const float* k_scale, const float* w, const int32_t* ks,
                       const int32_t* ke, int64_t s_q, int64_t s_kv, int64_t h, int64_t d, int dtype, int32_t* out,
                       int64_t out_stride, int64_t width, int64_t topk) {
  return guarded([&] {
    Scratch s;
    indexer_topk_cuda(IndexerParams{q, k, k_scale, w, ks, ke, s_q, s_kv, h, d, static_cast<DType>(dtype)},
                      TopkOut{out, out_stride, width, topk}, env(s));
  });
}

static PagedIndexerParams paged(const uint8_t* q, const float* w, const uint8_t* cache, const int32_t* table,
                                const int32_t* lens, int64_t batch, int64_t next_n, int64_t h, int64_t block_size,
                                int64_t max_blocks, int64_t num_blocks) {
  return PagedIndexerParams{q, w, cache, table, lens, batch, next_n, h, 128, block_size, max_blocks, num_blocks};
}

int emu_indexer_logits_paged(const uint8_t* q, const float* w, const uint8_t* cache, const int32_t* table,
                             const int32_t* lens, int64_t batch, int64_t next_n, int64_t h, int64_t block_size,
                             int64_t max_blocks, int64_t num_blocks, int64_t max_len, float* logits, int64_t stride,
                             int64_t cols) {
  return guarded([&] {
    Scratch s;
    indexer_logits_paged_cuda(paged(q, w, cache, table, lens, batch, next_n, h, block_size, max_blocks, num_blocks),
                              max_len, LogitsOut{logits, stride, cols}, env(s));
  });
}

int emu_indexer_topk_paged(const uint8_t* q, const float* w, const uint8_t* cache, const int32_t* table,
                           const int32_t* lens, int64_t batch, int64_t next_n, int64_t h, int64_t block_size,
                           int64_t max_blocks, int64_t num_blocks, int64_t max_len, int32_t* out, int64_t out_stride,
                           int64_t width, int64_t topk) {
  return guarded([&] {
    Scratch s;
    indexer_topk_paged_cuda(paged(q, w, cache, table, lens, batch, next_n, h, block_size, max_blocks, num_blocks),
                            max_len, TopkOut{out, out_stride, width, topk}, env(s));
  });
}

int emu_topk(const float* logits, const int32_t* ks, const int32_t* ke, int64_t rows, int64_t stride, int32_t* out,
             int64_t out_stride, int64_t width, int64_t topk, int64_t max_window) {
  return guarded([&] {
    Scratch s;
    topk_cuda(TopkParams{logits, ks, ke, rows, stride}, TopkOut{out, out_stride, width, topk}, max_window, env(s));
  });
}

int emu_sparse_mla(const void* q, const void* kv, const int32_t* indices, void* out, float* lse, int64_t s_q,
                   int64_t h_q, int64_t topk, int64_t num_slots, int64_t d_v, float sm_scale, int q_dtype,
                   int kv_dtype) {
  return guarded([&] {
    Scratch s;
    sparse_mla_cuda(SparseMlaParams{q, kv, indices, out, lse, s_q, h_q, topk, num_slots, d_v, sm_scale,
                                    static_cast<DType>(q_dtype), static_cast<DType>(kv_dtype)},
                    env(s));
  });
}

// emu_sparse_mla with attention sinks: fp32 [h_q] (nullptr: none).
int emu_sparse_mla_sinks(const void* q, const void* kv, const int32_t* indices, void* out, float* lse, int64_t s_q,
                         int64_t h_q, int64_t topk, int64_t num_slots, int64_t d_v, float sm_scale, int q_dtype,
                         int kv_dtype, const float* sinks) {
  return guarded([&] {
    Scratch s;
    SparseMlaParams p{q, kv, indices, out, lse, s_q, h_q, topk, num_slots, d_v, sm_scale,
                      static_cast<DType>(q_dtype), static_cast<DType>(kv_dtype)};
    p.sinks = sinks;
    sparse_mla_cuda(p, env(s));
  });
}

// emu_sparse_mla generalised (DeepSeek-V4): rows of d_qk (576 or 512), sinks fp32 [h_q] or
// nullptr, extra_indices int32 [s_q, n_extra] or nullptr (attended together with indices).
int emu_sparse_mla_v4(const void* q, const void* kv, const int32_t* indices, const int32_t* extra_indices,
                      void* out, float* lse, int64_t s_q, int64_t h_q, int64_t topk, int64_t n_extra,
                      int64_t num_slots, int64_t d_v, float sm_scale, int q_dtype, int kv_dtype, const float* sinks,
                      int64_t d_qk) {
  return guarded([&] {
    Scratch s;
    SparseMlaParams p{q, kv, indices, out, lse, s_q, h_q, topk, num_slots, d_v, sm_scale,
                      static_cast<DType>(q_dtype), static_cast<DType>(kv_dtype)};
    p.sinks = sinks;
    p.extra_indices = extra_indices;
    p.n_extra = extra_indices != nullptr ? n_extra : 0;
    p.d_qk = d_qk;
    sparse_mla_cuda(p, env(s));
  });
}

}  // extern "C"
