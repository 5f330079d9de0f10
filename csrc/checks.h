// Argument checks and params-struct builders shared by the CPU and CUDA op impls, so
// both devices reject exactly the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>

#include "indexcache/buffer.h"
#include "indexcache/fp8.h"
#include "indexcache/ops.h"

namespace indexcache {

#define IC_CHECK_DTYPE(t, dt, name) \
  TORCH_CHECK((t).scalar_type() == (dt), name " must be ", (dt), ", got ", (t).scalar_type())
#define IC_CHECK_DIM(t, n, name) \
  TORCH_CHECK((t).dim() == (n), name " must have ", (n), " dims, got shape ", (t).sizes())
#define IC_CHECK_CONTIG(t, name) \
  TORCH_CHECK((t).is_contiguous(), name " must be contiguous, got strides ", (t).strides())
#define IC_CHECK_SAME_DEVICE(a, b, na, nb)                                                    \
  TORCH_CHECK((a).device() == (b).device(), na " and " nb " must be on one device, got ", \
              (a).device(), " and ", (b).device())

// INDEXCACHE_CHECK=1 (any value but empty or "0"): the CUDA ops validate index inputs on a
// host copy with the CPU ops' messages (a device-to-host copy and a stream sync per call).
// Default: no host copy; the kernels treat out-of-range entries as invalid (-1, an empty
// window) and count them in the device's error word (indexcache.ops.cuda_error_count).
// Read on every call, so a process can switch it. The CPU ops always check on the host.
inline bool cuda_host_checks() {
  const char* v = std::getenv("INDEXCACHE_CHECK");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// Rows read with a unit column step: stride(1) == 1, or nothing that stride could address (no
// rows, or at most one column), whatever stride torch reports for such a view.
inline bool rows_contiguous(const at::Tensor& t) { return t.size(0) == 0 || t.size(1) <= 1 || t.stride(1) == 1; }

inline FillParams make_fill_params(at::Tensor& buf, int64_t num_rows) {
  IC_CHECK_DTYPE(buf, at::kInt, "topk buffer");
  IC_CHECK_DIM(buf, 2, "topk buffer");
  TORCH_CHECK(rows_contiguous(buf), "topk buffer rows must be contiguous, got strides ", buf.strides());
  TORCH_CHECK(num_rows >= 0, "num_rows must be >= 0, got ", num_rows);
  TORCH_CHECK(num_rows <= buf.size(0), "num_rows=", num_rows, " exceeds the topk buffer's ",
              buf.size(0), " rows (max_num_batched_tokens)");
  return FillParams{buf.data_ptr<int32_t>(), num_rows, buf.size(1), buf.stride(0)};
}

inline DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFp8E4M3;
    default: TORCH_CHECK(false, name, " has unsupported dtype ", t);
  }
}

inline void check_float_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// check_float_input's dtype as a DType: the operands of the kernels that take fp32 or bf16 in any
// mix (rows_matmul, norm_rope, kpool_pool), each checked under its own name.
inline DType float_dtype(const at::Tensor& t, const char* name) {
  check_float_input(t, name);
  return to_dtype(t.scalar_type(), name);
}

// A tensor whose last dim is contiguous (stride 1, or at most one element): the row kernels'
// operands (rows_matmul, swiglu_rows, norm_rope), any strides above it.
inline void check_unit_last(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, "'s last dim must be contiguous, got strides ",
              t.strides());
}

inline void check_slot_mapping(const at::Tensor& slot_mapping, int64_t n, const at::Tensor& like) {
  IC_CHECK_DTYPE(slot_mapping, at::kLong, "slot_mapping");
  IC_CHECK_DIM(slot_mapping, 1, "slot_mapping");
  IC_CHECK_CONTIG(slot_mapping, "slot_mapping");
  IC_CHECK_SAME_DEVICE(slot_mapping, like, "slot_mapping", "the cache");
  TORCH_CHECK(slot_mapping.size(0) == n, "slot_mapping has ", slot_mapping.size(0), " entries for ", n, " tokens");
}

