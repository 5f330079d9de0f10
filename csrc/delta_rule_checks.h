// Argument checks and the params-struct builder of the delta-rule op, shared by the CPU op impl
// (csrc/cpu/delta_rule.cpp) and the CUDA one (csrc/cuda/delta_rule.cu), so both devices reject
// the same inputs with the same messages (as checks.h does for the other ops).
//
// host_values: also check cu_seqlens (0 first, non-decreasing, T last) and state_indices (inside
// [0, n_slots), distinct) by reading them on the host. The CPU always does; CUDA only with
// INDEXCACHE_CHECK=1. Otherwise the CUDA kernel skips a sequence whose token range or state row
// is invalid (or whose row an earlier sequence of the batch already took) and counts it in the
// device's error word.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <vector>

#include "checks.h"
#include "indexcache/delta_rule.h"

namespace indexcache {
namespace delta_rule_checks {

// Rows of [h, d] contiguous (any stride between tokens): q, k and v may be views of one fused
// projection's output.
inline void check_token_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, name, " must have 3 dims, got shape ", t.sizes());
  TORCH_CHECK(t.size(2) <= 1 || t.stride(2) == 1, name, "'s last dim must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == t.size(2), name, "'s [h, d] rows must be contiguous, got strides ",
              t.strides());
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2), name,
              "'s token rows must not overlap, got strides ", t.strides());
}

inline DeltaRuleParams make_delta_rule_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                              const at::Tensor& cu_seqlens, const at::Tensor& state_indices,
                                              double scale, at::Tensor& out, bool host_values) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16, got ", q.scalar_type());
  IC_CHECK_DTYPE(k, q.scalar_type(), "k");
  IC_CHECK_DTYPE(v, q.scalar_type(), "v");
  IC_CHECK_DTYPE(out, q.scalar_type(), "out");
  IC_CHECK_DTYPE(g, at::kFloat, "g");
  IC_CHECK_DTYPE(beta, at::kFloat, "beta");
  IC_CHECK_DTYPE(state, at::kFloat, "state");
  IC_CHECK_DTYPE(cu_seqlens, at::kInt, "cu_seqlens");
  IC_CHECK_DTYPE(state_indices, at::kInt, "state_indices");
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&k, &v, &g, &beta, &state, &cu_seqlens, &state_indices, &out})
    IC_CHECK_SAME_DEVICE(q, (*t), "q", "every argument");
  check_token_rows(q, "q");
  check_token_rows(k, "k");
  check_token_rows(v, "v");
  const int64_t T = q.size(0), h_k = q.size(1), d_k = q.size(2), h_v = v.size(1), d_v = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape [T, h_k, d_k] = ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.size(0) == T, "v must have q's ", T, " tokens, got shape ", v.sizes());
  TORCH_CHECK(h_k >= 1 && h_v >= 1 && d_k >= 1 && d_v >= 1, "q, k and v need at least one head and one channel, got q ",
              q.sizes(), " and v ", v.sizes());
  TORCH_CHECK(h_v % h_k == 0, "v's ", h_v, " heads (h_v) must be a multiple of q and k's ", h_k, " (h_k)");
  IC_CHECK_CONTIG(g, "g");
  const bool per_channel = g.dim() == 3;
  TORCH_CHECK((g.dim() == 2 && g.size(0) == T && g.size(1) == h_v) ||
                  (per_channel && g.size(0) == T && g.size(1) == h_v && g.size(2) == d_k),
              "g must be [T, h_v] = [", T, ", ", h_v, "] or [T, h_v, d_k] = [", T, ", ", h_v, ", ", d_k, "], got ",
              g.sizes());
  IC_CHECK_CONTIG(beta, "beta");
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == T && beta.size(1) == h_v, "beta must be [T, h_v] = [", T, ", ", h_v,
              "], got ", beta.sizes());
  IC_CHECK_CONTIG(state, "state");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == h_v && state.size(2) == d_k && state.size(3) == d_v,
              "state must be [n_slots, h_v, d_k, d_v] = [n_slots, ", h_v, ", ", d_k, ", ", d_v, "], got ",
              state.sizes());
  IC_CHECK_CONTIG(out, "out");
  TORCH_CHECK(out.sizes() == v.sizes(), "out must have v's shape [T, h_v, d_v] = ", v.sizes(), ", got ", out.sizes());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 && cu_seqlens.is_contiguous(),
              "cu_seqlens must be a contiguous 1-d tensor of batch + 1 entries, got shape ", cu_seqlens.sizes());
  const int64_t batch = cu_seqlens.size(0) - 1;
  TORCH_CHECK(state_indices.dim() == 1 && state_indices.size(0) == batch && state_indices.is_contiguous(),
              "state_indices must be a contiguous 1-d tensor of batch = ", batch,
              " entries (cu_seqlens has batch + 1), got shape ", state_indices.sizes());
  TORCH_CHECK(T < (int64_t{1} << 31), "delta_rule takes fewer than 2^31 tokens, got ", T);
  const int64_t n_slots = state.size(0);
  if (host_values) {
    const at::Tensor cu = cu_seqlens.cpu(), si = state_indices.cpu();
    const int32_t* c = cu.data_ptr<int32_t>();
    const int32_t* s = si.data_ptr<int32_t>();
    TORCH_CHECK(c[0] == 0, "cu_seqlens[0] must be 0, got ", c[0]);
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(c[b + 1] >= c[b], "cu_seqlens must be non-decreasing, got cu_seqlens[", b, "] = ", c[b],
                  " > cu_seqlens[", b + 1, "] = ", c[b + 1]);
    TORCH_CHECK(c[batch] == T, "cu_seqlens[-1] must be T = ", T, " (every token in a sequence), got ", c[batch]);
    std::vector<int64_t> owner(n_slots, -1);
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(s[b] >= 0 && s[b] < n_slots, "state_indices[", b, "] = ", s[b], " is outside the state's ",
                  n_slots, " slots");
      TORCH_CHECK(owner[s[b]] < 0, "state_indices must be distinct: sequences ", owner[s[b]], " and ", b,
                  " both continue slot ", s[b]);
      owner[s[b]] = b;
    }
  }
  DeltaRuleParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.g = g.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  p.state = state.data_ptr<float>();
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  p.state_indices = state_indices.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.T = T;
  p.batch = batch;
  p.h_k = h_k;
  p.h_v = h_v;
  p.d_k = d_k;
  p.d_v = d_v;
  p.n_slots = n_slots;
  p.q_stride = T > 1 ? q.stride(0) : h_k * d_k;
  p.k_stride = T > 1 ? k.stride(0) : h_k * d_k;
  p.v_stride = T > 1 ? v.stride(0) : h_v * d_v;
  p.g_per_channel = per_channel;
  p.scale = static_cast<float>(scale);
  p.dtype = q.scalar_type() == at::kFloat ? DType::kFloat32 : DType::kBFloat16;
  return p;
}

}  // namespace delta_rule_checks
}  // namespace indexcache
