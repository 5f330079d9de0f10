// Argument checks and params-struct builders of MiniMax-M3's block-sparse ops, shared by the
// CPU op impls (csrc/cpu/block_sparse.cpp) and the CUDA ones (csrc/cuda/block_sparse.cu), so
// both devices reject exactly the same inputs with the same messages (as checks.h does for
// the other ops).
//
// host_values: also check the index *values* (key windows, seq_lens, block-table pages, req,
// pos, block ids) by reading them on the host. The CPU always does; CUDA only with
// INDEXCACHE_CHECK=1 (a copy and a sync per call). Otherwise the CUDA kernels treat an
// out-of-range value as invalid (an empty window / a row with no key / a -1 block id) and
// count it in the device's error word.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

#include "checks.h"
#include "indexcache/block_sparse.h"

namespace indexcache {
namespace block_sparse_checks {

inline void check_int_vec(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-d tensor, got shape ", t.sizes(),
              " strides ", t.strides());
  TORCH_CHECK(t.size(0) == n, name, " must have ", n, " entries, got ", t.size(0));
}

inline void check_out_blocks(const at::Tensor& out, const at::Tensor& q) {
  IC_CHECK_DTYPE(out, at::kInt, "out");
  IC_CHECK_DIM(out, 3, "out");
  IC_CHECK_CONTIG(out, "out");
  IC_CHECK_SAME_DEVICE(q, out, "q", "out");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1), "out must be [s_q, h, topk_blocks] = [",
              q.size(0), ", ", q.size(1), ", topk_blocks], got ", out.sizes());
}

inline void check_block_args(int64_t block_size, int64_t local_blocks) {
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TORCH_CHECK(local_blocks >= 0, "local_blocks must be >= 0, got ", local_blocks);
}

// Every page of the first `used` positions of request b must be a page of the cache.
inline void check_pages(const int32_t* bt, int64_t b, int64_t max_pages, int64_t page_size, int64_t used,
                        int64_t num_pages) {
  const int64_t np = (used + page_size - 1) / page_size;
  for (int64_t j = 0; j < np; ++j) {
    const int64_t pg = bt[b * max_pages + j];
    TORCH_CHECK(pg >= 0 && pg < num_pages, "block_table[", b, ", ", j, "] = ", pg, " is outside the cache's ",
                num_pages, " pages");
  }
}

// A host copy of t when it lives on a device (int32 tensors only).
inline at::Tensor on_host(const at::Tensor& t) { return t.device().is_cpu() ? t : t.cpu(); }

inline BlockTopkParams make_block_topk_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ks,
                                              const at::Tensor& ke, int64_t block_size, int64_t local_blocks,
                                              at::Tensor& out, bool host_values) {
  check_float_input(q, "q");
  IC_CHECK_DTYPE(k, q.scalar_type(), "k");
  IC_CHECK_DIM(q, 3, "q");
  IC_CHECK_DIM(k, 2, "k");
  IC_CHECK_CONTIG(q, "q");
  IC_CHECK_CONTIG(k, "k");
  TORCH_CHECK(k.size(1) == q.size(2), "k must be [s_kv, d] with q's d = ", q.size(2), ", got ", k.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &ks, &ke, &out})
    IC_CHECK_SAME_DEVICE(q, (*t), "q", "every argument");
  check_int_vec(ks, q.size(0), "ks");
  check_int_vec(ke, q.size(0), "ke");
  check_out_blocks(out, q);
  check_block_args(block_size, local_blocks);
  if (host_values) {
    const at::Tensor hs = on_host(ks), he = on_host(ke);
    const int32_t* kss = hs.data_ptr<int32_t>();
    const int32_t* kee = he.data_ptr<int32_t>();
    for (int64_t t = 0; t < q.size(0); ++t)
      TORCH_CHECK(kss[t] >= 0 && kee[t] <= k.size(0), "key window [", kss[t], ", ", kee[t], ") of row ", t,
                  " is outside the ", k.size(0), " keys");
  }
  BlockTopkParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.ks = ks.data_ptr<int32_t>();
  p.ke = ke.data_ptr<int32_t>();
  p.out = out.data_ptr<int32_t>();
  p.s_q = q.size(0);
  p.h = q.size(1);
  p.d = q.size(2);
  p.s_kv = k.size(0);
  p.block_size = block_size;
  p.topk_blocks = out.size(2);
  p.local_blocks = local_blocks;
  p.qk_dtype = to_dtype(q.scalar_type(), "q");
  return p;
}

