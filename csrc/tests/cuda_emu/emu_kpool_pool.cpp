// The kpool_pool_paged CUDA launcher (csrc/cuda/kpool_pool_impl.cuh) built for the CPU through
// cuda_emu.h, with a flat C interface for ctypes (test_emu_kpool_pool.py). A library of its own
// (libicemu_kpool_pool.so), built beside the others by emu_build.py:
//   g++ -std=c++20 -O1 -shared -fPIC -include cuda_emu.h -I../../include -I../../cuda \
//       emu_kpool_pool.cpp -o libicemu_kpool_pool.so -lpthread
#include "kpool_pool_impl.cuh"

#include "emu_harness.h"

using namespace indexcache;
using namespace indexcache::cuda;

extern "C" {

const char* emu_kp_last_error() { return g_error.c_str(); }
int32_t emu_kp_error_count() { return g_err_word; }
void emu_kp_reset_error_count() { g_err_word = 0; }

int emu_kpool_pool(const void* raw, void* pool, const void* ape, const int32_t* block_table, const int32_t* ctx_lens,
                   const int32_t* q_lens, int64_t B, int64_t max_blocks, int64_t num_blocks, int64_t block_size,
                   int64_t P, int64_t d, int raw_dtype, int pool_dtype, int ape_dtype) {
  return guarded([&] {
    Scratch s;
    KpoolPoolParams p{};
    p.raw = raw;
    p.pool = pool;
    p.ape = ape;
    p.block_table = block_table;
    p.ctx_lens = ctx_lens;
    p.q_lens = q_lens;
    p.B = B;
    p.max_blocks = max_blocks;
    p.num_blocks = num_blocks;
    p.block_size = block_size;
    p.P = P;
    p.d = d;
    p.raw_dtype = static_cast<DType>(raw_dtype);
    p.pool_dtype = static_cast<DType>(pool_dtype);
    p.ape_dtype = static_cast<DType>(ape_dtype);
    kpool_pool_cuda(p, env(s));
  });
}

}  // extern "C"
