// The delta-rule CUDA launcher (csrc/cuda/delta_rule_impl.cuh) built for the CPU through
// cuda_emu.h, with a flat C interface for ctypes (test_emu_delta_rule.py). A library of its own
// (libicemu_delta_rule.so), built beside the others by emu_build.py:
//   g++ -std=c++20 -O1 -shared -fPIC -include cuda_emu.h -I../../include -I../../cuda \
//       emu_delta_rule.cpp -o libicemu_delta_rule.so -lpthread
#include "delta_rule_impl.cuh"

#include "emu_harness.h"

using namespace indexcache;
using namespace indexcache::cuda;

extern "C" {

const char* emu_dr_last_error() { return g_error.c_str(); }
int32_t emu_dr_error_count() { return g_err_word; }
void emu_dr_reset_error_count() { g_err_word = 0; }
void emu_dr_set_device(int sms, int smem_optin) {
  g_sms = sms;
  g_smem_optin = smem_optin;
}

// Sequences of at least this many tokens take the chunked kernel (<= 0: the launcher's default).
int64_t g_min_chunked = 0;
void emu_dr_set_min_chunked(int64_t n) { g_min_chunked = n; }

// The chunk the launcher picks for this d_k, gate kind and shared-memory limit (0: none fits).
int64_t emu_dr_chunk_tokens(int64_t d_k, int per_channel, int smem_optin) {
  return dr_detail::chunk_tokens(d_k, per_channel != 0, static_cast<int64_t>(smem_optin) - 64);
}

int emu_delta_rule(const void* q, const void* k, const void* v, const float* g, const float* beta, float* state,
                   const int32_t* cu_seqlens, const int32_t* state_indices, void* out, int64_t T, int64_t batch,
                   int64_t h_k, int64_t h_v, int64_t d_k, int64_t d_v, int64_t n_slots, int64_t q_stride,
                   int64_t k_stride, int64_t v_stride, int per_channel, float scale, int dtype) {
  return guarded([&] {
    Scratch s;
    DeltaRuleParams p{};
    p.q = q;
    p.k = k;
    p.v = v;
    p.g = g;
    p.beta = beta;
    p.state = state;
    p.cu_seqlens = cu_seqlens;
    p.state_indices = state_indices;
    p.out = out;
    p.T = T;
    p.batch = batch;
    p.h_k = h_k;
    p.h_v = h_v;
    p.d_k = d_k;
    p.d_v = d_v;
    p.n_slots = n_slots;
    p.q_stride = q_stride;
    p.k_stride = k_stride;
    p.v_stride = v_stride;
    p.g_per_channel = per_channel != 0;
    p.scale = scale;
    p.dtype = static_cast<DType>(dtype);
    delta_rule_cuda(p, env(s), g_min_chunked > 0 ? g_min_chunked : dr_detail::kMinChunked);
  });
}

}  // extern "C"