template <typename T>
inline std::pair<int64_t, int64_t> min_max_of(const at::Tensor& t) {
  const T* v = t.data_ptr<T>();
  T mn = v[0], mx = v[0];
  for (int64_t i = 1, n = t.numel(); i < n; ++i) {
    mn = std::min(mn, v[i]);
    mx = std::max(mx, v[i]);
  }
  return {mn, mx};
}

// Every slot is -1 or inside [0, num_slots). On CUDA this reads the slots back to the host. int32 /
// int64 slots are scanned in place (a decode step calls this per layer and op: aten's min, max and
// two item() calls each were ~100 dispatched calls a step); other integer dtypes go through aten.
inline void check_slots_in_range(const at::Tensor& slots, int64_t num_slots, const char* name) {
  if (slots.numel() == 0) return;
  const at::Tensor host = (slots.device().is_cpu() ? slots : slots.cpu()).contiguous();
  std::pair<int64_t, int64_t> r;
  if (host.scalar_type() == at::kInt)
    r = min_max_of<int32_t>(host);
  else if (host.scalar_type() == at::kLong)
    r = min_max_of<int64_t>(host);
  else
    r = {host.min().item<int64_t>(), host.max().item<int64_t>()};
  TORCH_CHECK(r.first >= -1, name, " holds ", r.first, "; only -1 may mark a skipped token");
  TORCH_CHECK(r.second < num_slots, name, " holds slot ", r.second, " but the cache has ", num_slots, " slots");
}

inline std::tuple<at::Tensor, at::Tensor> make_quant_outputs(const at::Tensor& x) {
  auto values = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  auto scale_shape = x.sizes().vec();
  TORCH_CHECK(x.dim() >= 1, "x must have at least 1 dim");
  scale_shape.back() = x.size(-1) / kQuantGroup;
  auto scales = at::empty(scale_shape, x.options().dtype(at::kFloat));
  return {values, scales};
}

inline QuantParams make_quant_params(const at::Tensor& x, at::Tensor& values, at::Tensor& scales, double eps,
                                     bool hadamard) {
  check_float_input(x, "x");
  IC_CHECK_CONTIG(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kQuantGroup == 0, "x's last dim must be a multiple of ", kQuantGroup,
              ", got shape ", x.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "eps must be finite and > 0, got ", eps);
  const int64_t d = x.size(-1);
  return QuantParams{x.data_ptr(), static_cast<uint8_t*>(values.data_ptr()), scales.data_ptr<float>(),
                     d == 0 ? 0 : x.numel() / d, d, static_cast<float>(eps), hadamard,
                     to_dtype(x.scalar_type(), "x")};
}

inline void check_index_cache(const at::Tensor& cache, int64_t d) {
  IC_CHECK_DTYPE(cache, at::kByte, "index_k_cache");
  IC_CHECK_DIM(cache, 2, "index_k_cache");
  IC_CHECK_CONTIG(cache, "index_k_cache");
  TORCH_CHECK(cache.size(1) > 0 && cache.size(1) % (d + 4) == 0, "index_k_cache rows must hold block_size * ",
              d + 4, " bytes (", d, " e4m3 + one fp32 scale per token), got ", cache.size(1));
}

inline IndexKInsertParams make_index_k_insert_params(const at::Tensor& k, const at::Tensor& slot_mapping,
                                                     at::Tensor& cache, bool hadamard) {
  check_float_input(k, "k");
  IC_CHECK_DIM(k, 2, "k");
  IC_CHECK_CONTIG(k, "k");
  TORCH_CHECK(k.size(1) == kIndexHeadDim, "k must be [n, ", kIndexHeadDim, "], got ", k.sizes());
  check_index_cache(cache, k.size(1));
  IC_CHECK_SAME_DEVICE(k, cache, "k", "index_k_cache");
  check_slot_mapping(slot_mapping, k.size(0), cache);
  const int64_t block_size = cache.size(1) / (k.size(1) + 4);
  return IndexKInsertParams{k.data_ptr(), slot_mapping.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(), k.size(0),
                            k.size(1), block_size, cache.size(0), hadamard, to_dtype(k.scalar_type(), "k")};
}