inline BlockTopkParams make_block_topk_paged_params(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                    int64_t next_n, int64_t block_size, int64_t local_blocks,
                                                    at::Tensor& out, bool host_values) {
  check_float_input(q, "q");
  IC_CHECK_DTYPE(k_cache, q.scalar_type(), "k_cache");
  IC_CHECK_DIM(q, 3, "q");
  IC_CHECK_DIM(k_cache, 3, "k_cache");
  IC_CHECK_CONTIG(q, "q");
  IC_CHECK_CONTIG(k_cache, "k_cache");
  TORCH_CHECK(k_cache.size(2) == q.size(2), "k_cache must be [num_pages, page_size, d] with q's d = ", q.size(2),
              ", got ", k_cache.sizes());
  IC_CHECK_DTYPE(block_table, at::kInt, "block_table");
  IC_CHECK_DIM(block_table, 2, "block_table");
  IC_CHECK_CONTIG(block_table, "block_table");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &block_table, &seq_lens, &out})
    IC_CHECK_SAME_DEVICE(q, (*t), "q", "every argument");
  TORCH_CHECK(next_n >= 1, "next_n must be >= 1, got ", next_n);
  const int64_t batch = block_table.size(0);
  check_int_vec(seq_lens, batch, "seq_lens");
  TORCH_CHECK(q.size(0) == batch * next_n, "q must have batch * next_n = ", batch * next_n, " rows, got ",
              q.size(0));
  check_out_blocks(out, q);
  check_block_args(block_size, local_blocks);
  const int64_t page = k_cache.size(1), cap = block_table.size(1) * page;
  if (host_values) {
    const at::Tensor hl = on_host(seq_lens), ht = on_host(block_table);
    const int32_t* sl = hl.data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(sl[b] >= 0 && sl[b] <= cap, "seq_lens[", b, "] = ", sl[b], " is outside [0, ", cap,
                  "] (max_pages * page_size)");
      check_pages(ht.data_ptr<int32_t>(), b, block_table.size(1), page, sl[b], k_cache.size(0));
    }
  }
  BlockTopkParams p{};
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr<int32_t>();
  p.s_q = q.size(0);
  p.h = q.size(1);
  p.d = q.size(2);
  p.num_pages = k_cache.size(0);
  p.page_size = page;
  p.batch = batch;
  p.max_pages = block_table.size(1);
  p.next_n = next_n;
  p.block_size = block_size;
  p.topk_blocks = out.size(2);
  p.local_blocks = local_blocks;
  p.qk_dtype = to_dtype(q.scalar_type(), "q");
  return p;
}

