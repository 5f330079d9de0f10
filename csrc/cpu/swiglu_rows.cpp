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

void swiglu_rows_op(const at::Tensor& x, at::TensorList gate_w, at::TensorList up_w, at::TensorList down_w,
                    at::ArrayRef<double> coef, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, D], got shape ", x.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == x.size(1), "out must be [", x.size(0),
              ", ", x.size(1), "] like x, got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out must be float32 (the fp32 sum), got ", out.scalar_type());
  const int64_t E = static_cast<int64_t>(gate_w.size());
  TORCH_CHECK(static_cast<int64_t>(up_w.size()) == E && static_cast<int64_t>(down_w.size()) == E &&
                  static_cast<int64_t>(coef.size()) == E,
              "gate_w, up_w, down_w and coef need one entry per expert, got ", E, ", ", up_w.size(), ", ",
              down_w.size(), " and ", coef.size());
  TORCH_CHECK(!out.is_alias_of(x), "out must not share memory with x");
  SwigluRowsParams p{};
  p.x_dtype = float_dtype(x, "x");
  p.M = x.size(0);
  p.D = x.size(1);
  p.E = E;
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
    TORCH_CHECK(g.size(1) == p.D && u.sizes() == g.sizes(), "gate_w[", n, "] and up_w[", n, "] must be [I, ", p.D,
                "], got ", g.sizes(), " and ", u.sizes());
    TORCH_CHECK(d.size(0) == p.D && d.size(1) == g.size(0), "down_w[", n, "] must be [", p.D, ", ", g.size(0),
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
    s.coef = static_cast<float>(coef[e]);
  }
  check_unit_last(x, "x");
  check_unit_last(out, "out");
  IC_CHECK_SAME_DEVICE(x, out, "x", "out");
  p.x = x.data_ptr();
  p.out = out.data_ptr<float>();
  p.experts = experts.data();
  p.x_sm = x.stride(0);
  p.o_sm = out.stride(0);
  swiglu_rows_cpu(p);
}

}  // namespace

void register_swiglu_rows_cpu(torch::Library& m) { m.impl("swiglu_rows", &swiglu_rows_op); }

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