inline MlaInsertParams make_mla_insert_params(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                              const at::Tensor& slot_mapping, at::Tensor& cache) {
  check_float_input(kv_c, "kv_c");
  TORCH_CHECK(k_pe.scalar_type() == kv_c.scalar_type(), "k_pe must have kv_c's dtype ", kv_c.scalar_type(),
              ", got ", k_pe.scalar_type());
  IC_CHECK_DIM(kv_c, 2, "kv_c");
  IC_CHECK_DIM(k_pe, 2, "k_pe");
  IC_CHECK_CONTIG(kv_c, "kv_c");
  IC_CHECK_CONTIG(k_pe, "k_pe");
  TORCH_CHECK(k_pe.size(1) == kMlaRope && k_pe.size(0) == kv_c.size(0), "k_pe must be [", kv_c.size(0), ", ",
              kMlaRope, "], got ", k_pe.sizes());
  IC_CHECK_CONTIG(cache, "mla_kv_cache");
  IC_CHECK_SAME_DEVICE(kv_c, cache, "kv_c", "mla_kv_cache");
  IC_CHECK_SAME_DEVICE(k_pe, cache, "k_pe", "mla_kv_cache");
  DType cache_dtype;
  if (cache.scalar_type() == at::kByte) {
    TORCH_CHECK(cache.size(-1) == kMlaFp8Bytes, "an fp8_ds_mla cache (uint8) must have rows of ", kMlaFp8Bytes,
                " bytes, got ", cache.sizes());
    TORCH_CHECK(kv_c.size(1) == kMlaLatent, "kv_c must be [n, ", kMlaLatent, "] for an fp8_ds_mla cache, got ",
                kv_c.sizes());
    cache_dtype = DType::kFp8E4M3;
  } else {
    check_float_input(cache, "mla_kv_cache");
    // DSA rows: 512 latent + 64 RoPE; DeepSeek-V4 rows: 448 + 64 (one K=V head of 512).
    TORCH_CHECK(cache.size(-1) == kMlaDim || cache.size(-1) == kMlaLatent,
                "a bf16/fp32 MLA cache must have rows of ", kMlaDim, " (DSA) or ", kMlaLatent,
                " (DeepSeek-V4) values, got ", cache.sizes());
    TORCH_CHECK(kv_c.size(1) + kMlaRope == cache.size(-1), "kv_c must be [n, ", cache.size(-1) - kMlaRope,
                "] for cache rows of ", cache.size(-1), " (kv_c + 64 RoPE values), got ", kv_c.sizes());
    cache_dtype = to_dtype(cache.scalar_type(), "mla_kv_cache");
  }
  check_slot_mapping(slot_mapping, kv_c.size(0), cache);
  return MlaInsertParams{kv_c.data_ptr(), k_pe.data_ptr(), slot_mapping.data_ptr<int64_t>(), cache.data_ptr(),
                         kv_c.size(0), cache.numel() / cache.size(-1), to_dtype(kv_c.scalar_type(), "kv_c"),
                         cache_dtype, kv_c.size(1)};
}

inline void check_block_table(const at::Tensor& block_table, const at::Tensor& like) {
  IC_CHECK_DTYPE(block_table, at::kInt, "block_table");
  IC_CHECK_DIM(block_table, 2, "block_table");
  IC_CHECK_CONTIG(block_table, "block_table");
  IC_CHECK_SAME_DEVICE(block_table, like, "block_table", "the first argument");
}

