// The tied LM head on AMX tiles, y = x @ w^T with w [N, K] the embedding table as stored: what its full walk
// (amx.cc: MatmulTransposed, MatmulTransposedArgmax) and the screened greedy head (head_screen.cc) share. Both
// must give each (row of x, row of w) the same float32 sum, so they share these tile steps.
//
// Rows of w are 32 consecutive k apiece per tile row, so w's tiles are A operands loaded in place (no packing
// and no copy of the 150k-row table): a C tile is y^T for 16 rows of w x 16 rows of x, and x, transposed into
// VNNI pairs, is the small B operand. Tiles: A 4-5 (32 rows of w), B 6-7 (32 rows of x), C 0-3 (2 x 2).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "parallel.h"

#if defined(PAGED_AMX)

namespace paged::amx::head {

inline constexpr int64_t kRows = 32;   // x rows per block: two tiles
inline constexpr int64_t kDepth = 32;  // k per bfloat16 tile step

// x rows [m0, m0 + 32) (past M: zeros) as B tiles: xb [K / 32][2 groups][16 pairs][16 rows][2].
inline void pack_rows_as_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t m0, uint16_t* xb) {
  for (int64_t s = 0; s < K / kDepth; ++s)
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t pair = 0; pair < 16; ++pair)
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t m = m0 + 16 * g + r;
          const int64_t k = s * kDepth + 2 * pair;
          uint16_t* out = xb + ((s * 2 + g) * 16 + pair) * 32 + 2 * r;
          out[0] = m < M ? x[m * K + k] : 0;
          out[1] = m < M ? x[m * K + k + 1] : 0;
        }
}

// The sums of 32 rows of w (row stride K) against the x block packed in xb, into block [tile][row of w][row
// of x] (tile 2 * (w row / 16) + x row / 16); rows of w past the table's end may be any readable memory.
using TransposedBlock = float[4][16][16];
inline void transposed_block(const uint16_t* w_rows, const uint16_t* xb, int64_t K, int64_t rows_m,
                             const char* ahead, int64_t ahead_bytes, TransposedBlock& block) {
  const int64_t steps = K / kDepth, stride = K * sizeof(uint16_t);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // The next 32 rows of w, a step's share at a time, so their tiles load from cache. Into L2 rather than L1:
  // L2 keeps more misses in flight than L1's fill buffers (the 151,936 x 896 table from memory, 32 rows of x:
  // 13.7 -> 11.8 ms; 1 row 12.6 -> 11.3, 64 rows 19.7 -> 15.3).
  const int64_t lines = ahead_bytes / 64, per_step = (lines + steps - 1) / steps;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t i = s * per_step; i < std::min(lines, (s + 1) * per_step); ++i)
      _mm_prefetch(ahead + 64 * i, _MM_HINT_T1);
    // And the 32 lines that step s + 2's two tile loads read (one per table row) into L1 (each core's half of
    // the table, both streaming at once, 16 rows of x: 10.2-11.2 -> 10.7-11.9 GB/s a core; this machine's
    // plain streaming read is 13.5 GB/s a core).
    if (s + 2 < steps)
      for (int64_t r = 0; r < 32; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w_rows + r * K + (s + 2) * kDepth), _MM_HINT_T0);
    _tile_loadd(4, w_rows + s * kDepth, stride);
    _tile_loadd(5, w_rows + 16 * K + s * kDepth, stride);
    _tile_loadd(6, xb + s * 2 * kTileWords, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (rows_m > 16) {
      _tile_loadd(7, xb + (s * 2 + 1) * kTileWords, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, block[0], 64);
  _tile_stored(1, block[1], 64);
  _tile_stored(2, block[2], 64);
  _tile_stored(3, block[3], 64);
}

// Row m of x's sums against w rows [16 half, 16 half + 16) of a block: column m of a tile, one gather.
inline __m512 block_column(const TransposedBlock& block, int64_t m, int64_t half) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  return _mm512_i32gather_ps(column, &block[half * 2 + m / 16][0][m % 16], 4);
}

// The lanes of w rows [16 half, 16 half + 16) that exist among a block's `rows`.
inline __mmask16 block_lanes(int64_t rows, int64_t half) {
  return rows - 16 * half >= 16 ? 0xFFFF : (1u << (rows - 16 * half)) - 1;
}

// Rows [n_begin, n_end) of w (a multiple of 32 apart, except at N) against every row of x, 32 x 32 at a time:
// take(block, n0, rows, m0, rows_m) receives the sums of w rows [n0, n0 + rows) and x rows [m0, m0 + rows_m),
// in increasing n0.
template <typename Take>
void transposed_rows(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t n_begin, int64_t n_end,
                     const Take& take) {
  configure_tiles();
  const int64_t steps = K / kDepth, chunks = (M + kRows - 1) / kRows;
  thread_local TileVector<uint16_t> xb, tail;
  xb.resize(chunks * steps * 2 * kTileWords);
  for (int64_t c = 0; c < chunks; ++c) pack_rows_as_pairs(x, M, K, c * kRows, xb.data() + c * steps * 2 * kTileWords);
  alignas(64) TransposedBlock block;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 32) {
    const int64_t rows = std::min<int64_t>(32, n_end - n0);
    const uint16_t* w_rows = w + n0 * K;
    if (rows < 32) {  // the table's last rows: a zero-padded copy, so no tile reads past the table
      tail.assign(32 * K, 0);
      std::memcpy(tail.data(), w_rows, rows * K * sizeof(uint16_t));
      w_rows = tail.data();
    }
    const int64_t next = std::min<int64_t>(32, std::max<int64_t>(0, n_end - n0 - 32));
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t rows_m = std::min(kRows, M - c * kRows);
      transposed_block(w_rows, xb.data() + c * steps * 2 * kTileWords, K, rows_m,
                       next ? reinterpret_cast<const char*>(w + (n0 + 32) * K) : nullptr, c == 0 ? next * K * 2 : 0,
                       block);
      take(block, n0, rows, c * kRows, rows_m);
    }
  }
  _tile_release();
}

}  // namespace paged::amx::head

#endif
