// The int8 tile walk that amx_int8.cc (W8A8; weight-only int8 at decode sizes, x as digits) and amx_widened.cc
// (prompt-sized weight-only steps on bf16 tiles) share: the tile products over a panel's 4 KB steps, the block
// epilogue's per-column vectors, and the walk of a thread's panels. The layouts are amx_int8.cc's (and its int4
// fold, amx_int4.cc's, whose walk takes the constants here). Included only where the build targets AMX-INT8
// (PAGED_AMX and __AMX_INT8__).
#pragma once

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "amx_digits.h"
#include "amx_tiles.h"
#include "bf16.h"
#include "vector_math.h"

namespace paged::amx {

inline constexpr int64_t kRows = 32;             // x rows per block: two A tiles
inline constexpr int64_t kDepth = 64;            // bytes of k per tile step: 64 int8 k (or 32 bfloat16)
inline constexpr int64_t kPanel = 64;            // y columns per panel: four B tiles
inline constexpr int64_t kStepBytes = 4 * 1024;  // a panel's four B tiles for one step
inline constexpr int64_t kStepNibbles = kStepBytes / 2;  // the same step of int4 codes as stored
inline constexpr int64_t kPassBytes = 1 << 20;   // the weights of a pass of panels for steps over 16 rows: L2

// The tile product: int8 x int8 -> int32 (W8A8), or bfloat16 pairs -> float32 (int8 weights widened, x as it
// is). Both read 64-byte tile rows and 4 KB panel steps, so one walk serves both.
enum class Product { kInt8, kBf16 };

#define PAGED_TILE_PRODUCT(P, c, a, b) \
  if constexpr (P == Product::kInt8) _tile_dpbssd(c, a, b); else _tile_dpbf16ps(c, a, b)

// Vector work placed between a tile call's steps (`between`): none, or a finished block's epilogue (PendingRows).
struct NoWork {
  void step() {}
};

// sums[32][64] (row stride 64 lanes of 4 bytes), columns [0, 32) from 32 rows of a (two A tiles, rows lda
// bytes apart) against b's two column tiles over `steps` (b: a panel's [steps][4][16][64 bytes], offset to
// the first of the two). `next` (or null): next_bytes of each step from there are requested into L2;
// `between` (or null) runs after each step's products; `accumulate`: the sums are added to what is there.
template <Product P, class Between = NoWork>
inline void tile_32x32(const void* a_, int64_t lda, const void* b_, int64_t steps, void* sums_,
                       const char* next = nullptr, int64_t next_bytes = 0, Between* between = nullptr,
                       bool accumulate = false) {
  const char* a = static_cast<const char*>(a_);
  const char* b = static_cast<const char*>(b_);
  char* sums = static_cast<char*>(sums_);
  if (accumulate) {
    _tile_loadd(0, sums, 256); _tile_loadd(1, sums + 64, 256);
    _tile_loadd(2, sums + 16 * 256, 256); _tile_loadd(3, sums + 16 * 256 + 64, 256);
  } else {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (next) prefetch_into_l2(next + s * kStepBytes, next_bytes);
    _tile_loadd(4, a + s * kDepth, lda);
    _tile_loadd(5, a + 16 * lda + s * kDepth, lda);
    _tile_loadd(6, b + s * kStepBytes, 64);
    _tile_loadd(7, b + s * kStepBytes + 1024, 64);
    PAGED_TILE_PRODUCT(P, 0, 4, 6);
    PAGED_TILE_PRODUCT(P, 1, 4, 7);
    PAGED_TILE_PRODUCT(P, 2, 5, 6);
    PAGED_TILE_PRODUCT(P, 3, 5, 7);
    if (between) between->step();
  }
  _tile_stored(0, sums, 256); _tile_stored(1, sums + 64, 256);
  _tile_stored(2, sums + 16 * 256, 256); _tile_stored(3, sums + 16 * 256 + 64, 256);
}

// sums[16][64] from 16 rows of a against the panel's four column tiles; `stream`: the panel comes from memory,
// and the page two steps ahead is started.
template <Product P>
inline void tile_16x64(const void* a_, int64_t lda, const void* b_, int64_t steps, void* sums_, bool stream) {
  const char* a = static_cast<const char*>(a_);
  const char* b = static_cast<const char*>(b_);
  char* sums = static_cast<char*>(sums_);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    if (stream) start_page_stream(b + (s + 2) * kStepBytes);
    _tile_loadd(4, a + s * kDepth, lda);
    _tile_loadd(6, b + s * kStepBytes, 64);
    _tile_loadd(7, b + s * kStepBytes + 1024, 64);
    PAGED_TILE_PRODUCT(P, 0, 4, 6);
    PAGED_TILE_PRODUCT(P, 1, 4, 7);
    _tile_loadd(6, b + s * kStepBytes + 2048, 64);
    _tile_loadd(7, b + s * kStepBytes + 3072, 64);
    PAGED_TILE_PRODUCT(P, 2, 4, 6);
    PAGED_TILE_PRODUCT(P, 3, 4, 7);
  }
  _tile_stored(0, sums, 256); _tile_stored(1, sums + 64, 256);
  _tile_stored(2, sums + 128, 256); _tile_stored(3, sums + 192, 256);
}