inline SlotParams make_slot_params(const at::Tensor& positions, const at::Tensor& req_of_row,
                                   const at::Tensor& block_table, int64_t block_size, int64_t num_blocks,
                                   at::Tensor& slots) {
  IC_CHECK_DTYPE(positions, at::kInt, "positions");
  IC_CHECK_DIM(positions, 2, "positions");
  IC_CHECK_CONTIG(positions, "positions");
  IC_CHECK_DTYPE(req_of_row, at::kInt, "req_of_row");
  IC_CHECK_DIM(req_of_row, 1, "req_of_row");
  IC_CHECK_CONTIG(req_of_row, "req_of_row");
  TORCH_CHECK(req_of_row.size(0) == positions.size(0), "req_of_row has ", req_of_row.size(0), " rows, positions ",
              positions.size(0));
  IC_CHECK_SAME_DEVICE(req_of_row, positions, "req_of_row", "positions");
  check_block_table(block_table, positions);
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TORCH_CHECK(num_blocks >= 1, "num_blocks must be >= 1, got ", num_blocks);
  IC_CHECK_DTYPE(slots, at::kInt, "slots");
  IC_CHECK_CONTIG(slots, "slots");
  TORCH_CHECK(slots.sizes() == positions.sizes(), "slots must have positions' shape ", positions.sizes(), ", got ",
              slots.sizes());
  IC_CHECK_SAME_DEVICE(slots, positions, "slots", "positions");
  return SlotParams{positions.data_ptr<int32_t>(), req_of_row.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
                    slots.data_ptr<int32_t>(), positions.size(0), positions.size(1), block_table.size(0),
                    block_table.size(1), block_size, num_blocks};
}

void check_positions_cpu(const SlotParams& p);

// Window bounds: 0 <= ks <= ke <= s_kv, int32 [rows] on the op's device.
// host_values = false (CUDA by default): shapes only, the values are checked on the device.
inline void check_windows(const at::Tensor& ks, const at::Tensor& ke, int64_t rows, int64_t s_kv,
                          const at::Tensor& like, bool host_values = true) {
  for (const auto* t : {&ks, &ke}) {
    const char* name = t == &ks ? "ks" : "ke";
    IC_CHECK_DTYPE(*t, at::kInt, "ks/ke");
    IC_CHECK_DIM(*t, 1, "ks/ke");
    IC_CHECK_CONTIG(*t, "ks/ke");
    IC_CHECK_SAME_DEVICE(*t, like, "ks/ke", "logits/q");
    TORCH_CHECK(t->size(0) == rows, name, " has ", t->size(0), " entries for ", rows, " rows");
  }
  if (rows == 0 || !host_values) return;
  const at::Tensor ks_h = ks.cpu(), ke_h = ke.cpu();
  const int32_t* a = ks_h.data_ptr<int32_t>();
  const int32_t* b = ke_h.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(a[r] >= 0 && a[r] <= b[r] && b[r] <= s_kv, "row ", r, " has window [ks, ke) = [", a[r], ", ", b[r],
                "), outside [0, ", s_kv, "] or reversed");
  }
}

inline IndexerParams make_indexer_params(const at::Tensor& q, const at::Tensor& k,
                                         const std::optional<at::Tensor>& k_scale, const at::Tensor& weights,
                                         const at::Tensor& ks, const at::Tensor& ke, bool host_values = true) {
  IC_CHECK_DIM(q, 3, "q");
  IC_CHECK_DIM(k, 2, "k");
  IC_CHECK_CONTIG(q, "q");
  IC_CHECK_CONTIG(k, "k");
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat8_e4m3fn || qt == at::kBFloat16 || qt == at::kFloat,
              "q must be float8_e4m3fn, bfloat16 or float32, got ", qt);
  TORCH_CHECK(k.scalar_type() == qt, "k must have q's dtype ", qt, ", got ", k.scalar_type());
  TORCH_CHECK(q.size(2) == k.size(1), "q [s_q, h, d] and k [s_kv, d] need one head width d, got ", q.sizes(),
              " and ", k.sizes());
  TORCH_CHECK(q.size(2) % 2 == 0 && q.size(2) >= 2 && q.size(2) <= kMaxIndexerHeadDim,
              "the indexer head width d must be even and in [2, ", kMaxIndexerHeadDim, "], got ", q.size(2));
  IC_CHECK_SAME_DEVICE(q, k, "q", "k");
  if (qt == at::kFloat8_e4m3fn) {
    TORCH_CHECK(k_scale.has_value(), "fp8 k needs k_scale [s_kv]");
  }
  const float* ksc = nullptr;
  if (k_scale.has_value()) {
    IC_CHECK_DTYPE(*k_scale, at::kFloat, "k_scale");
    IC_CHECK_CONTIG(*k_scale, "k_scale");
    IC_CHECK_SAME_DEVICE(*k_scale, q, "k_scale", "q");
    TORCH_CHECK(k_scale->dim() == 1 && k_scale->size(0) == k.size(0), "k_scale must be [", k.size(0), "], got ",
                k_scale->sizes());
    ksc = k_scale->data_ptr<float>();
  }
  IC_CHECK_DTYPE(weights, at::kFloat, "weights");
  IC_CHECK_CONTIG(weights, "weights");
  IC_CHECK_SAME_DEVICE(weights, q, "weights", "q");
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == q.size(0) && weights.size(1) == q.size(1),
              "weights must be [s_q, h] = [", q.size(0), ", ", q.size(1), "], got ", weights.sizes());
  check_windows(ks, ke, q.size(0), k.size(0), q, host_values);
  return IndexerParams{q.data_ptr(), k.data_ptr(), ksc, weights.data_ptr<float>(), ks.data_ptr<int32_t>(),
                       ke.data_ptr<int32_t>(), q.size(0), k.size(0), q.size(1), q.size(2),
                       to_dtype(qt, "q")};
}

