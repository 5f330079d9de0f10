// A few rows through a weighted list of SwiGLU MLPs on CPU (indexcache/swiglu_rows.h): a decode
// step's one-row MoE (routed experts in ascending id, then the shared expert) or a dense MLP, one
// call instead of 3 x E projections and 3 x E element-wise ops, each of which costs more to
// dispatch than to compute at one row (docs/profiling.md). The projections are rows_matmul_cpu,
// so each takes the vectorised path isa.h picks for its weight's dtype; the activation and the
// weighted sum are short loops over I and D values.
//
// Rounding follows the module (models/blocks/moe.py, MLP.forward): gate and up projections
// rounded to x's dtype, silu(gate) rounded (torch's silu: g / (1 + exp(-g)) in fp32), times up
// rounded, the down projection rounded, then coef * that in fp32 added to the fp32 out. Experts
// run one after another on the calling thread; every projection splits its own work as
// rows_matmul does, so no result depends on the thread count.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../checks.h"
#include "elem_io.h"
#include "indexcache/rows_matmul.h"
#include "indexcache/swiglu_rows.h"
#include "registry.h"

namespace indexcache {
namespace {

using cpu::esize;
using cpu::load_f;
using cpu::store_f;

inline float round_to(float v, DType dt) { return dt == DType::kFloat32 ? v : static_cast<float>(c10::BFloat16(v)); }

// out [M, N] (dtype dt, rows N apart) = x [M, K] (rows x_sm apart) times w [N, K]^T.
void project(const void* x, int64_t x_sm, const void* w, int64_t w_sr, DType wd, void* out, int64_t M, int64_t N,
             int64_t K, DType dt) {
  RowsMatmulParams q{};
  q.x = x;
  q.w = w;
  q.out = out;
  q.G = 1;
  q.M = M;
  q.N = N;
  q.K = K;
  q.x_sm = x_sm;
  q.w_sr = w_sr;
  q.o_sm = N;
  q.w_nk = true;
  q.x_dtype = dt;
  q.w_dtype = wd;
  q.out_dtype = dt;
  rows_matmul_cpu(q);
}

// The experts of the weight lists, checked against x [M, D] (coef 0: the caller sets it).
std::vector<SwigluExpert> experts_of(const at::Tensor& x, at::TensorList gate_w, at::TensorList up_w,
                                     at::TensorList down_w) {
  const int64_t E = static_cast<int64_t>(gate_w.size());
  const int64_t D = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(up_w.size()) == E && static_cast<int64_t>(down_w.size()) == E,
              "gate_w, up_w and down_w need one entry per expert, got ", E, ", ", up_w.size(), " and ", down_w.size());
  std::vector<SwigluExpert> experts(E);
  for (int64_t e = 0; e < E; ++e) {
    const std::string n = std::to_string(e);
    const at::Tensor& g = gate_w[e];
    const at::Tensor& u = up_w[e];
    const at::Tensor& d = down_w[e];
    for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&g, "gate_w"}, {&u, "up_w"}, {&d, "down_w"}}) {
      TORCH_CHECK(t->dim() == 2, name, "[", n, "] must be 2-D, got shape ", t->sizes());
      IC_CHECK_SAME_DEVICE(x, *t, "x", "the expert weights");
      check_unit_last(*t, (std::string(name) + "[" + n + "]").c_str());
    }
    TORCH_CHECK(g.size(1) == D && u.sizes() == g.sizes(), "gate_w[", n, "] and up_w[", n, "] must be [I, ", D,
                "], got ", g.sizes(), " and ", u.sizes());
    TORCH_CHECK(d.size(0) == D && d.size(1) == g.size(0), "down_w[", n, "] must be [", D, ", ", g.size(0),
                "], got ", d.sizes());
    SwigluExpert& s = experts[e];
    s.gate_dtype = float_dtype(g, ("gate_w[" + n + "]").c_str());
    s.up_dtype = float_dtype(u, ("up_w[" + n + "]").c_str());
    s.down_dtype = float_dtype(d, ("down_w[" + n + "]").c_str());
    s.gate = g.data_ptr();
    s.up = u.data_ptr();
    s.down = d.data_ptr();
    s.I = g.size(0);
    s.gate_sr = g.stride(0);
    s.up_sr = u.stride(0);
    s.down_sr = d.stride(0);
    s.coef = 0.0f;
  }
  return experts;
}

void check_rows(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, D], got shape ", x.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == x.size(1), "out must be [", x.size(0),
              ", ", x.size(1), "] like x, got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out must be float32 (the fp32 sum), got ", out.scalar_type());
  TORCH_CHECK(!out.is_alias_of(x), "out must not share memory with x");
  check_unit_last(x, "x");
  check_unit_last(out, "out");
  IC_CHECK_SAME_DEVICE(x, out, "x", "out");
}

SwigluRowsParams rows_params(const at::Tensor& x, at::Tensor& out) {
  SwigluRowsParams p{};
  p.x_dtype = float_dtype(x, "x");
  p.M = x.size(0);
  p.D = x.size(1);
  p.x = x.data_ptr();
  p.out = out.data_ptr<float>();
  p.x_sm = x.stride(0);
  p.o_sm = out.stride(0);
  return p;
}