// The float32 values of a block's row r, 16 columns v: sums * x_scale * w_scale - the zero points' share + bias.
struct BlockScales {
  __m512 w_scale[4], offset[4], bias[4];
  BlockScales() = default;
  BlockScales(const W8A8Weights& w, int64_t n0) {
    for (int v = 0; v < 4; ++v) {
      w_scale[v] = w.w_scale ? _mm512_loadu_ps(w.w_scale + n0 + 16 * v) : _mm512_set1_ps(1.0f);
      offset[v] = w.zero_offsets ? _mm512_loadu_ps(w.zero_offsets + n0 + 16 * v) : _mm512_setzero_ps();
      bias[v] = w.bias ? _mm512_loadu_ps(w.bias + n0 + 16 * v) : _mm512_setzero_ps();
    }
  }
  // Zero points: W = q * scale - offset, so x W = the codes' product less (x's dequantized sum) * offset.
  __m512 value(const int32_t* sums, int64_t r, int v, __m512 row_scale, __m512 row_sum) const {
    const __m512 product = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * 64 + 16 * v)), row_scale), w_scale[v]);
    return _mm512_add_ps(_mm512_fnmadd_ps(row_sum, offset[v], product), bias[v]);
  }
};

// sums[32 or 16][64] of a block of `rows` rows of a against a panel's weights b; over 16 rows, `next` (or null):
// each step's next_bytes from there, then the next_bytes after them, are requested into L2, and `between` (or
// null) runs after each step's products.
template <Product P = Product::kInt8, class Between = NoWork>
inline void block_sums(const void* a, int64_t lda, const void* b, int64_t steps, int64_t rows, bool stream,
                       void* sums, const void* next = nullptr, int64_t next_bytes = 0, Between* between = nullptr) {
  if (rows <= 16) {
    tile_16x64<P>(a, lda, b, steps, sums, stream);
  } else {
    const char* n = static_cast<const char*>(next);
    tile_32x32<P>(a, lda, b, steps, sums, n, next_bytes, between);
    tile_32x32<P>(a, lda, static_cast<const char*>(b) + 2048, steps, static_cast<char*>(sums) + 128,
                  n ? n + next_bytes : nullptr, next_bytes, between);
  }
}

// A finished block's epilogue, run a few rows after each tile step of the next block's products. Run after
// its tile calls, a block's epilogue (scales, silu, rounding, y's stores) keeps the tiles waiting: a gated
// 32 x 64 block of the 0.5B shape's gate/up takes ~1 us of vector work (8 ns per 16 outputs) against ~2.2 us
// of tile products (224 at ~10 ns). Spread over the next block's steps, those vector instructions run while
// the tile unit works (one-thread tile loop, 2,048 x 896 x 2 x 576 gated: 1.93 -> 1.43 ms). `finish` must
// take any one row of a block alone (finish(sums + i * 64, up_sums + i * 64, r0 + i, 1, n0)).
template <class Finish>
struct PendingRows {
  const Finish& finish;
  const int32_t* sums = nullptr;
  const int32_t* up_sums = nullptr;
  int64_t r0 = 0, rows = 0, n0 = 0, next = 0, per_step = 1;

  void step() {
    for (int64_t end = std::min(rows, next + per_step); next < end; ++next)
      finish(sums + next * kPanel, up_sums + next * kPanel, r0 + next, 1, n0);
  }
  void rest() {
    per_step = rows;
    step();
  }
};

