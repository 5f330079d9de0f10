// Params structs and kernel entry points of the op library. Torch-free: raw pointers,
// shapes and strides only, so the CPU and CUDA implementations share one contract.
// Shape names (DESIGN.md §7): s_q query rows, s_kv keys, h heads, d head dim.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define INDEXCACHE_HD __host__ __device__
#else
#define INDEXCACHE_HD
#endif

namespace indexcache {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFp8E4M3 = 2 };

// Quantize groups of 128 values to e4m3 with power-of-two scales (DESIGN.md §4).
struct QuantParams {
  const void* x;      // [rows, d] x_dtype (fp32 or bf16), contiguous
  uint8_t* values;    // [rows, d] e4m3 out
  float* scales;      // [rows, d / 128] out
  int64_t rows;
  int64_t d;          // multiple of 128
  float eps;          // floor on the group amax
  bool hadamard;      // rotate each group by the orthonormal 128-point Hadamard first
  DType x_dtype;
};

// Quantize k and scatter it into the paged index-K cache (block: values, then scales).
struct IndexKInsertParams {
  const void* k;               // [n, d] k_dtype (fp32 or bf16)
  const int64_t* slot_mapping; // [n] cache slot per token, -1 = skip
  uint8_t* cache;              // [num_blocks, block_size * (d + 4)] in place
  int64_t n;
  int64_t d;
  int64_t block_size;
  int64_t num_blocks;
  bool hadamard;
  DType k_dtype;
};

// Head widths the dense indexer ops take (d even, 2..256): the DSA lightning indexer's 128 and the
// key-pooled (GLM-5.3-Flash) and QSA (Qwen3.8-Flash-Next) indexers' configurable widths. The CPU
// tile kernels run every such width; on CUDA the tiled kernels are 128-wide and the other widths
// run the plain kernel of csrc/cuda/indexer_any_impl.cuh.
constexpr int kMaxIndexerHeadDim = 256;

// Prefill indexer scoring over a contiguous key range per row.
struct IndexerParams {
  const void* q;         // [s_q, h, d] qk_dtype, d even in [2, kMaxIndexerHeadDim]
  const void* k;         // [s_kv, d] qk_dtype
  const float* k_scale;  // [s_kv] or nullptr (unquantized k)
  const float* weights;  // [s_q, h], softmax constants and q scales folded in
  const int32_t* ks;     // [s_q] first visible key
  const int32_t* ke;     // [s_q] one past the last visible key
  int64_t s_q;
  int64_t s_kv;
  int64_t h;
  int64_t d;
  DType qk_dtype;
};

// Decode indexer scoring straight from the paged index-K cache.
struct PagedIndexerParams {
  const uint8_t* q;            // [batch * next_n, h, d] e4m3, rows grouped by request
  const float* weights;        // [batch * next_n, h]
  const uint8_t* cache;        // [num_blocks, block_size * (d + 4)]
  const int32_t* block_table;  // [batch, max_blocks]
  const int32_t* seq_lens;     // [batch] tokens in the cache per request (drafts included)
  int64_t batch;
  int64_t next_n;
  int64_t h;
  int64_t d;
  int64_t block_size;
  int64_t max_blocks;
  int64_t num_blocks;
};

// Where logits go (plain scoring ops).
struct LogitsOut {
  float* logits;   // [rows, stride]; columns [0, cols) written, -inf outside the window
  int64_t stride;
  int64_t cols;
};

// Where top-k selections go (top-k and fused ops): the shared buffer of DESIGN.md §3.
struct TopkOut {
  int32_t* out;    // [rows, stride]; columns [0, width): positions ascending, then -1
  int64_t stride;
  int64_t width;
  int64_t topk;    // <= width
};

// Top-k of existing logits rows.
struct TopkParams {
  const float* logits;  // [rows, logits_stride]
  const int32_t* ks;    // [rows]
  const int32_t* ke;    // [rows]
  int64_t rows;
  int64_t logits_stride;
};

// Positions -> physical slots.
struct SlotParams {
  const int32_t* positions;    // [n, k] request-relative, -1 = none
  const int32_t* req_of_row;   // [n]
  const int32_t* block_table;  // [batch, max_blocks]
  int32_t* slots;              // [n, k] out
  int64_t n;
  int64_t k;
  int64_t batch;
  int64_t max_blocks;
  int64_t block_size;
  int64_t num_blocks;          // block ids must be < num_blocks
};

