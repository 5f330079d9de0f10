// AMX tile set-up shared by the kernels that run on the tiles themselves (block_sparse_amx.h,
// sparse_mla_blas.cpp). Included inside the includer's namespace, under its AMX target pragma; no
// includes of its own (the includer has <immintrin.h> and <cstdint>).
#pragma once

// GCC's tile load / store intrinsics are asm statements that do not tell the compiler which
// memory they read or write: a compiler barrier on each side orders them with plain accesses.
inline void amx_barrier() { asm volatile("" ::: "memory"); }

// Tile configuration of palette 1 (Intel SDM, LDTILECFG): 8 tiles of 16 rows x 64 bytes.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure() {
  AmxTileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  amx_barrier();  // ldtilecfg's asm names only the first 8 bytes of c as read: keep the stores to the rest
  _tile_loadconfig(&c);
}

