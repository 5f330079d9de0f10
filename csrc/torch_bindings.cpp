// Every op schema of the library, in one TORCH_LIBRARY block. The kernels register per backend
// in csrc/cpu/registration.cpp and csrc/cuda/registration.cu; the pybind11 module (layer plan,
// CPU paths, build information) is csrc/python_module.cpp.
#include <torch/library.h>

TORCH_LIBRARY(indexcache, m) {
  // Shared top-k buffer (DESIGN.md §3): rows [:num_rows] := -1.
  m.def("fill_topk_buffer_(Tensor(a!) buf, int num_rows) -> ()");
  // fp8 e4m3 with one power-of-two scale per 128 values (DESIGN.md §4) -> (values, scales).
  m.def("quantize_fp8(Tensor x, float eps, bool hadamard) -> (Tensor, Tensor)");
  // Quantize k [n, 128] and write it into the paged index-K cache at slot_mapping.
  m.def("index_k_cache_insert(Tensor k, Tensor slot_mapping, Tensor(a!) cache, bool hadamard) -> ()");
  // Prefill indexer logits over per-row key windows [ks, ke) -> out [s_q, >= s_kv].
  m.def(
      "indexer_logits(Tensor q, Tensor k, Tensor? k_scale, Tensor weights, Tensor ks, Tensor ke, "
      "Tensor(a!) out) -> ()");
  // Decode indexer logits read from the paged index-K cache (next_n rows per request).
  m.def(
      "indexer_logits_paged(Tensor q, Tensor weights, Tensor cache, Tensor block_table, Tensor seq_lens, "
      "int next_n, Tensor(a!) out) -> ()");
  // Top-k of logits rows into the shared buffer as request-relative positions.
  m.def("topk_indices(Tensor logits, Tensor ks, Tensor ke, int topk, Tensor(a!) out) -> ()");
  // Fused scoring + top-k (prefill and paged decode); never materialises the logits.
  m.def(
      "indexer_topk(Tensor q, Tensor k, Tensor? k_scale, Tensor weights, Tensor ks, Tensor ke, int topk, "
      "Tensor(a!) out) -> ()");
  m.def(
      "indexer_topk_paged(Tensor q, Tensor weights, Tensor cache, Tensor block_table, Tensor seq_lens, "
      "int next_n, int topk, Tensor(a!) out) -> ()");
  // Request-relative positions -> physical cache slots, keeping -1.
  m.def(
      "positions_to_slots(Tensor positions, Tensor req_of_row, Tensor block_table, int block_size, "
      "int num_blocks, Tensor(a!) slots) -> ()");
  // MLA KV cache insert: rows [kv_c | k_pe] into bf16/fp32 [.., 576] (DSA) or [.., 512]
  // (DeepSeek-V4: kv_c 448 wide), or fp8_ds_mla uint8 [.., 656].
  m.def("mla_kv_cache_insert(Tensor kv_c, Tensor k_pe, Tensor slot_mapping, Tensor(a!) cache) -> ()");
  // Sparse MLA over selected slots -> out [s_q, h_q, d_v], lse [s_q, h_q]. q [s_q, h_q, d_qk]:
  // d_qk 576 (absorbed DSA) or 512 (DeepSeek-V4's shared K=V head, value = the whole row).
  // sinks: fp32 [h_q] attention-sink logits joining each row's softmax denominator (DESIGN.md
  // §5), or None. extra_indices: int32 [s_q, n_extra] more slots of the same cache (V4's
  // sliding window), attended together with indices, or None.
  m.def(
      "sparse_mla(Tensor q, Tensor kv_cache, Tensor indices, float sm_scale, int d_v, Tensor(a!) out, "
      "Tensor(a!) lse, Tensor? sinks=None, Tensor? extra_indices=None) -> ()");
  // The int32 [1] error word of like's CUDA device: counts the out-of-range index entries the
  // CUDA ops met and treated as invalid (no host check unless INDEXCACHE_CHECK=1). CUDA only.
  m.def("cuda_error_word(Tensor like) -> Tensor");
  // MiniMax-M3 indexer (DESIGN.md §6): block scoring + block top-k, prefill over per-row key
  // windows [ks, ke) and paged decode -> out int32 [s_q, h, topk_blocks] block ids, -1 pad.
  m.def(
      "block_topk(Tensor q, Tensor k, Tensor ks, Tensor ke, int block_size, int local_blocks, "
      "Tensor(a!) out) -> ()");
  m.def(
      "block_topk_paged(Tensor q, Tensor k_cache, Tensor block_table, Tensor seq_lens, int next_n, "
      "int block_size, int local_blocks, Tensor(a!) out) -> ()");
  // MiniMax-M3 block-sparse GQA attention over a paged KV cache -> out [s_q, h_q, d], lse [s_q, h_q].
  m.def(
      "block_sparse_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor req, "
      "Tensor pos, Tensor blocks, int block_size, float scale, Tensor(a!) out, Tensor(a!) lse) -> ()");
  // Gated delta rule of the hybrids' linear-attention layers (DESIGN.md §6: KDA's per-channel
  // gate g [T, h_v, d_k], Gated DeltaNet's per-head g [T, h_v]) over a varlen batch, continuing
  // and updating state [n_slots, h_v, d_k, d_v] in place -> out [T, h_v, d_v].
  m.def(
      "delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor cu_seqlens, "
      "Tensor state_indices, float scale, Tensor(b!) out) -> ()");
  // A few rows through a weight (decode projections; CPU only): out[g, m, n] = sum_k x[g, m, k] *
  // w[g, n, k] (w_nk, a linear layer's weight) or x[g, m, k] * w[g, k, n]; 2-D or 3-D (G first),
  // fp32 or bf16 each, last dims contiguous, summed in fp32.
  m.def("rows_matmul(Tensor x, Tensor w, bool w_nk, Tensor(a!) out) -> ()");
  // A few rows through a weighted list of SwiGLU MLPs (a decode step's one-row MoE or a dense MLP;
  // CPU only): out fp32 [M, D] = sum_e coef[e] * down_e(silu(x gate_e^T) * (x up_e^T)), x [M, D],
  // gate_w / up_w [I_e, D], down_w [D, I_e], every intermediate rounded to x's dtype.
  m.def(
      "swiglu_rows(Tensor x, Tensor[] gate_w, Tensor[] up_w, Tensor[] down_w, float[] coef, Tensor(a!) out) -> ()");
  // The same with the routing as tensors (a compiled or static decode step's MoE; CPU only): the
  // lists hold this rank's routed experts [first_expert, first_expert + E - num_shared) then
  // num_shared shared ones; row m sums its topk_ids [M, k] of this rank in ascending id, each times
  // topk_weights [M, k] (fp32 products), then the shared experts at 1.0.
  m.def(
      "moe_rows(Tensor x, Tensor[] gate_w, Tensor[] up_w, Tensor[] down_w, Tensor topk_ids, Tensor topk_weights, "
      "int first_expert, int num_experts, int num_shared, Tensor(a!) out) -> ()");
  // A decode step's small ops (CPU only), fp32 inside, one rounding to out's dtype: RMSNorm of rows
  // x [N, D] with weight w [D] -> out [N, D]; rotary embedding of x [N, H, R] by cos / sin fp32
  // [N, R / 2] (interleaved or split-half pairs) -> out [N, H, R], which may be x itself.
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved, Tensor(a!) out) -> ()");
  // GLM-5.3-Flash's pooled indexer: the key pools completing in a paged step, one call for the batch.
  // index_raw [num_blocks, block_size, 2 d] (each token's k | gate), index_pool [num_blocks,
  // block_size / P, d] written in place, ape [P, d], block_table / ctx_lens / q_lens int32 [B, ..] /
  // [B] / [B]: pool j of request b is the per-channel softmax_t(gate + ape)-weighted mean of its keys.
  m.def(
      "kpool_pool_paged(Tensor index_raw, Tensor(a!) index_pool, Tensor ape, Tensor block_table, Tensor ctx_lens, "
      "Tensor q_lens) -> ()");
}