// Sparse MLA, absorbed form (DESIGN.md §5), and DeepSeek-V4's shared-KV attention (§6): one
// K=V head per cache row of d_qk values, the value the first d_v of them.
//   d_qk 576: DSA models (512 latent + 64 RoPE; value = the latent), any cache format.
//   d_qk 512: DeepSeek-V4 (RoPE on the last 64, applied; value = the whole row), bf16/fp32.
// The keys of row t are the valid entries of indices[t] followed by those of
// extra_indices[t] (V4: the selected compressed entries, then the sliding window of raw
// entries, both physical slots of the same cache); every listed valid entry counts once per
// listing, as duplicates in one list do.
struct SparseMlaParams {
  const void* q;             // [s_q, h_q, d_qk] q_dtype (fp32 or bf16)
  const void* kv;            // [num_slots, kv_row]: d_qk fp32/bf16 values, or 656 B fp8_ds_mla (d_qk 576)
  const int32_t* indices;    // [s_q, topk] physical slots, -1 = none
  void* out;                 // [s_q, h_q, d_v] q_dtype
  float* lse;                // [s_q, h_q] natural-log softmax denominators
  int64_t s_q;
  int64_t h_q;
  int64_t topk;
  int64_t num_slots;
  int64_t d_v;               // 512 (<= 512 and <= d_qk)
  float sm_scale;
  DType q_dtype;
  DType kv_dtype;            // kFp8E4M3 means the 656-byte fp8_ds_mla layout
  // [h_q] fp32 attention-sink logit per head, or nullptr (none). Joins each row's softmax
  // denominator with no value row; lse includes it; a NaN / +inf sink makes its head's out and
  // lse NaN on rows with a valid slot, -inf is no sink (docs/ops.md). The members from here on
  // have defaults, so initialisers written before they existed keep their meaning.
  const float* sinks = nullptr;
  const int32_t* extra_indices = nullptr;  // [s_q, n_extra] physical slots, -1 = none; or nullptr
  int64_t n_extra = 0;       // 0 when extra_indices is nullptr
  int64_t d_qk = 576;        // 576 or 512: the width of q and of a bf16/fp32 cache row
};

// Entry j of row t's key list, j in [0, topk + n_extra): indices, then extra_indices.
INDEXCACHE_HD inline int32_t mla_entry(const SparseMlaParams& p, int64_t t, int64_t j) {
  return j < p.topk ? p.indices[t * p.topk + j] : p.extra_indices[t * p.n_extra + (j - p.topk)];
}

// Finishes one (row, head) of sparse MLA from its softmax state over the valid keys: m the
// max score, l = Σ exp(s - m) (0: no valid key), bad: a score was NaN or ±inf. sink is the
// head's sink logit (-inf without sinks): m and l are extended by it (the max includes it).
// Returns lse and the factor of Σ exp(s - m) v, scale = num / den: NaN for a bad head, 0
// without a valid key (kernels that divide use (x * num) / den). Without a sink (-inf) the
// arithmetic is the sink-free one exactly: max(m, -inf) = m, exp(0) = 1 and exp(-inf) = 0, so
// num = 1, den = l, scale = 1 / l and lse = m + log(l) to the bit.
struct MlaFinish {
  float lse;
  float scale;
  float num;
  float den;
};
INDEXCACHE_HD inline MlaFinish mla_finish(float m, float l, bool bad, float sink) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (bad) return {nan, nan, nan, 1.f};
  if (!(l > 0.f)) return {sink, 0.f, 0.f, 1.f};  // no valid key: out 0, lse log(exp(sink)) (-inf without one)
  if (!(sink < std::numeric_limits<float>::infinity())) return {nan, nan, nan, 1.f};  // NaN or +inf sink
  const float mn = sink > m ? sink : m;
  const float a = expf(m - mn);
  const float ls = l * a + expf(sink - mn);
  return {mn + logf(ls), a / ls, a, ls};
}

// Head h's sink logit, -inf (no sink) when the op has none.
INDEXCACHE_HD inline float mla_sink(const SparseMlaParams& p, int64_t h) {
  return p.sinks != nullptr ? p.sinks[h] : -std::numeric_limits<float>::infinity();
}

// MLA KV cache insert: a row is [kv_c | k_pe]. DSA models: 512 + 64 = 576 (any format);
// DeepSeek-V4: 448 + 64 = 512, the K=V row with RoPE on its last 64 (bf16/fp32 caches).
struct MlaInsertParams {
  const void* kv_c;            // [n, d_latent] src_dtype
  const void* k_pe;            // [n, 64] src_dtype
  const int64_t* slot_mapping; // [n], -1 = skip
  void* cache;                 // [num_slots, d_latent + 64] cache_dtype, or [num_slots, 656] bytes (fp8)
  int64_t n;
  int64_t num_slots;
  DType src_dtype;
  DType cache_dtype;
  int64_t d_latent = 512;      // 512, or 448 (bf16/fp32 caches only)
};

void quantize_fp8_cpu(const QuantParams& p);
void index_k_insert_cpu(const IndexKInsertParams& p);
void indexer_logits_cpu(const IndexerParams& p, const LogitsOut& o);
void indexer_logits_paged_cpu(const PagedIndexerParams& p, const LogitsOut& o);
void topk_cpu(const TopkParams& p, const TopkOut& o);
void indexer_topk_cpu(const IndexerParams& p, const TopkOut& o);
void indexer_topk_paged_cpu(const PagedIndexerParams& p, const TopkOut& o);
void positions_to_slots_cpu(const SlotParams& p);
void sparse_mla_cpu(const SparseMlaParams& p);
void mla_insert_cpu(const MlaInsertParams& p);

// The CPU code path (portable, AVX-512 BF16, oneDNN brgemm) is chosen at run time: csrc/cpu/isa.h.

}  // namespace indexcache
