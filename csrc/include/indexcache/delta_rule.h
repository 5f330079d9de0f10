// The gated delta rule of the hybrid families' linear-attention layers (DESIGN.md §6:
// GLM-5.3-Flash's Kimi Delta Attention, per-channel gate; Qwen3.8-Flash-Next's Gated DeltaNet,
// one gate per head). Torch-free: raw pointers, shapes and strides only;
// python/indexcache/reference.py (delta_rule) is the formal definition.
//
// Per sequence b (tokens cu_seqlens[b] .. cu_seqlens[b+1]) and value head h, with the state row
// S = state[state_indices[b], h] ([d_k, d_v], fp32), per token t in order:
//   S = diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t
// where q_t, k_t are query/key head h / (h_v / h_k). S is updated in place.
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

struct DeltaRuleParams {
  const void* q;                 // [T, h_k, d_k] dtype; rows of h_k * d_k contiguous, q_stride apart
  const void* k;                 // [T, h_k, d_k] dtype; rows k_stride apart
  const void* v;                 // [T, h_v, d_v] dtype; rows v_stride apart
  const float* g;                // [T, h_v] (per head) or [T, h_v, d_k] (per channel), contiguous log-decay
  const float* beta;             // [T, h_v] contiguous
  float* state;                  // [n_slots, h_v, d_k, d_v] contiguous, updated in place
  const int32_t* cu_seqlens;     // [batch + 1] sequence starts, then T
  const int32_t* state_indices;  // [batch] state row of each sequence, distinct
  void* out;                     // [T, h_v, d_v] dtype, contiguous
  int64_t T;                     // tokens in the batch
  int64_t batch;
  int64_t h_k;
  int64_t h_v;                   // a multiple of h_k
  int64_t d_k;
  int64_t d_v;
  int64_t n_slots;
  int64_t q_stride;              // elements between token rows of q
  int64_t k_stride;
  int64_t v_stride;
  bool g_per_channel;            // g is [T, h_v, d_k] (KDA) rather than [T, h_v] (Gated DeltaNet)
  float scale;                   // on o
  DType dtype;                   // q, k, v and out: kFloat32 or kBFloat16
};

// The CPU kernel (csrc/cpu/delta_rule.cpp): chunked prefill, recurrent decode; vectorised per
// ISA path (isa.h, op "delta_rule"), parallel over (sequence, value head), deterministic.
void delta_rule_cpu(const DeltaRuleParams& p);

}  // namespace indexcache
