// A few rows through a weighted list of SwiGLU MLPs: a decode step's MoE (its routed experts and
// the shared one) or a dense MLP in one call, where each of the 3 x E projections and the
// activations cost more in dispatch than in arithmetic at one row. Torch-free.
//
//   out[m, :] = sum_e coef[e] * down_e( rnd(rnd(silu(rnd(x[m] gate_e^T))) * rnd(x[m] up_e^T)) )
//
// with every intermediate rounded (rnd) to x's dtype, as the module's ops round them, the
// projections summed in fp32 by rows_matmul_cpu (indexcache/rows_matmul.h), the down projection
// rounded to x's dtype, then widened, times coef[e] in fp32 and added to out in list order
// starting from zero. out is fp32.
#pragma once

#include <cstdint>

#include "indexcache/ops.h"

namespace indexcache {

struct SwigluExpert {
  const void* gate;     // [I, D] gate_dtype, rows gate_sr elements apart, last dim contiguous
  const void* up;       // [I, D] up_dtype, rows up_sr apart
  const void* down;     // [D, I] down_dtype, rows down_sr apart
  int64_t I;            // intermediate width
  int64_t gate_sr, up_sr, down_sr;
  DType gate_dtype, up_dtype, down_dtype;  // each fp32 or bf16
  float coef;           // the expert's weight in the sum
};

struct SwigluRowsParams {
  const void* x;              // [M, D] x_dtype (fp32 or bf16), rows x_sm elements apart
  float* out;                 // [M, D] fp32, rows o_sm apart
  const SwigluExpert* experts;  // [E]
  int64_t M, D, E;
  int64_t x_sm, o_sm;
  DType x_dtype;
};

void swiglu_rows_cpu(const SwigluRowsParams& p);

}  // namespace indexcache