inline PagedIndexerParams make_paged_params(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                                            int64_t next_n, bool host_values = true) {
  IC_CHECK_DTYPE(q, at::kFloat8_e4m3fn, "q");
  IC_CHECK_DIM(q, 3, "q");
  IC_CHECK_CONTIG(q, "q");
  TORCH_CHECK(q.size(2) == kIndexHeadDim, "q must be [rows, h, ", kIndexHeadDim, "], got ", q.sizes());
  check_index_cache(cache, q.size(2));
  IC_CHECK_SAME_DEVICE(q, cache, "q", "index_k_cache");
  check_block_table(block_table, q);
  IC_CHECK_DTYPE(seq_lens, at::kInt, "seq_lens");
  IC_CHECK_DIM(seq_lens, 1, "seq_lens");
  IC_CHECK_CONTIG(seq_lens, "seq_lens");
  IC_CHECK_SAME_DEVICE(seq_lens, q, "seq_lens", "q");
  TORCH_CHECK(next_n >= 1, "next_n must be >= 1, got ", next_n);
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(block_table.size(0) == batch, "block_table has ", block_table.size(0), " rows for ", batch,
              " requests");
  TORCH_CHECK(q.size(0) == batch * next_n, "q has ", q.size(0), " rows; expected batch * next_n = ", batch, " * ",
              next_n);
  IC_CHECK_DTYPE(weights, at::kFloat, "weights");
  IC_CHECK_CONTIG(weights, "weights");
  IC_CHECK_SAME_DEVICE(weights, q, "weights", "q");
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == q.size(0) && weights.size(1) == q.size(1),
              "weights must be [rows, h] = [", q.size(0), ", ", q.size(1), "], got ", weights.sizes());
  const int64_t d = q.size(2);
  const int64_t block_size = cache.size(1) / (d + 4);
  const int64_t num_blocks = cache.size(0);
  // Every block a request reads must be a real block of the cache.
  const int64_t max_blocks = block_table.size(1);
  const at::Tensor lens_h = host_values ? seq_lens.cpu() : at::Tensor();
  const at::Tensor table_h = host_values ? block_table.cpu() : at::Tensor();
  const int32_t* lens = host_values ? lens_h.data_ptr<int32_t>() : nullptr;
  const int32_t* table = host_values ? table_h.data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; host_values && b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0, "seq_lens[", b, "]=", lens[b], " is negative");
    const int64_t need = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(need <= max_blocks, "seq_lens[", b, "]=", lens[b], " needs ", need, " blocks but block_table has ",
                max_blocks, " columns");
    for (int64_t j = 0; j < need; ++j) {
      const int32_t id = table[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_table[", b, ", ", j, "]=", id, " is outside the cache's ",
                  num_blocks, " blocks");
    }
  }
  return PagedIndexerParams{static_cast<const uint8_t*>(q.data_ptr()), weights.data_ptr<float>(),
                            cache.data_ptr<uint8_t>(), block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                            batch, next_n, q.size(1), d, block_size, max_blocks, num_blocks};
}