inline void check_attention_tensors(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& block_table, const at::Tensor& req, const at::Tensor& pos,
                                    const at::Tensor& blocks, const at::Tensor& out, const at::Tensor& lse) {
  check_float_input(q, "q");
  IC_CHECK_DIM(q, 3, "q");
  IC_CHECK_CONTIG(q, "q");
  for (const auto& [t, name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " must have q's dtype ", q.scalar_type(), ", got ",
                t->scalar_type());
    TORCH_CHECK(t->dim() == 4, name, " must be [num_pages, page_size, h_kv, d], got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous, got strides ", t->strides());
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  const int64_t s_q = q.size(0), h_q = q.size(1), d = q.size(2), h_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "k_cache's head dim must be q's ", d, ", got ", k_cache.size(3));
  TORCH_CHECK(h_kv >= 1 && h_q % h_kv == 0, "q's ", h_q, " heads must be a multiple of the cache's ", h_kv,
              " KV heads");
  IC_CHECK_DTYPE(block_table, at::kInt, "block_table");
  IC_CHECK_DIM(block_table, 2, "block_table");
  IC_CHECK_CONTIG(block_table, "block_table");
  check_int_vec(req, s_q, "req");
  check_int_vec(pos, s_q, "pos");
  IC_CHECK_DTYPE(blocks, at::kInt, "blocks");
  IC_CHECK_DIM(blocks, 3, "blocks");
  IC_CHECK_CONTIG(blocks, "blocks");
  TORCH_CHECK(blocks.size(0) == s_q && blocks.size(1) == h_kv, "blocks must be [s_q, h_kv, topk] = [", s_q, ", ",
              h_kv, ", topk], got ", blocks.sizes());
  IC_CHECK_DTYPE(out, q.scalar_type(), "out");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be contiguous with q's shape ", q.sizes(),
              ", got ", out.sizes(), " strides ", out.strides());
  IC_CHECK_DTYPE(lse, at::kFloat, "lse");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == s_q && lse.size(1) == h_q && lse.is_contiguous(),
              "lse must be contiguous [s_q, h_q] = [", s_q, ", ", h_q, "], got ", lse.sizes());
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &block_table, &req, &pos, &blocks, &out, &lse})
    IC_CHECK_SAME_DEVICE(q, (*t), "q", "every argument");
}

inline BlockSparseAttnParams make_block_sparse_attn_params(const at::Tensor& q, const at::Tensor& k_cache,
                                                           const at::Tensor& v_cache, const at::Tensor& block_table,
                                                           const at::Tensor& req, const at::Tensor& pos,
                                                           const at::Tensor& blocks, int64_t block_size, double scale,
                                                           at::Tensor& out, at::Tensor& lse, bool host_values) {
  check_attention_tensors(q, k_cache, v_cache, block_table, req, pos, blocks, out, lse);
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TORCH_CHECK(std::isfinite(static_cast<float>(scale)) && static_cast<float>(scale) > 0,
              "scale must be finite and > 0 (as a float), got ", scale);
  const int64_t s_q = q.size(0), batch = block_table.size(0), page = k_cache.size(1),
                cap = block_table.size(1) * page;
  if (host_values) {
    const at::Tensor hr = on_host(req), hp = on_host(pos), hb = on_host(blocks), ht = on_host(block_table);
    const int32_t* rq = hr.data_ptr<int32_t>();
    const int32_t* ps = hp.data_ptr<int32_t>();
    const int32_t* bl = hb.data_ptr<int32_t>();
    for (int64_t t = 0; t < s_q; ++t) {
      TORCH_CHECK(rq[t] >= 0 && rq[t] < batch, "req[", t, "] = ", rq[t], " is outside the ", batch, " requests");
      TORCH_CHECK(ps[t] >= 0 && ps[t] < cap, "pos[", t, "] = ", ps[t], " is outside [0, ", cap,
                  ") (max_pages * page_size)");
      check_pages(ht.data_ptr<int32_t>(), rq[t], block_table.size(1), page, ps[t] + 1, k_cache.size(0));
    }
    for (int64_t i = 0; i < hb.numel(); ++i)
      TORCH_CHECK(bl[i] >= -1, "blocks holds ", bl[i], " (only block ids >= 0 and -1 for none are allowed)");
  }
  BlockSparseAttnParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.req = req.data_ptr<int32_t>();
  p.pos = pos.data_ptr<int32_t>();
  p.blocks = blocks.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.s_q = s_q;
  p.h_q = q.size(1);
  p.h_kv = k_cache.size(2);
  p.d = q.size(2);
  p.topk = blocks.size(2);
  p.num_pages = k_cache.size(0);
  p.page_size = page;
  p.batch = batch;
  p.max_pages = block_table.size(1);
  p.block_size = block_size;
  p.scale = static_cast<float>(scale);
  p.dtype = to_dtype(q.scalar_type(), "q");
  return p;
}

}  // namespace block_sparse_checks
}  // namespace indexcache