void swiglu_rows_op(const at::Tensor& x, at::TensorList gate_w, at::TensorList up_w, at::TensorList down_w,
                    at::ArrayRef<double> coef, at::Tensor& out) {
  check_rows(x, out);
  std::vector<SwigluExpert> experts = experts_of(x, gate_w, up_w, down_w);
  TORCH_CHECK(coef.size() == experts.size(), "gate_w, up_w, down_w and coef need one entry per expert, got ",
              experts.size(), " and ", coef.size(), " coefs");
  for (size_t e = 0; e < experts.size(); ++e) experts[e].coef = static_cast<float>(coef[e]);
  SwigluRowsParams p = rows_params(x, out);
  p.E = static_cast<int64_t>(experts.size());
  p.experts = experts.data();
  swiglu_rows_cpu(p);
}

// A few rows' MoE with the routing as tensors (no host reads before the call: a compiled or
// static decode step): row m sums its chosen experts of this rank in ascending id, each times its
// routing weight, then the shared experts at 1.0 -- the experts and order of the eager one-row
// path (models/blocks/moe.py, MoE._one_row_fused) -- by swiglu_rows_cpu, one row at a time.
void moe_rows_op(const at::Tensor& x, at::TensorList gate_w, at::TensorList up_w, at::TensorList down_w,
                 const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t first_expert, int64_t num_experts,
                 int64_t num_shared, at::Tensor& out) {
  check_rows(x, out);
  std::vector<SwigluExpert> all = experts_of(x, gate_w, up_w, down_w);
  const int64_t E = static_cast<int64_t>(all.size());
  TORCH_CHECK(num_shared >= 0 && num_shared <= E, "num_shared must lie in [0, ", E, "] (the experts given), got ",
              num_shared);
  const int64_t local = E - num_shared;
  TORCH_CHECK(first_expert >= 0 && first_expert + local <= num_experts, "this rank's experts [", first_expert, ", ",
              first_expert + local, ") must lie in [0, num_experts ", num_experts, ")");
  const int64_t M = x.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == M, "topk_ids must be [", M, ", k], got shape ",
              topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be ", topk_ids.sizes(),
              " like topk_ids, got ", topk_weights.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt,
              "topk_ids must be int64 or int32, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat || topk_weights.scalar_type() == at::kBFloat16,
              "topk_weights must be float32 or bfloat16, got ", topk_weights.scalar_type());
  IC_CHECK_SAME_DEVICE(x, topk_ids, "x", "topk_ids");
  IC_CHECK_SAME_DEVICE(x, topk_weights, "x", "topk_weights");
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor w = topk_weights.to(at::kFloat).contiguous();
  const int64_t k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = w.data_ptr<float>();
  for (int64_t i = 0; i < M * k; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "topk_ids holds expert ", id[i], " outside [0, num_experts ",
                num_experts, ")");
  const int64_t es = x.element_size();
  std::vector<std::pair<int64_t, int64_t>> chosen;  // (expert id, column)
  std::vector<SwigluExpert> row;
  for (int64_t m = 0; m < M; ++m) {
    chosen.clear();
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = id[m * k + j];
      if (e >= first_expert && e < first_expert + local) chosen.emplace_back(e, j);
    }
    std::sort(chosen.begin(), chosen.end());
    row.clear();
    for (const auto& [e, j] : chosen) {
      row.push_back(all[e - first_expert]);
      row.back().coef = wt[m * k + j];
    }
    for (int64_t s = local; s < E; ++s) {
      row.push_back(all[s]);
      row.back().coef = 1.0f;
    }
    SwigluRowsParams p = rows_params(x, out);
    p.M = 1;
    p.x = static_cast<const char*>(x.data_ptr()) + m * x.stride(0) * es;
    p.out = out.data_ptr<float>() + m * out.stride(0);
    p.E = static_cast<int64_t>(row.size());
    p.experts = row.data();
    swiglu_rows_cpu(p);
  }
}

}  // namespace

void register_swiglu_rows_cpu(torch::Library& m) {
  m.impl("swiglu_rows", &swiglu_rows_op);
  m.impl("moe_rows", &moe_rows_op);
}

void swiglu_rows_cpu(const SwigluRowsParams& p) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.D; ++n) p.out[m * p.o_sm + n] = 0.0f;
  const DType dt = p.x_dtype;
  const int64_t es = esize(dt);
  thread_local std::vector<char> buf;
  for (int64_t e = 0; e < p.E; ++e) {
    const SwigluExpert& s = p.experts[e];
    const int64_t inter = p.M * s.I * es;
    buf.resize(3 * inter + p.M * p.D * es);
    char* g = buf.data();
    char* u = g + inter;
    char* a = u + inter;
    char* d = a + inter;
    project(p.x, p.x_sm, s.gate, s.gate_sr, s.gate_dtype, g, p.M, s.I, p.D, dt);
    project(p.x, p.x_sm, s.up, s.up_sr, s.up_dtype, u, p.M, s.I, p.D, dt);
    for (int64_t i = 0; i < p.M * s.I; ++i) {
      const float gv = load_f(g, i, dt);
      store_f(a, i, round_to(gv / (1.0f + std::exp(-gv)), dt) * load_f(u, i, dt), dt);
    }
    project(a, s.I, s.down, s.down_sr, s.down_dtype, d, p.M, p.D, s.I, dt);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.D; ++n) p.out[m * p.o_sm + n] += s.coef * load_f(d, m * p.D + n, dt);
  }
}

}  // namespace indexcache