inline LogitsOut make_logits_out(at::Tensor& out, int64_t rows, int64_t min_cols, const at::Tensor& like) {
  IC_CHECK_DTYPE(out, at::kFloat, "logits out");
  IC_CHECK_DIM(out, 2, "logits out");
  TORCH_CHECK(rows_contiguous(out), "logits out rows must be contiguous, got strides ", out.strides());
  IC_CHECK_SAME_DEVICE(out, like, "logits out", "q");
  TORCH_CHECK(out.size(0) == rows, "logits out has ", out.size(0), " rows, expected ", rows);
  TORCH_CHECK(out.size(1) >= min_cols, "logits out has ", out.size(1), " columns but the keys need ", min_cols);
  return LogitsOut{out.data_ptr<float>(), out.stride(0), out.size(1)};
}

// The shared top-k buffer: int32 [>= rows, width], width >= topk.
inline TopkOut make_topk_out(at::Tensor& out, int64_t rows, int64_t topk, const at::Tensor& like) {
  IC_CHECK_DTYPE(out, at::kInt, "topk buffer");
  IC_CHECK_DIM(out, 2, "topk buffer");
  TORCH_CHECK(rows_contiguous(out), "topk buffer rows must be contiguous, got strides ", out.strides());
  IC_CHECK_SAME_DEVICE(out, like, "topk buffer", "the inputs");
  TORCH_CHECK(topk >= 1, "topk must be >= 1, got ", topk);
  TORCH_CHECK(topk <= out.size(1), "topk=", topk, " exceeds the topk buffer's width ", out.size(1));
  TORCH_CHECK(rows <= out.size(0), rows, " tokens exceed the topk buffer's ", out.size(0),
              " rows (max_num_batched_tokens)");
  return TopkOut{out.data_ptr<int32_t>(), out.stride(0), out.size(1), topk};
}