// Panels [p_begin, p_end) of `rows` rows of int8 codes (`codes`: [row blocks][32][steps * 64]) against w's
// packed codes (and up's, or null), K deep. Each block's int32 sums go to finish(sums, up_sums, r0, rows, n0) as
// soon as they are in, or with `rowwise`, spread over the next block's tile steps (below). (Running the previous
// block's epilogue whole between this block's tile calls, in the stall after their tile stores as amx.cc's
// gated call does, was slower: the 0.5B shape's MLP at 2,048 rows, alternating processes, 40-42 against
// 47.6-48.9 ms. A few rows after each step is what overlaps.)
//
// 17 to 64 rows (W8A8, and weight-only int8's digits from 5 rows of x) go panel by panel: both row blocks of a
// panel, while the next panel is requested into L2 a slice of each step at a time, spread over all of this
// panel's tile calls. Without that the second block's products from L2 did not overlap the next panel's reads:
// at 16 rows of x (64 digit rows), 0.5B gate/up-sized layers streaming from memory read the codes at 13.5-13.8
// GB/s, and 19.2-20.4 with it (8 rows: 18.1-19.5 against 23.9-25.0).
//
// `rowwise` (finish takes single rows, as PendingRows needs): blocks over 16 rows are finished a few rows at a
// time between the next block's tile steps, their sums kept in the other of two buffers meanwhile.
template <class Finish>
inline void int8_panels(const int8_t* w, const int8_t* up, int64_t rows, int64_t K, const int8_t* codes,
                        int64_t p_begin, int64_t p_end, const Finish& finish, bool rowwise = false) {
  alignas(64) int32_t sums_in[2][kRows * kPanel], up_sums_in[2][kRows * kPanel];
  PendingRows<Finish> pending{finish};
  int64_t buffer = 0;
  configure_tiles();
  const int64_t steps = (K + kDepth - 1) / kDepth, lda = steps * kDepth, panel_bytes = steps * kStepBytes;
  const int64_t row_blocks = (rows + kRows - 1) / kRows, weights = up ? 2 : 1;
  const bool panel_major = rows > 16 && row_blocks <= 2;  // x's codes stay in L1/L2 across the panels
  // The blocks that share the next panel's prefetch: those over 16 rows (tile_32x32's), a slice of a step each.
  const int64_t prefetching = rows - kRows > 16 ? 2 : 1, chunk = kStepBytes / (2 * prefetching);
  const int64_t panels_per_pass =
      rows <= 16 || panel_major ? 1 : std::max<int64_t>(1, kPassBytes / (weights * panel_bytes));
  for (int64_t p0 = p_begin; p0 < p_end; p0 += panels_per_pass) {
    const int64_t np = std::min(panels_per_pass, p_end - p0);
    for (int64_t mb = 0; mb < row_blocks; ++mb) {
      const int64_t r0 = mb * kRows, block_rows = std::min(kRows, rows - r0);
      const int8_t* a = codes + r0 * lda;
      for (int64_t p = p0; p < p0 + np; ++p) {
        const bool ahead = panel_major && mb < prefetching && p + 1 < p_end;
        const int64_t at = (p + 1) * panel_bytes + mb * 2 * chunk;
        int32_t *sums = sums_in[buffer], *up_sums = up_sums_in[buffer];
        const bool interleave = rowwise && block_rows > 16;
        PendingRows<Finish>* between = interleave ? &pending : nullptr;
        block_sums(a, lda, w + p * panel_bytes, steps, block_rows, mb == 0, sums, ahead ? w + at : nullptr, chunk,
                   between);
        if (up)
          block_sums(a, lda, up + p * panel_bytes, steps, block_rows, mb == 0, up_sums, ahead ? up + at : nullptr,
                     chunk, between);
        if (!interleave) {
          finish(sums, up_sums, r0, block_rows, p * kPanel);
          continue;
        }
        pending.rest();  // what the steps left of the previous block
        // This block's rows over its successor's steps (2 tile calls a weight, `steps` each), all by their end.
        const int64_t successor_steps = 2 * weights * steps;
        pending.sums = sums, pending.up_sums = up_sums, pending.r0 = r0, pending.rows = block_rows;
        pending.n0 = p * kPanel, pending.next = 0;
        pending.per_step = (block_rows + successor_steps - 1) / successor_steps;
        buffer ^= 1;
      }
    }
  }
  pending.rest();
  _tile_release();
}

#if defined(__AVX512BF16__)
// y's rows [m0, m0 + rows) x 64 columns from n0 from float32 sums: sums * w_scale - x's row sum * offset + bias
// (gated: silu of that times up's).
inline void finish_weights_block(const Int8WeightsCall& call, const float* sums, const float* up_sums,
                                 int64_t m0, int64_t rows, int64_t n0, const float* x_sums) {
  const BlockScales w(call.w, n0);
  const BlockScales up = call.up ? BlockScales(*call.up, n0) : w;
  auto value = [](const BlockScales& b, const float* block, int64_t r, int v, __m512 row_sum) {
    const __m512 product = _mm512_mul_ps(_mm512_load_ps(block + r * 64 + 16 * v), b.w_scale[v]);
    return _mm512_add_ps(_mm512_fnmadd_ps(row_sum, b.offset[v], product), b.bias[v]);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const __m512 row_sum = _mm512_set1_ps(x_sums[m]);
    for (int v = 0; v < 4; ++v) {
      __m512 out = value(w, sums, r, v, row_sum);
      if (call.up) out = _mm512_mul_ps(silu512(out), value(up, up_sums, r, v, row_sum));
      if (call.y_bf16) {
        store_product_bf16x16(static_cast<uint16_t*>(call.y) + m * call.N + n0 + 16 * v, out);
      } else {
        _mm512_storeu_ps(static_cast<float*>(call.y) + m * call.N + n0 + 16 * v, out);
      }
    }
  }
}
#endif

}  // namespace paged::amx
