// The blas path's AMX tile products of block_sparse_attention in bf16 (block_sparse_impl.h
// includes this file inside its namespace when IC_AMX is set, in block_sparse_amx.cpp, compiled
// for AMX-TILE + AMX-BF16; no includes: the includer has them). Every tile is 16 rows x 64 bytes
// (one configuration for the whole op): an fp32 accumulator tile is 16 query vectors x 16
// columns, a bf16 A tile 16 query vectors x 32 channels (or keys), a B tile 16 pairs x 16
// columns of bf16 pairs packed as 32-bit words (VNNI: the even channel / key in the low half).
//   S = Q·Kᵀ: A = the query vectors [16][d32] as they lie in q (copied, channels past d zero),
//       B = the key tile kt2 [d32/2][keys] of channel pairs (block_sparse_bf16.h's layout).
//   O = P·V: A = P_hi and P_lo [16][keys] (P split into two bf16 parts as on the avx512bf16
//       path, so P keeps ~2^-17 relative accuracy), B = the value tile vt2 [keys/2][dp].
// Determinism: an accumulator element reads one row of A and one column of B, in a fixed order,
// so a query vector's result never depends on the other vectors of its tile. The P·V tiles of a
// vector cover its first floor(nk / 32) * 32 keys (nk its visible keys), a count of its own; the
// rest of its keys are added alone by the avx512bf16 micro-kernel (panel_pv_bf16<1>). A tile of
// keys is never applied to a vector that does not see all 32 of them: the tile's vectors are
// sorted by that count, and a vector's accumulator rows are stored as soon as the next key tile
// passes its count (an inf or NaN value past a vector's position never reaches it).

#include "amx_tiles.h"

constexpr int64_t kAmxRows = 16;

// s[r][j] = Σ_c qa[r][c] · key j's channel c for r < 16, j < ncols (a multiple of 32): qa [16][d32]
// bf16 rows (channels past d zero), kt2 [d32/2][ldk] channel-pair words (rows past d/2 zero); s
// rows of stride lds.
inline void amx_scores(const uint16_t* qa, int64_t d32, const uint32_t* kt2, int64_t ldk, int64_t ncols, float* s,
                       int64_t lds) {
  amx_barrier();
  for (int64_t j = 0; j < ncols; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < d32; c += 32) {
      _tile_loadd(2, qa + c, d32 * 2);
      _tile_loadd(3, kt2 + c / 2 * ldk + j, ldk * 4);
      _tile_loadd(4, kt2 + c / 2 * ldk + j + 16, ldk * 4);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, s + j, lds * 4);
    _tile_stored(1, s + j + 16, lds * 4);
  }
  amx_barrier();
}

// ob[nat[r]][:dp] = Σ_{i < tk[r]} P[r][i] · V[i][:dp] for the tile's rows r < 16 with tk[r] > 0
// (tk multiples of 32, descending; rows with tk 0 are not written): ph / pl the P_hi / P_lo rows
// (stride ldp bf16), vt2 the value tile of key pairs (row stride dp, a multiple of 32); tmp
// scratch of 16 x 32 floats.
inline void amx_pv(const uint16_t* ph, const uint16_t* pl, int64_t ldp, const int64_t* tk, const int64_t* nat,
                   const uint32_t* vt2, int64_t dp, float* ob, float* tmp) {
  int64_t live0 = 0;
  while (live0 < kAmxRows && tk[live0] > 0) ++live0;
  if (live0 == 0) return;
  const int64_t nkt = tk[0] / 32;
  amx_barrier();
  for (int64_t c = 0; c < dp; c += 32) {
    int64_t live = live0;
    auto flush = [&](int64_t lo) {  // rows [lo, live) are done: out of the tiles into ob
      _tile_stored(0, tmp, 32 * 4);
      _tile_stored(1, tmp + 16, 32 * 4);
      amx_barrier();
      for (int64_t r = lo; r < live; ++r) std::memcpy(ob + nat[r] * dp + c, tmp + r * 32, 32 * sizeof(float));
      live = lo;
    };
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kt = 0; kt < nkt; ++kt) {
      int64_t n = live;
      while (n > 0 && tk[n - 1] <= kt * 32) --n;
      if (n < live) flush(n);
      const uint32_t* v = vt2 + kt * 16 * dp + c;
      _tile_loadd(2, ph + kt * 32, ldp * 2);
      _tile_loadd(3, pl + kt * 32, ldp * 2);
      _tile_loadd(4, v, dp * 4);
      _tile_loadd(5, v + 16, dp * 4);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 2, 5);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    flush(0);
  }
}
