// MiniMax-M3's block-sparse CUDA launchers (csrc/cuda/block_sparse_impl.cuh) built for the CPU
// through cuda_emu.h, with a flat C interface for ctypes (test_emu_block_sparse.py). A library
// of its own (libicemu_block_sparse.so), so that it builds beside emu_ops.cpp's:
//   g++ -std=c++20 -O1 -shared -fPIC -include cuda_emu.h -I../../include -I../../cuda \
//       emu_block_sparse.cpp -o libicemu_block_sparse.so -lpthread
#include "block_sparse_impl.cuh"

#include "emu_harness.h"

using namespace indexcache;
using namespace indexcache::cuda;

extern "C" {

const char* emu_bs_last_error() { return g_error.c_str(); }
int32_t emu_bs_error_count() { return g_err_word; }
void emu_bs_reset_error_count() { g_err_word = 0; }
void emu_bs_set_device(int sms, int smem_optin) {
  g_sms = sms;
  g_smem_optin = smem_optin;
}

// Prefill: ks, ke non-null. Paged: ks == ke == nullptr, keys in k [num_pages, page_size, d].
int emu_block_topk(const void* q, const void* k, const int32_t* ks, const int32_t* ke, const int32_t* block_table,
                   const int32_t* seq_lens, int32_t* out, int64_t s_q, int64_t h, int64_t d, int64_t s_kv,
                   int64_t num_pages, int64_t page_size, int64_t batch, int64_t max_pages, int64_t next_n,
                   int64_t block_size, int64_t topk_blocks, int64_t local_blocks, int dtype) {
  return guarded([&] {
    Scratch s;
    BlockTopkParams p{};
    p.q = q;
    p.k = k;
    p.ks = ks;
    p.ke = ke;
    p.block_table = block_table;
    p.seq_lens = seq_lens;
    p.out = out;
    p.s_q = s_q;
    p.h = h;
    p.d = d;
    p.s_kv = s_kv;
    p.num_pages = num_pages;
    p.page_size = page_size;
    p.batch = batch;
    p.max_pages = max_pages;
    p.next_n = next_n;
    p.block_size = block_size;
    p.topk_blocks = topk_blocks;
    p.local_blocks = local_blocks;
    p.qk_dtype = static_cast<DType>(dtype);
    block_topk_cuda(p, env(s));
  });
}

int emu_block_sparse_attention(const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table,
                               const int32_t* req, const int32_t* pos, const int32_t* blocks, void* out, float* lse,
                               int64_t s_q, int64_t h_q, int64_t h_kv, int64_t d, int64_t topk, int64_t num_pages,
                               int64_t page_size, int64_t batch, int64_t max_pages, int64_t block_size, float scale,
                               int dtype) {
  return guarded([&] {
    Scratch s;
    BlockSparseAttnParams p{};
    p.q = q;
    p.k_cache = k_cache;
    p.v_cache = v_cache;
    p.block_table = block_table;
    p.req = req;
    p.pos = pos;
    p.blocks = blocks;
    p.out = out;
    p.lse = lse;
    p.s_q = s_q;
    p.h_q = h_q;
    p.h_kv = h_kv;
    p.d = d;
    p.topk = topk;
    p.num_pages = num_pages;
    p.page_size = page_size;
    p.batch = batch;
    p.max_pages = max_pages;
    p.block_size = block_size;
    p.scale = scale;
    p.dtype = static_cast<DType>(dtype);
    block_sparse_attention_cuda(p, env(s));
  });
}

}  // extern "C"