// An int32 [s_q, k] slot list of sparse MLA (indices or extra_indices).
inline void check_mla_slot_list(const at::Tensor& idx, const at::Tensor& q, const char* name) {
  TORCH_CHECK(idx.scalar_type() == at::kInt, name, " must be Int, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == 2, name, " must have 2 dims, got shape ", idx.sizes());
  TORCH_CHECK(idx.is_contiguous(), name, " must be contiguous, got strides ", idx.strides());
  TORCH_CHECK(idx.device() == q.device(), name, " and q must be on one device, got ", idx.device(), " and ",
              q.device());
  TORCH_CHECK(idx.size(0) == q.size(0), name, " has ", idx.size(0), " rows for ", q.size(0), " queries");
}

inline SparseMlaParams make_sparse_mla_params(const at::Tensor& q, const at::Tensor& kv_cache,
                                              const at::Tensor& indices, double sm_scale, int64_t d_v,
                                              at::Tensor& out, at::Tensor& lse,
                                              const std::optional<at::Tensor>& sinks = std::nullopt,
                                              const std::optional<at::Tensor>& extra_indices = std::nullopt) {
  check_float_input(q, "q");
  IC_CHECK_DIM(q, 3, "q");
  IC_CHECK_CONTIG(q, "q");
  // 576: DSA (absorbed: 512 latent + 64 RoPE); 512: DeepSeek-V4's shared K=V head.
  TORCH_CHECK(q.size(2) == kMlaDim || q.size(2) == kMlaLatent, "q must be [s_q, h_q, ", kMlaDim,
              "] (absorbed DSA) or [s_q, h_q, ", kMlaLatent, "] (DeepSeek-V4), got ", q.sizes());
  const int64_t d_qk = q.size(2);
  IC_CHECK_CONTIG(kv_cache, "kv_cache");
  IC_CHECK_SAME_DEVICE(kv_cache, q, "kv_cache", "q");
  DType kv_dtype;
  if (kv_cache.scalar_type() == at::kByte) {
    TORCH_CHECK(kv_cache.size(-1) == kMlaFp8Bytes, "an fp8_ds_mla cache (uint8) must have rows of ", kMlaFp8Bytes,
                " bytes, got ", kv_cache.sizes());
    TORCH_CHECK(d_qk == kMlaDim, "an fp8_ds_mla cache holds 576-wide rows, but q has d_qk ", d_qk,
                " (DeepSeek-V4's 512-wide rows take a bf16 or fp32 cache)");
    kv_dtype = DType::kFp8E4M3;
  } else {
    check_float_input(kv_cache, "kv_cache");
    TORCH_CHECK(kv_cache.size(-1) == d_qk, "a bf16/fp32 MLA cache must have rows of d_qk = ", d_qk,
                " values (q's last dim), got ", kv_cache.sizes());
    kv_dtype = to_dtype(kv_cache.scalar_type(), "kv_cache");
  }
  check_mla_slot_list(indices, q, "indices");
  const int32_t* extra_ptr = nullptr;
  int64_t n_extra = 0;
  if (extra_indices.has_value()) {
    check_mla_slot_list(*extra_indices, q, "extra_indices");
    extra_ptr = extra_indices->data_ptr<int32_t>();
    n_extra = extra_indices->size(1);
  }
  TORCH_CHECK(d_v > 0 && d_v <= kMlaLatent && d_v % 64 == 0, "d_v must be a multiple of 64 in (0, ", kMlaLatent,
              "], got ", d_v);
  TORCH_CHECK(std::isfinite(sm_scale) && sm_scale > 0, "sm_scale must be a positive finite number, got ", sm_scale);
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must have q's dtype ", q.scalar_type(), ", got ",
              out.scalar_type());
  IC_CHECK_CONTIG(out, "out");
  IC_CHECK_SAME_DEVICE(out, q, "out", "q");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == d_v,
              "out must be [", q.size(0), ", ", q.size(1), ", ", d_v, "], got ", out.sizes());
  IC_CHECK_DTYPE(lse, at::kFloat, "lse");
  IC_CHECK_CONTIG(lse, "lse");
  IC_CHECK_SAME_DEVICE(lse, q, "lse", "q");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "lse must be [", q.size(0),
              ", ", q.size(1), "], got ", lse.sizes());
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    const at::Tensor& sk = *sinks;
    IC_CHECK_DTYPE(sk, at::kFloat, "sinks");
    IC_CHECK_DIM(sk, 1, "sinks");
    IC_CHECK_CONTIG(sk, "sinks");
    IC_CHECK_SAME_DEVICE(sk, q, "sinks", "q");
    TORCH_CHECK(sk.size(0) == q.size(1), "sinks must be [h_q] = [", q.size(1), "] (one logit per query head), got ",
                sk.sizes());
    sink_ptr = sk.data_ptr<float>();
  }
  return SparseMlaParams{q.data_ptr(), kv_cache.data_ptr(), indices.data_ptr<int32_t>(), out.data_ptr(),
                         lse.data_ptr<float>(), q.size(0), q.size(1), indices.size(1),
                         kv_cache.numel() / kv_cache.size(-1), d_v, static_cast<float>(sm_scale),
                         to_dtype(q.scalar_type(), "q"), kv_dtype, sink_ptr, extra_ptr, n_extra, d_qk};
}

inline TopkParams make_topk_params(const at::Tensor& logits, const at::Tensor& ks, const at::Tensor& ke,
                                   bool host_values = true) {
  IC_CHECK_DTYPE(logits, at::kFloat, "logits");
  IC_CHECK_DIM(logits, 2, "logits");
  TORCH_CHECK(rows_contiguous(logits), "logits rows must be contiguous, got strides ", logits.strides());
  check_windows(ks, ke, logits.size(0), logits.size(1), logits, host_values);
  return TopkParams{logits.data_ptr<float>(), ks.data_ptr<int32_t>(), ke.data_ptr<int32_t>(), logits.size(0),
                    logits.stride(0)};
}

}  // namespace indexcache
